"""A real HTTP proxy on loopback between s3fs and the moto server that injects faults.

It forwards every request and, for a seeded fraction of them, answers 503 SlowDown, 500 InternalError
or drops the connection instead. It can also deny requests (403 AccessDenied) and hold matching
requests until released (to keep an upload in flight). Nothing in the product is mocked: s3fs talks
HTTP to this proxy exactly as it would to S3.
"""

from __future__ import annotations

import http.client
import random
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

_ERRORS = {
    503: b"<Error><Code>SlowDown</Code><Message>Please reduce your request rate.</Message></Error>",
    500: b"<Error><Code>InternalError</Code><Message>We encountered an internal error.</Message></Error>",
    403: b"<Error><Code>AccessDenied</Code><Message>Access Denied</Message></Error>",
}


class FaultProxy:
    def __init__(self, upstream_port: int, fault_rate: float = 0.0, seed: int = 0):
        self.upstream_port, self.fault_rate = upstream_port, fault_rate
        self.random = random.Random(seed)
        self.lock = threading.Lock()
        self.requests: list[tuple[str, str, int]] = []  # (method, path, status or -1 for a dropped connection)
        self.deny: re.Pattern | None = None
        self.hold: re.Pattern | None = None
        self.held = threading.Event()      # set when a request matching ``hold`` arrived
        self.release = threading.Event()   # set to let held requests through
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def __enter__(self) -> "FaultProxy":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.release.set()
        self.server.shutdown()
        self.server.server_close()

    def injected(self) -> int:
        with self.lock:
            return sum(1 for _, _, status in self.requests if status in (-1, 500, 503))

    def _decide(self, method: str, path: str) -> int | None:
        """None to forward; an HTTP status to answer with; -1 to drop the connection."""
        if self.deny and self.deny.search(f"{method} {path}"):
            return 403
        with self.lock:
            roll, kind = self.random.random(), self.random.choice((503, 500, -1))
        return kind if roll < self.fault_rate else None

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
                if decision == -1:
                    proxy._record(self.command, self.path, -1)
                    self.close_connection = True
                    self.connection.shutdown(2)
                    return
                if decision is not None:
                    proxy._record(self.command, self.path, decision)
                    return self._answer(decision, {"Content-Type": "application/xml"}, _ERRORS[decision])
                status, headers, data = proxy._forward(self.command, self.path, self.headers, body)
                proxy._record(self.command, self.path, status)
                self._answer(status, headers, data)

            def _answer(self, status: int, headers: dict, data: bytes):
                self.send_response(status)
                for k, v in headers.items():
                    if k.lower() not in ("content-length", "transfer-encoding", "connection"):
                        self.send_header(k, v)
                self.send_header("Content-Length", str(len(data)))
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
            conn.request(method, path, body=body or None,
                         headers={k: v for k, v in headers.items() if k.lower() != "connection"})
            resp = conn.getresponse()
            return resp.status, dict(resp.getheaders()), resp.read()
        finally:
            conn.close()
