"""The Prefect API for a command-line run: a running server if there is one, else a temporary one of ours.

Prefect's own temporary server outlives a process killed with SIGKILL (seen 4 of 4 times here), holding
its port, and gives up after 20 s (it timed out at load ~15). Ours is the same server (uvicorn + Prefect's
app factory, the same environment Prefect uses) in a child that exits as soon as its parent is gone: it
watches a pipe from the parent, which the kernel closes however the parent dies, and on Linux it also asks
for SIGKILL at the parent's death. It is waited for patiently (``PATIENCE``) while it lives.

Order: ``PREFECT_API_URL`` (environment or profile) -> a healthy server at 127.0.0.1:$PREFECT_PORT
(4200 by default: ``make server`` / ``make stack``) -> a temporary server (2-3 s here on a database that
exists, 5-15 s when it must be created or the machine is loaded).

``python -m flows.train`` starts that server in its first milliseconds (``start_early``, from flows/launch.py),
before torch, Prefect and the recipe import and while the pre-flight runs, so that it comes up meanwhile;
``prefect_api`` then adopts it, or stops it when the run ends before a flow run (a pre-flight error).
"""

from __future__ import annotations

import atexit
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

from training import preemption
from training.lifetimes import die_with_parent

log = logging.getLogger(__name__)
PATIENCE = 600.0  # seconds a temporary server may take to answer while its process lives (a loaded machine)
NOTE_EVERY = 20.0  # seconds between "still starting" lines while it does not answer
_early: TemporaryServer | None = None


def healthy(api_url: str, timeout: float = 0.5) -> bool:
    try:
        with urllib.request.urlopen(f"{api_url.rstrip('/')}/health", timeout=timeout) as answer:
            return answer.status == 200 and answer.read().strip() == b"true"
    except (OSError, ValueError):
        return False


def local_api_url() -> str:
    return f"http://127.0.0.1:{os.environ.get('PREFECT_PORT', '4200')}/api"


class TemporaryServer:
    """A Prefect server in a child process of this one, on a free loopback port; it exits with this process."""

    def __init__(self) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}/api"
        self.ready = False
        env = {**os.environ, "PREFECT_UI_ENABLED": "0", "PREFECT__SERVER_EPHEMERAL": "1", "PREFECT__SERVER_FINAL": "1"}
        env.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
        print(
            f"starting a temporary Prefect server on {self.url} (a running one is faster: make server)",
            file=sys.stderr,
            flush=True,
        )
        self.started = time.monotonic()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "flows.server", str(self.port)],
            stdin=subprocess.PIPE,
            env=env,
            preexec_fn=die_with_parent,
            process_group=0,  # not the terminal's: Ctrl-C there stops the run politely, which still needs this server
        )

    def wait_ready(self, patience: float = PATIENCE) -> float:
        """Waits until the server answers, as long as its process lives (up to ``patience`` s); returns the
        seconds this call waited. A stop request (SIGTERM) meanwhile raises ``Preempted``."""
        t0 = time.monotonic()
        note_at = self.started + NOTE_EVERY  # from the server's start: an early one started before this wait
        while not healthy(self.url, timeout=1.0):
            preemption.raise_if_requested()
            now = time.monotonic()
            if self.proc.poll() is not None or now - self.started > patience:
                what = (  # before stop(), after which its process has exited either way
                    f"exited with code {self.proc.returncode}"
                    if self.proc.returncode is not None
                    else f"did not answer within {patience:.0f} s"
                )
                self.stop()
                raise RuntimeError(
                    f"the temporary Prefect server {what}; set PREFECT_API_URL to a running server "
                    f"or start one with `make server`"
                )
            if now >= note_at:  # the next note NOTE_EVERY s after this one, not after a mark this wait came after
                note_at = now + NOTE_EVERY  # (+= printed "82 s" 4 times at once after an 82 s pre-flight)
                print(
                    f"still starting the temporary Prefect server ({now - self.started:.0f} s, load average "
                    f"{os.getloadavg()[0]:.1f}); waiting while it runs",
                    file=sys.stderr,
                    flush=True,
                )
            time.sleep(0.05)
        self.ready = True
        waited = time.monotonic() - t0
        log.debug(
            "temporary Prefect server answered %.2f s after its start (waited %.2f s)",
            time.monotonic() - self.started,
            waited,
        )
        return waited

    def stop(self) -> None:
        """Ships what the run logged while the server still listens, then stops it (at once: it holds nothing
        that a later run needs beyond what its database already committed)."""
        if self.ready:
            _drain_to_api()
            self.ready = False
        if self.proc.stdin is not None and not self.proc.stdin.closed:
            self.proc.stdin.close()  # the server's signal to stop
        try:
            self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def start_early() -> None:
    """Starts the temporary server now, unless the environment or the Prefect profile names an API, or a server
    answers at 127.0.0.1:$PREFECT_PORT. Imports neither Prefect nor torch. ``prefect_api`` decides for good."""
    global _early
    if _early is None and not _api_configured_cheaply() and not _answers(local_api_url()):
        _early = TemporaryServer()


