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
