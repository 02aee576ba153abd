"""A real headless Chromium (Debian's package), driven over its DevTools protocol."""

from __future__ import annotations

import base64
import contextlib
import json
import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
from websockets.sync.client import ClientConnection, connect

from tests.ci import unavailable
from tests.servers import free_port


def require_chromium() -> str:
    """Chromium's path; without it, fail in CI (``.ci/run`` installs it) and skip elsewhere."""
    path = shutil.which("chromium") or shutil.which("chromium-browser")
    if path is None:
        message = "chromium is not installed (apt-get install chromium, as .ci/run does)"
        unavailable(message)
    return path


# Wraps the 2D canvas's fillText so that a page's charts can be checked for overlapping text:
# each canvas keeps the bounding box (in canvas pixels, after the current transform, so rotated
# axis labels too) of every text drawn since it was last cleared whole.
CANVAS_TEXT_SCRIPT = """
(() => {
  const proto = CanvasRenderingContext2D.prototype;
  const fillText = proto.fillText, clearRect = proto.clearRect;
  const drawn = new WeakMap();
  window.canvasTextBoxes = (canvas) => drawn.get(canvas) || [];
  proto.clearRect = function (x, y, w, h) {
    if (x <= 0 && y <= 0 && w >= this.canvas.width && h >= this.canvas.height)
      drawn.set(this.canvas, []);
    return clearRect.apply(this, arguments);
  };
  proto.fillText = function (text, x, y) {
    const m = this.measureText(text), t = this.getTransform();
    const corners = [];
    for (const px of [x - m.actualBoundingBoxLeft, x + m.actualBoundingBoxRight])
      for (const py of [y - m.actualBoundingBoxAscent, y + m.actualBoundingBoxDescent])
        corners.push([t.a * px + t.c * py + t.e, t.b * px + t.d * py + t.f]);
    const xs = corners.map((c) => c[0]), ys = corners.map((c) => c[1]);
    if (!drawn.has(this.canvas)) drawn.set(this.canvas, []);
    drawn.get(this.canvas).push({ text: String(text), left: Math.min(...xs),
      right: Math.max(...xs), top: Math.min(...ys), bottom: Math.max(...ys) });
    return fillText.apply(this, arguments);
  };
})();
"""


def overlapping(boxes: list[dict[str, Any]], slack_px: float = 0.5) -> list[tuple[str, str]]:
    """The pairs of texts whose boxes (from ``CANVAS_TEXT_SCRIPT``) overlap."""
    found = []
    for i, a in enumerate(boxes):
        for b in boxes[i + 1 :]:
            width = min(a["right"], b["right"]) - max(a["left"], b["left"])
            height = min(a["bottom"], b["bottom"]) - max(a["top"], b["top"])
            if width > slack_px and height > slack_px:
                found.append((a["text"], b["text"]))
    return found


