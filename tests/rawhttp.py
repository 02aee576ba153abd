"""HTTP/1.1 over a plain socket, for tests that must control exactly what is sent and when."""

from __future__ import annotations

import socket


def send_request(
    port: int, body: bytes = b"", *, path: str = "/v1/infer", headers: dict[str, str] | None = None,
    content_length: bool = True,
) -> socket.socket:  # fmt: skip
    sock = socket.create_connection(("127.0.0.1", port), timeout=30)
    lines = [f"POST {path} HTTP/1.1", "Host: 127.0.0.1", "Content-Type: application/json"]
    if content_length:
        lines.append(f"Content-Length: {len(body)}")
    lines += [f"{k}: {v}" for k, v in (headers or {}).items()]
    sock.sendall(("\r\n".join(lines) + "\r\n\r\n").encode() + body)
    return sock


def read_response(sock: socket.socket) -> tuple[int, dict[str, str], bytes]:
    """Read one response with a Content-Length body."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionError(f"connection closed after {data!r}")
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    status_line, *header_lines = head.decode("latin-1").split("\r\n")
    headers = {}
    for line in header_lines:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    length = int(headers.get("content-length", "0"))
    while len(body) < length:
        chunk = sock.recv(65536)
        if not chunk:
            break
        body += chunk
    return int(status_line.split()[1]), headers, body


def data_segments_received(sock: socket.socket) -> tuple[int, int]:
    """TCP segments that carried data to ``sock`` since it connected, and their bytes, as the
    kernel counts them (``TCP_INFO``: ``tcpi_data_segs_in``, ``tcpi_bytes_received``). On
    loopback one ``send()`` of a few KiB arrives as one segment and two sends as two: a test
    can tell from the client side how many writes an answer left the server in."""
    raw = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 256)
    bytes_received = int.from_bytes(raw[128:136], "little")
    data_segs_in = int.from_bytes(raw[152:156], "little")
    return data_segs_in, bytes_received


def get(port: int, path: str) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=30)
    sock.sendall(f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n".encode())
    return sock


class CountingReader:
    """A socket's ``recv`` that counts the bytes it returned (for ``read_response``)."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock, self.num_bytes = sock, 0

    def recv(self, size: int) -> bytes:
        data = self.sock.recv(size)
        self.num_bytes += len(data)
        return data
