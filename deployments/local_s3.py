"""A local S3 endpoint (moto's server) on 127.0.0.1: ``make s3`` for trying the product against s3:// by
hand, and the one way the tests (tests/conftest.py) and the benchmarks (bench/common.py) start theirs.

    make s3                                       # then, in another terminal, the lines it prints
    LOCAL_S3_PORT=5556 python -m deployments.local_s3   # another port than 5555 (or --port 5556)

It runs in the foreground with a bucket ``runs``; Ctrl-C stops it, and everything in it (it is in memory)
goes with it. s3fs (through botocore) honours AWS_ENDPOINT_URL, so the printed environment is all a
client needs; TRAIN_STORAGE_OPTIONS='{"client_kwargs": {"endpoint_url": ...}}' does the same per run.

Environment: LOCAL_S3_PORT, the port on 127.0.0.1 (default 5555). moto and s3fs (the test extra) are imported
only when a server starts or a bucket is made, so ``--help`` answers at once and starts nothing.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import socket
import sys
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

PORT = int(os.environ.get("LOCAL_S3_PORT", "5555"))
BUCKET = "runs"
# Settings of the user's that would redirect a client of the local endpoint, or lend it real credentials.
AWS_UNSET = ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3")


def fake_aws_env(key: str = "testing", secret: str = "testing") -> dict[str, str]:
    """Credentials for moto (it takes any) and no AWS config or credentials files of the user's."""
    return {
        "AWS_ACCESS_KEY_ID": key,
        "AWS_SECRET_ACCESS_KEY": secret,
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_CONFIG_FILE": os.devnull,
        "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
    }


@dataclass(frozen=True)
class LocalS3:
    """A moto S3 server listening on 127.0.0.1:``port``, and what a client needs to reach it."""

    port: int

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def storage_options(self) -> dict[str, Any]:
        return {"client_kwargs": {"endpoint_url": self.endpoint}}

    def reset(self) -> None:
        """Empties the server: every bucket and object goes (and the memory they held)."""
        request = urllib.request.Request(f"{self.endpoint}/moto-api/reset", method="POST")
        urllib.request.urlopen(request, timeout=60).read()

    def make_bucket(self, name: str) -> str:
        """Creates bucket ``name``; its URL."""
        import s3fs

        s3fs.S3FileSystem(**self.storage_options, skip_instance_cache=True).mkdir(name)
        return f"s3://{name}"

    def fresh_bucket(self, name: str) -> str:
        """An emptied server with only bucket ``name``, and no s3fs instance cached from before the reset."""
        import s3fs

        self.reset()
        s3fs.S3FileSystem.clear_instance_cache()
        return self.make_bucket(name)


@contextlib.contextmanager
def serving(port: int | None = None) -> Iterator[LocalS3]:
    """moto's ThreadedMotoServer on 127.0.0.1:``port`` (a free one by default) in this process's threads."""
    from moto.server import ThreadedMotoServer

    from flows.server import free_port  # imports torch: only when a server starts

    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # no log line per request
    port = port or free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    try:
        yield LocalS3(port)
    finally:
        server.stop()


def port_is_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def usage(endpoint: str) -> str:
    """The lines a person pastes into another terminal to train against this endpoint."""
    env = f"AWS_ENDPOINT_URL={endpoint} AWS_ACCESS_KEY_ID=testing AWS_SECRET_ACCESS_KEY=testing"
    return (
        f"local S3 at {endpoint} with bucket '{BUCKET}'. In another terminal:\n\n"
        f"  {env} TRAIN_SAVE_FOLDER=s3://{BUCKET} .venv/bin/python -m flows.train\n"
        f"  {env} .venv/bin/python -m checkpointing ls s3://{BUCKET}/<run_name>\n\n"
        f"or, without AWS_ENDPOINT_URL:\n\n"
        f'  TRAIN_STORAGE_OPTIONS=\'{{"client_kwargs": {{"endpoint_url": "{endpoint}"}}}}\' '
        f"AWS_ACCESS_KEY_ID=testing AWS_SECRET_ACCESS_KEY=testing TRAIN_SAVE_FOLDER=s3://{BUCKET} "
        f".venv/bin/python -m flows.train\n\nCtrl-C stops it."
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m deployments.local_s3",
        description=__doc__.split("\n\n")[0],
        epilog=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--port", type=int, default=PORT, help="port on 127.0.0.1 (default: $LOCAL_S3_PORT, else 5555)")
    port = parser.parse_args(argv).port
    if not port_is_free(port):
        print(f"error: 127.0.0.1:{port} is in use (another `make s3`?); stop it or set LOCAL_S3_PORT", file=sys.stderr)
        return 1
    os.environ.update(fake_aws_env())
    with serving(port) as s3:
        s3.make_bucket(BUCKET)
        print(usage(s3.endpoint), flush=True)
        signal.sigwait({signal.SIGINT, signal.SIGTERM})  # Ctrl-C, or a kill, ends the foreground process
    return 0


if __name__ == "__main__":
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})  # delivered to sigwait, not a thread
    sys.exit(main())