class Page:
    """One tab: send commands, keep every event (console, exceptions, network) for checks."""

    def __init__(self, ws: ClientConnection) -> None:
        self._ws = ws
        self._next_id = 0
        self.events: list[dict[str, Any]] = []
        self._credentials: tuple[str, str] | None = None

    def answer_auth_prompts(self, username: str, password: str) -> None:
        """Answer every HTTP auth challenge as a person at the browser's prompt would."""
        self._credentials = (username, password)
        self.send("Fetch.enable", handleAuthRequests=True, patterns=[{"urlPattern": "*"}])

    def _post(self, method: str, **params: Any) -> None:
        self._next_id += 1
        self._ws.send(json.dumps({"id": self._next_id, "method": method, "params": params}))

    def _handle(self, event: dict[str, Any]) -> None:
        method, params = event.get("method"), event.get("params", {})
        if method == "Fetch.requestPaused":
            self._post("Fetch.continueRequest", requestId=params["requestId"])
        elif method == "Fetch.authRequired" and self._credentials is not None:
            username, password = self._credentials
            self._post(
                "Fetch.continueWithAuth", requestId=params["requestId"],
                authChallengeResponse={"response": "ProvideCredentials", "username": username,
                                       "password": password},
            )  # fmt: skip

    def send(self, method: str, timeout_s: float = 20, **params: Any) -> dict[str, Any]:
        self._next_id += 1
        message_id = self._next_id
        self._ws.send(json.dumps({"id": message_id, "method": method, "params": params}))
        deadline = time.monotonic() + timeout_s
        while True:
            message = json.loads(self._ws.recv(timeout=max(0.01, deadline - time.monotonic())))
            if message.get("id") == message_id:
                if "error" in message:
                    raise RuntimeError(f"{method}: {message['error']}")
                return message.get("result", {})
            if "method" in message:
                self.events.append(message)
                self._handle(message)

    def evaluate(self, expression: str) -> Any:
        result = self.send(
            "Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True
        )
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression}: {result['exceptionDetails']}")
        return result["result"].get("value")

    def wait_for(self, expression: str, timeout_s: float = 20) -> Any:
        """Evaluate until the value is truthy (a guard against hangs, not a proof of absence)."""
        deadline = time.monotonic() + timeout_s
        while True:
            value = self.evaluate(expression)
            if value:
                return value
            if time.monotonic() > deadline:
                raise TimeoutError(f"never true: {expression}")
            time.sleep(0.2)

    def record_canvas_text(self) -> None:
        """From the next navigation on, keep every canvas's text boxes
        (``window.canvasTextBoxes(canvas)``)."""
        self.send("Page.addScriptToEvaluateOnNewDocument", source=CANVAS_TEXT_SCRIPT)

    def navigate(self, url: str) -> None:
        self.send("Page.navigate", url=url)
        self.wait_for("document.readyState === 'complete'")

    def screenshot(self, path: Path) -> None:
        data = self.send("Page.captureScreenshot", format="png")["data"]
        path.write_bytes(base64.b64decode(data))

    def errors(self) -> list[str]:
        """Uncaught exceptions, console.error calls and the browser's own error entries (a
        failed resource load, a blocked request)."""
        found = []
        for event in self.events:
            method, params = event.get("method"), event.get("params", {})
            if method == "Runtime.exceptionThrown":
                found.append(json.dumps(params["exceptionDetails"])[:500])
            elif method == "Runtime.consoleAPICalled" and params.get("type") == "error":
                found.append(json.dumps(params.get("args"))[:500])
            elif method == "Log.entryAdded" and params["entry"].get("level") == "error":
                found.append(f"{params['entry'].get('url')}: {params['entry'].get('text')}")
        return found

    def requested_urls(self) -> list[str]:
        return [
            e["params"]["request"]["url"]
            for e in self.events
            if e.get("method") == "Network.requestWillBeSent"
        ]


@contextlib.contextmanager
def open_page(tmp_path: Path, *, width: int = 1280, height: int = 1100) -> Iterator[Page]:
    """Start Chromium headless on a loopback debugging port and open one page in it."""
    chromium = require_chromium()
    port = free_port()
    profile = tmp_path / "chromium-profile"
    log_path = tmp_path / "chromium.log"
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
             "--disable-dev-shm-usage", "--disable-extensions", "--mute-audio",
             "--disable-background-networking", "--disable-component-update",
             f"--remote-debugging-port={port}", "--remote-debugging-address=127.0.0.1",
             f"--user-data-dir={profile}", f"--window-size={width},{height}", "about:blank"],
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            env={**os.environ, "TMPDIR": str(tmp_path)},  # its own scratch folders go there
        )  # fmt: skip
    try:
        deadline = time.monotonic() + 30
        while True:
            with contextlib.suppress(httpx.TransportError, ValueError, StopIteration):
                targets = httpx.get(f"http://127.0.0.1:{port}/json/list", timeout=2).json()
                target = next(t for t in targets if t.get("type") == "page")
                break
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"chromium did not start:\n{log_path.read_text()}")
            time.sleep(0.1)
        with connect(target["webSocketDebuggerUrl"], max_size=64 * 2**20) as ws:
            page = Page(ws)
            for domain in ("Page", "Runtime", "Log", "Network"):
                page.send(f"{domain}.enable")
            yield page
    finally:
        process.terminate()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(10)
