"""A real HTTP proxy on loopback between s3fs and the moto server that injects faults.

It forwards every request and, for a seeded fraction of them, answers 503 SlowDown or 500 InternalError,
drops the connection before forwarding, or forwards and then drops the connection (the write landed, the
client never hears so). It can also answer scripted errors to chosen requests (``script``), deny requests
(403 AccessDenied) and hold matching requests until released (to keep an upload in flight). Nothing in
the product is mocked: s3fs talks HTTP to this proxy exactly as it would to S3.
"""

from __future__ import annotations

import http.client
import random
import re
import threading
from collections import deque
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

DROP = -1  # close the connection without forwarding the request
DROP_AFTER = -2  # forward the request, then close the connection instead of answering
_ERRORS = {
    503: ("SlowDown", "Please reduce your request rate."),
    500: ("InternalError", "We encountered an internal error."),
    403: ("AccessDenied", "Access Denied"),
}


def error_xml(code: str, message: str) -> bytes:
    return f"<Error><Code>{code}</Code><Message>{message}</Message></Error>".encode()


class FaultProxy:
    def __init__(self, upstream_port: int, fault_rate: float = 0.0, seed: int = 0):
        self.upstream_port, self.fault_rate = upstream_port, fault_rate
        self.random = random.Random(seed)
        self.lock = threading.Lock()
        self.requests: list[tuple[str, str, int]] = []  # (method, path, status, or DROP / DROP_AFTER)
        self.num_random_faults = 0
        self.deny: re.Pattern | None = None
        self.hold: re.Pattern | None = None
        self.held = threading.Event()  # set when a request matching ``hold`` arrived
        self.release = threading.Event()  # set to let held requests through
        self._scripts: list[tuple[re.Pattern, deque]] = []
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def __enter__(self) -> FaultProxy:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.release.set()
        self.server.shutdown()
        self.server.server_close()

    def injected(self) -> int:
        """How many requests the random fault rate turned into a fault."""
        with self.lock:
            return self.num_random_faults

    def script(self, pattern: str, *answers: tuple[int, str, bytes] | int) -> None:
        """The next requests matching ``pattern`` ("METHOD path" regex) get these answers, in order:
        (status, content type, body) or DROP / DROP_AFTER. Later ones are forwarded."""
        with self.lock:
            self._scripts.append((re.compile(pattern), deque(answers)))

    def forget(self) -> None:
        """Clears the request log (to count only what a test does after its set-up)."""
        with self.lock:
            self.requests.clear()

    def seen(self, pattern: str) -> list[int]:
        """The statuses of the requests so far that match ``pattern`` ("METHOD path" regex)."""
        with self.lock:
            return [status for method, path, status in self.requests if re.search(pattern, f"{method} {path}")]

    def _decide(self, method: str, path: str):
        """None to forward; else (status, content type, body), DROP or DROP_AFTER."""
        line = f"{method} {path}"
        with self.lock:
            for pattern, answers in self._scripts:
                if answers and pattern.search(line):
                    return answers.popleft()
            if self.deny and self.deny.search(line):
                return (403, "application/xml", error_xml(*_ERRORS[403]))
            roll, kind = self.random.random(), self.random.choice((503, 500, DROP, DROP_AFTER))
            if roll >= self.fault_rate:
                return None
            self.num_random_faults += 1
        return kind if kind in (DROP, DROP_AFTER) else (kind, "application/xml", error_xml(*_ERRORS[kind]))

    def _handler(self):
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):  # quiet
                pass

            def _any(self):
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                if proxy.hold and proxy.hold.search(f"{self.command} {self.path}"):
                    proxy.held.set()
                    proxy.release.wait(timeout=120)
                decision = proxy._decide(self.command, self.path)
                if decision == DROP_AFTER:
                    proxy._forward(self.command, self.path, self.headers, body)
                if decision in (DROP, DROP_AFTER):
                    proxy._record(self.command, self.path, decision)
                    self.close_connection = True
                    self.connection.shutdown(2)
                    return
                if decision is not None:
                    status, content_type, data = decision
                    proxy._record(self.command, self.path, status)
                    return self._answer(status, {"Content-Type": content_type}, data)
                status, headers, data = proxy._forward(self.command, self.path, self.headers, body)
                proxy._record(self.command, self.path, status)
                self._answer(status, headers, data)

            def _answer(self, status: int, headers: dict, data: bytes):
                self.send_response(status)
                length = str(len(data))
                for k, v in headers.items():
                    if k.lower() == "content-length" and self.command == "HEAD":
                        length = v  # a HEAD answer has no body but tells the object's size
                    elif k.lower() not in ("content-length", "transfer-encoding", "connection"):
                        self.send_header(k, v)
                self.send_header("Content-Length", length)
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _any

        return Handler

    def _record(self, method: str, path: str, status: int) -> None:
        with self.lock:
            self.requests.append((method, path, status))

    def _forward(self, method: str, path: str, headers, body: bytes):
        conn = http.client.HTTPConnection("127.0.0.1", self.upstream_port, timeout=60)
        try:
            conn.request(
                method, path, body=body or None, headers={k: v for k, v in headers.items() if k.lower() != "connection"}
            )
            resp = conn.getresponse()
            return resp.status, dict(resp.getheaders()), resp.read()
        finally:
            conn.close()
