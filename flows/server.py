"""The Prefect API for a command-line run: a running server if there is one, else a temporary one of ours.

Prefect's own temporary server outlives a process killed with SIGKILL (seen 4 of 4 times here), holding
its port. Ours is the same server (uvicorn + Prefect's app factory, the same environment Prefect uses)
in a child that exits as soon as its parent is gone: it watches a pipe from the parent, which the
kernel closes however the parent dies, and on Linux it also asks for SIGKILL at the parent's death.

Order: ``PREFECT_API_URL`` (environment or profile) -> a healthy server at 127.0.0.1:$PREFECT_PORT
(4200 by default: ``make server`` / ``make stack``) -> a temporary server, started here (5-15 s).
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator

from training.processes import die_with_parent

log = logging.getLogger(__name__)


def healthy(api_url: str, timeout: float = 0.5) -> bool:
    try:
        with urllib.request.urlopen(f"{api_url.rstrip('/')}/health", timeout=timeout) as answer:
            return answer.status == 200 and answer.read().strip() == b"true"
    except (OSError, ValueError):
        return False


@contextlib.contextmanager
def prefect_api(start_timeout: float = 120.0) -> Iterator[str]:
    """Yields the API URL this process talks to for the duration of the block."""
    from prefect.settings import PREFECT_API_URL, temporary_settings

    configured = PREFECT_API_URL.value()
    if configured:
        yield configured
        return
    local = f"http://127.0.0.1:{os.environ.get('PREFECT_PORT', '4200')}/api"
    if healthy(local):
        log.info("using the Prefect server at %s (found running)", local)
        with temporary_settings(updates={PREFECT_API_URL: local}):
            yield local
        return
    with _temporary_server(start_timeout) as url, temporary_settings(updates={PREFECT_API_URL: url}):
        yield url


@contextlib.contextmanager
def _temporary_server(timeout: float) -> Iterator[str]:
    port = free_port()
    url = f"http://127.0.0.1:{port}/api"
    env = {**os.environ, "PREFECT_UI_ENABLED": "0", "PREFECT__SERVER_EPHEMERAL": "1", "PREFECT__SERVER_FINAL": "1"}
    env.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    print(f"starting a temporary Prefect server on {url} (a running one is faster: make server)", file=sys.stderr)
    proc = subprocess.Popen(
        [sys.executable, "-m", "flows.server", str(port)],
        stdin=subprocess.PIPE,
        env=env,
        preexec_fn=die_with_parent,
    )
    try:
        deadline = time.monotonic() + timeout
        while not healthy(url, timeout=1.0):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the temporary Prefect server did not start (exit code {proc.poll()}); set "
                                   f"PREFECT_API_URL to a running server or start one with `make server`")  # fmt: skip
            time.sleep(0.1)
        yield url
    finally:
        _drain_to_api()
        if proc.stdin is not None:
            proc.stdin.close()  # the server's signal to stop
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _drain_to_api(timeout: float = 10.0) -> None:
    """Sends the flow's buffered log lines and events while the temporary server still listens: drained at
    interpreter exit instead, they met a closed port and printed 'Error logging to API' at the terminal."""
    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker

    for worker in (APILogWorker, EventsWorker):
        try:
            worker.drain_all(timeout=timeout)
        except Exception as exc:  # never let the log shipping decide how the run ends
            log.debug("draining %s: %s", worker.__name__, exc)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (tests, bench and deployments use it too)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve(port: int) -> None:
    """The temporary server itself: exits at once when the parent closes the pipe or dies."""
    import uvicorn

    def exit_when_parent_goes() -> None:
        sys.stdin.buffer.read()  # returns at EOF
        os._exit(0)

    threading.Thread(target=exit_when_parent_goes, daemon=True).start()
    uvicorn.run(
        "prefect.server.api.server:create_app",
        factory=True,
        host="127.0.0.1",
        port=port,
        log_level="error",
        lifespan="on",
    )


if __name__ == "__main__":
    _serve(int(sys.argv[1]))
