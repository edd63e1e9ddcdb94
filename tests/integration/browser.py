"""Headless Chromium for the UI test: find it (installing Debian's package when it is missing), drive a page.

The Prefect UI is a single-page app: the HTML the server sends holds no run data, so the test must read what
a browser renders. ``chromium --dump-dom`` is enough for a page reached by its URL alone (an artifact's
page), but the flow run page resets ``?tab=Artifacts`` to the Logs tab (the tab is hidden until the run has
loaded), so a person's click on "Artifacts" is needed. The test therefore drives Chromium through its
DevTools protocol (a websocket; the ``websockets`` package Prefect itself uses): open a URL, wait until the
rendered text (``document.body.innerText``, what a person reads) holds what we expect, click a tab, take a
screenshot of what a person sees.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest

NAMES = ("chromium", "chromium-browser", "google-chrome")
FLAGS = [
    "--headless",
    "--no-sandbox",  # CI runs as root, where Chromium's sandbox refuses to start
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--hide-scrollbars",
]


def find() -> str | None:
    return next((path for name in NAMES if (path := shutil.which(name))), None)


def find_or_install() -> str:
    """Chromium's path; Debian's ``chromium`` package is installed when missing (~60 s), else ``pytest.skip``
    says why it cannot be had here."""
    found = find()
    if found:
        return found
    if shutil.which("apt-get") is None:
        pytest.skip("headless Chromium is missing and there is no apt-get to install it: install chromium")
    prefix = [] if os.geteuid() == 0 else ["sudo", "-n"]
    if prefix and shutil.which("sudo") is None:
        pytest.skip("headless Chromium is missing and installing it needs root: run `apt-get install -y chromium`")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    wait_for_lock = ["-o", "DPkg::Lock::Timeout=300"]  # another apt-get on the machine may hold the lock
    for args in (["update"], ["install", "-y", "--no-install-recommends", "chromium"]):
        proc = subprocess.run(
            [*prefix, "apt-get", *wait_for_lock, *args], env=env, capture_output=True, text=True, timeout=900
        )
        if proc.returncode != 0:
            pytest.skip(
                f"headless Chromium is missing and `apt-get {' '.join(args)}` failed (exit {proc.returncode}): "
                f"{(proc.stderr or proc.stdout).strip()[-400:]}"
            )
    found = find()
    if found is None:
        pytest.skip("apt-get installed chromium but no chromium binary is on PATH")
    return found


class Page:
    """One headless Chromium with one tab, driven over the DevTools protocol. Use as a context manager."""

    def __init__(self, binary: str, width: int = 1400, height: int = 1000):
        self.binary, self.width, self.height = binary, width, height
        self._ids = 0

    def __enter__(self) -> Page:
        from websockets.sync.client import connect

        self._profile = tempfile.TemporaryDirectory(prefix="chromium-", ignore_cleanup_errors=True)
        self._proc = subprocess.Popen(
            [
                self.binary,
                *FLAGS,
                f"--user-data-dir={self._profile.name}",
                f"--window-size={self.width},{self.height}",
                "--remote-debugging-address=127.0.0.1",
                "--remote-debugging-port=0",  # Chromium picks a free port and writes it to DevToolsActivePort
                "about:blank",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        try:
            port = self._devtools_port()
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=10) as response:
                target = next(t for t in json.load(response) if t["type"] == "page")
            self._ws = connect(target["webSocketDebuggerUrl"], max_size=None, open_timeout=30)
            self.call(
                "Emulation.setDeviceMetricsOverride",
                width=self.width,
                height=self.height,
                deviceScaleFactor=1,
                mobile=False,
            )
        except BaseException:
            self._stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        with contextlib.suppress(Exception):  # the browser may already have closed it
            self._ws.close()
        self._stop()

    def _stop(self) -> None:
        """Ends Chromium's whole process group (its renderer and GPU helpers too), then removes the profile."""
        for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, 10)):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self._proc.pid, sig)
            try:
                self._proc.wait(timeout=wait)
            except subprocess.TimeoutExpired:
                continue
            deadline = time.monotonic() + wait
            while _group_alive(self._proc.pid) and time.monotonic() < deadline:
                time.sleep(0.1)
            if not _group_alive(self._proc.pid):
                break
        self._profile.cleanup()

    def _devtools_port(self, timeout: float = 60) -> int:
        marker = Path(self._profile.name) / "DevToolsActivePort"
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise RuntimeError(f"chromium exited with {self._proc.returncode} before its DevTools port opened")
            lines = marker.read_text().splitlines() if marker.exists() else []
            if lines and lines[0].isdigit():
                return int(lines[0])
            time.sleep(0.1)
        raise TimeoutError(f"chromium wrote no DevTools port in {timeout}s")

    def call(self, method: str, **params) -> dict:
        """One DevTools command; events that arrive meanwhile are dropped (nothing here listens to them)."""
        self._ids += 1
        self._ws.send(json.dumps({"id": self._ids, "method": method, "params": params}))
        while True:
            message = json.loads(self._ws.recv(timeout=120))
            if message.get("id") == self._ids:
                if "error" in message:
                    raise RuntimeError(f"{method}: {message['error']}")
                return message.get("result", {})

    def evaluate(self, expression: str):
        result = self.call("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression!r} raised in the page: {result['exceptionDetails']}")
        return result["result"].get("value")

    def goto(self, url: str) -> None:
        self.call("Page.navigate", url=url)

    def text(self) -> str:
        """What a person reads: the rendered text of the page (hidden elements excluded)."""
        return self.evaluate("document.body ? document.body.innerText : ''") or ""

    def wait_for(self, condition, what: str, timeout: float = 60):
        """Polls ``condition(page)`` until it returns something truthy; the page's text is in the error."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = condition(self)
            if found:
                return found
            time.sleep(0.5)
        raise AssertionError(f"timed out after {timeout}s waiting for {what}; the page reads:\n{self.text()[:4000]}")

    def click(self, selector: str, text: str) -> None:
        """Clicks the first element matching ``selector`` whose text is ``text``, as a person would."""
        clicked = self.evaluate(
            f"(() => {{ const el = [...document.querySelectorAll({json.dumps(selector)})]"
            f".find(e => e.innerText.trim() === {json.dumps(text)}); if (el) el.click(); return !!el; }})()"
        )
        if not clicked:
            raise AssertionError(f"no {selector!r} reads {text!r}; the page reads:\n{self.text()[:4000]}")

    def screenshot(self, out: Path) -> Path:
        data = self.call("Page.captureScreenshot", format="png")["data"]
        out.write_bytes(base64.b64decode(data))
        return out


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True
