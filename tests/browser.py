"""A real browser for tests: Debian's headless Chromium driven over its DevTools protocol.

:func:`chromium` starts ``chromium --headless`` with a remote-debugging port (WebGL through
SwiftShader, so plotly's 3-D scenes render without a GPU) and yields a :class:`Page` on one tab:
navigate, evaluate JavaScript (awaiting promises), press keys (real input events) and take
screenshots. The browser's process group is killed when the context exits. Tests skip, with the
reason, where no ``chromium`` binary is installed (``apt-get install -y chromium``; the Makefile's
test target installs it).
"""

from __future__ import annotations

import base64
import contextlib
import itertools
import json
import os
import shutil
import signal
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

CHROMIUM_FLAGS: tuple[str, ...] = (
    "--headless",
    "--no-sandbox",  # root in a container
    "--disable-gpu",
    "--use-angle=swiftshader",
    "--enable-unsafe-swiftshader",  # WebGL on the CPU rasteriser
    "--no-first-run",
    "--no-default-browser-check",
    "--disable-extensions",
    "--disable-dev-shm-usage",
    "--hide-scrollbars",
    # iframes in the page's process: a sandboxed frame (MLflow's HTML artifact view) is then in the
    # page's frame tree, where a test can evaluate in it
    "--disable-site-isolation-trials",
    "--disable-features=IsolateOrigins,site-per-process",
)

KEY_CODES: dict[str, int] = {"ArrowRight": 39, "ArrowLeft": 37, "Home": 36, "End": 35}


def chromium_binary() -> str:
    """The Chromium executable, or a pytest skip saying how to install it."""
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if found is None:
        pytest.skip("no chromium binary: apt-get install -y chromium (make test installs it)")
    return found


class Page:
    """One tab over the DevTools protocol (a synchronous websocket client)."""

    def __init__(self, ws_url: str):
        from websockets.sync.client import connect

        # entered by hand (websockets warns on a connection used outside ``with``); close() ends it
        self._ws = connect(ws_url, max_size=64 * 2**20, open_timeout=30).__enter__()
        self._ids = itertools.count(1)
        self.console: list[str] = []
        self.call("Page.enable")
        self.call("Runtime.enable")

    def call(self, method: str, timeout: float = 60.0, **params: Any) -> dict:
        """Send a command and return its result; an error reply raises RuntimeError."""
        msg_id = next(self._ids)
        self._ws.send(json.dumps({"id": msg_id, "method": method, "params": params}))
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"{method}: no reply within {timeout} s")
            msg = json.loads(self._ws.recv(timeout=left))
            if msg.get("method") == "Runtime.consoleAPICalled":
                self.console.append(
                    " ".join(str(a.get("value", a.get("description"))) for a in msg["params"]["args"])
                )
            elif msg.get("method") == "Runtime.exceptionThrown":
                self.console.append("exception: " + json.dumps(msg["params"]["exceptionDetails"])[:2000])
            if msg.get("id") == msg_id:
                if "error" in msg:
                    raise RuntimeError(f"{method}: {msg['error']}")
                return msg.get("result", {})

    def goto(self, url: str) -> None:
        self.call("Page.navigate", url=url)

    def evaluate(self, expression: str, timeout: float = 60.0, context: int | None = None) -> Any:
        """The value of a JavaScript expression (a promise is awaited) in the page, or in an execution
        ``context`` (:meth:`frame_context`); a thrown error raises."""
        extra = {} if context is None else {"contextId": context}
        result = self.call(
            "Runtime.evaluate",
            timeout=timeout,
            expression=expression,
            awaitPromise=True,
            returnByValue=True,
            **extra,
        )
        if "exceptionDetails" in result:
            raise RuntimeError(f"JavaScript error: {json.dumps(result['exceptionDetails'])[:2000]}")
        return result["result"].get("value")

    def child_frames(self) -> list[dict]:
        """The frames inside the page's main frame (``Page.getFrameTree``), e.g. a sandboxed iframe."""
        tree = self.call("Page.getFrameTree")["frameTree"]
        return [child["frame"] for child in tree.get("childFrames", [])]

    def frame_context(self, frame_id: str) -> int:
        """An execution context in a frame (an isolated world: the frame's DOM, not its scripts'
        globals), which reaches into a sandboxed cross-origin iframe the page's own scripts cannot."""
        return self.call("Page.createIsolatedWorld", frameId=frame_id, worldName="test")["executionContextId"]

    def wait_for(
        self, expression: str, timeout: float = 60.0, poll: float = 0.2, context: int | None = None
    ) -> Any:
        """Poll a JavaScript expression until it is truthy; its value. TimeoutError otherwise."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            value = self.evaluate(expression, context=context)
            if value:
                return value
            time.sleep(poll)
        raise TimeoutError(f"{expression!r} stayed falsy for {timeout} s; console: {self.console[-5:]}")

    def press(self, key: str, times: int = 1) -> None:
        """Real key presses (keyDown + keyUp) to the focused element."""
        code = KEY_CODES[key]
        for _ in range(times):
            for kind in ("rawKeyDown", "keyUp"):
                self.call("Input.dispatchKeyEvent", type=kind, key=key, code=key, windowsVirtualKeyCode=code)

    def screenshot(self) -> bytes:
        """A PNG of the whole page."""
        return base64.b64decode(
            self.call("Page.captureScreenshot", format="png", captureBeyondViewport=True)["data"]
        )

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self._ws.close()


@contextlib.contextmanager
def chromium(workdir: Path, width: int = 1400, height: int = 1800) -> Iterator[Page]:
    """Headless Chromium on a blank tab; yields its :class:`Page`."""
    binary = chromium_binary()
    profile = workdir / "chromium-profile"
    profile.mkdir(parents=True, exist_ok=True)
    port_file = profile / "DevToolsActivePort"
    port_file.unlink(missing_ok=True)  # a previous browser's, in a reused profile
    log = workdir / "chromium.log"
    cmd = [binary, *CHROMIUM_FLAGS, f"--window-size={width},{height}", "--remote-debugging-port=0",
           f"--user-data-dir={profile}", "about:blank"]  # fmt: skip
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    page = None
    try:
        deadline = time.monotonic() + 60
        while not (port_file.is_file() and port_file.read_text().strip()):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"chromium did not start: {log.read_text(errors='replace')[-3000:]}")
            time.sleep(0.1)
        port = int(port_file.read_text().split()[0])
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=30) as resp:
            targets = json.load(resp)
        tab = next(t for t in targets if t.get("type") == "page")
        page = Page(tab["webSocketDebuggerUrl"])
        yield page
    finally:
        if page is not None:
            page.close()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