def discard_early() -> None:
    """Stops a server ``start_early`` started that no ``prefect_api`` adopted (the run ended before its flow)."""
    global _early
    server, _early = _early, None
    if server is not None:
        server.stop()


atexit.register(discard_early)


@contextlib.contextmanager
def prefect_api(patience: float = PATIENCE) -> Iterator[str]:
    """Yields the API URL this process talks to for the duration of the block (and makes its flow runs end
    without waiting on their heartbeat thread: flows/heartbeat.py)."""
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from flows import heartbeat

    heartbeat.install()
    global _early
    early, _early = _early, None
    configured = PREFECT_API_URL.value()
    local = local_api_url()
    if configured or healthy(local):
        if early is not None:
            early.stop()  # named in a place start_early does not read (a .env or prefect.toml), or just started
        if configured:
            yield configured
            return
        log.info("using the Prefect server at %s (found running)", local)
        with temporary_settings(updates={PREFECT_API_URL: local}):
            yield local
        return
    server = early or TemporaryServer()
    no_ui = _NoUiLink()
    flow_runs = logging.getLogger("prefect.flow_runs")
    try:
        server.wait_ready(patience)
        flow_runs.addFilter(no_ui)
        with temporary_settings(updates={PREFECT_API_URL: server.url}):
            yield server.url
    finally:
        flow_runs.removeFilter(no_ui)
        server.stop()


class _NoUiLink(logging.Filter):
    """The temporary server serves the API only: Prefect's "View at <url>" line would point at a page that answers
    404, so it is replaced, once, by where a UI can be had."""

    def __init__(self) -> None:
        super().__init__()
        self.said = False

    def filter(self, record: logging.LogRecord) -> bool:
        if not str(record.msg).startswith("View at "):
            return True
        if self.said:
            return False
        self.said = True
        record.msg, record.args = NO_UI, ()
        return True


NO_UI = (
    "no Prefect UI for this run (a temporary server, API only); for the UI and run history, start "
    "`make server` in another terminal first, or set PREFECT_API_URL"
)


def _api_configured_cheaply() -> bool:
    """PREFECT_API_URL in the environment or in the active Prefect profile (profiles.toml), read without
    importing Prefect (~0.7 s)."""
    if os.environ.get("PREFECT_API_URL"):
        return True
    import tomllib

    home = os.environ.get("PREFECT_HOME") or os.path.join(os.path.expanduser("~"), ".prefect")
    path = os.environ.get("PREFECT_PROFILES_PATH") or os.path.join(home, "profiles.toml")
    try:
        with open(path, "rb") as f:
            profiles = tomllib.load(f)
    except (OSError, tomllib.TOMLDecodeError):
        return False
    active = os.environ.get("PREFECT_PROFILE") or profiles.get("active") or "ephemeral"
    settings = profiles.get("profiles", {}).get(active, {})
    return isinstance(settings, dict) and bool(settings.get("PREFECT_API_URL"))


def _answers(api_url: str) -> bool:
    """A healthy server at ``api_url``; a refused connection (nothing listens) costs well under a millisecond."""
    host, port = api_url.split("//", 1)[1].split("/", 1)[0].rsplit(":", 1)
    try:
        socket.create_connection((host, int(port)), timeout=0.5).close()
    except OSError:
        return False
    return healthy(api_url)


def _drain_to_api(timeout: float = 10.0) -> None:
    """Sends the flow's buffered log lines and events while the temporary server still listens: drained at
    interpreter exit instead, they met a closed port and printed 'Error logging to API' at the terminal."""
    if "prefect" not in sys.modules:
        return  # nothing was logged to it
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

    def exit_when_parent_goes() -> None:
        sys.stdin.buffer.read()  # returns at EOF
        os._exit(0)

    threading.Thread(target=exit_when_parent_goes, daemon=True).start()
    import uvicorn

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
