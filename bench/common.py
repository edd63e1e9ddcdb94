"""Shared bench helpers: machine facts, alternating repetitions, medians, results file, a local S3."""

from __future__ import annotations

import contextlib
import datetime
import os
import platform
import socket
import statistics
import sys
import tempfile
from pathlib import Path

RESULTS = Path(__file__).with_name("RESULTS.md")


def machine() -> str:
    import prefect
    import torch

    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return (f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC; {os.cpu_count()} cores, "
            f"{mem:.0f} GiB; Python {platform.python_version()}, torch {torch.__version__}, "
            f"prefect {prefect.__version__}")


def record(title: str, command: str, lines: list[str]) -> None:
    """Prints the figures and appends them, with the command and machine facts, to bench/RESULTS.md."""
    block = [f"## {title}", "", f"`{command}` — {machine()}", "", *lines, ""]
    print("\n".join(block))
    with RESULTS.open("a") as f:
        f.write("\n".join(block) + "\n")


def median(xs: list[float]) -> float:
    return statistics.median(xs)


def command_line() -> str:
    return "python -m bench " + " ".join(sys.argv[1:])


def isolate_prefect() -> None:
    os.environ.setdefault("PREFECT_HOME", tempfile.mkdtemp(prefix="bench-prefect-"))
    os.environ["PREFECT_SERVER_ANALYTICS_ENABLED"] = "false"
    os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")


@contextlib.contextmanager
def local_s3():
    """A moto S3 server on a free loopback port; yields (bucket URL, storage_options)."""
    from moto.server import ThreadedMotoServer
    import s3fs

    for k, v in {"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench", "AWS_DEFAULT_REGION": "us-east-1"}.items():
        os.environ.setdefault(k, v)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    import logging

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    options = {"client_kwargs": {"endpoint_url": f"http://127.0.0.1:{port}"}}
    bucket = f"bench-{port}"  # moto's state is per process: a bucket name per server
    s3fs.S3FileSystem(**options).mkdir(bucket)
    try:
        yield f"s3://{bucket}", options
    finally:
        server.stop()
