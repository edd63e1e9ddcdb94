"""`make s3` (deployments/local_s3.py): a local S3 endpoint whose printed environment lines really work."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from checkpointing import CheckpointStore
from flows.server import free_port
from tests.conftest import ROOT


def _client_env(line: str) -> dict[str, str]:
    """The VAR=value words that a printed command line starts with, over an environment without AWS settings."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "TRAIN_"))}
    env.update(AWS_CONFIG_FILE=os.devnull, AWS_SHARED_CREDENTIALS_FILE=os.devnull)
    for word in line.split():
        if "=" not in word:
            break
        key, value = word.split("=", 1)
        env[key] = value
    return env


@pytest.mark.slow  # a python -m deployments.local_s3 server process
def test_make_s3_serves_bucket_runs_that_a_client_reaches_with_the_printed_environment():
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "deployments.local_s3"],
        cwd=ROOT,
        text=True,
        env={**os.environ, "LOCAL_S3_PORT": str(port)},
        stdout=subprocess.PIPE,
    )
    try:
        printed = [server.stdout.readline()]  # printed once the server is up and the bucket exists
        while "Ctrl-C" not in printed[-1] and printed[-1]:
            printed.append(server.stdout.readline())
        assert printed[0].startswith(f"local S3 at http://127.0.0.1:{port} with bucket 'runs'")
        train_line = next(line for line in printed if "-m flows.train" in line)
        assert train_line.split() == [
            f"AWS_ENDPOINT_URL=http://127.0.0.1:{port}",
            "AWS_ACCESS_KEY_ID=testing",
            "AWS_SECRET_ACCESS_KEY=testing",
            "TRAIN_SAVE_FOLDER=s3://runs",
            ".venv/bin/python",
            "-m",
            "flows.train",
        ]
        endpoint = {
            "client_kwargs": {"endpoint_url": f"http://127.0.0.1:{port}"},
            "key": "testing",
            "secret": "testing",
        }
        CheckpointStore("s3://runs", "exp1", storage_options=endpoint).save(
            "ep1-ba8-sa256", {"state.pt": {"w": torch.ones(2)}}, progress={"epoch": 1, "step": 8, "samples_seen": 256}
        )
        # s3fs honours AWS_ENDPOINT_URL: with the printed variables alone, the CLI finds that checkpoint.
        listed = subprocess.run(
            [sys.executable, "-m", "checkpointing", "ls", "s3://runs/exp1"],
            cwd=ROOT,
            text=True,
            env=_client_env(train_line),
            capture_output=True,
            timeout=120,
        )
        assert listed.returncode == 0, listed.stderr
        assert listed.stdout.splitlines()[1].split()[:4] == ["ep1-ba8-sa256", "1", "8", "256"]
    finally:
        server.send_signal(signal.SIGINT)  # what Ctrl-C sends
        assert server.wait(timeout=60) == 0


def test_help_names_local_s3_port_and_starts_nothing(tmp_path):
    port = free_port()
    started = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "deployments.local_s3", "--help"],
        cwd=ROOT,
        env={**os.environ, "LOCAL_S3_PORT": str(port)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    seconds = time.monotonic() - started

    assert proc.returncode == 0 and proc.stdout.startswith("usage: python -m deployments.local_s3"), proc.stderr
    assert "LOCAL_S3_PORT" in proc.stdout and "local S3 at" not in proc.stdout  # documented; no server started
    assert seconds < 5, f"--help took {seconds:.1f}s"  # ~0.2 s here; a server start takes seconds
    imported = subprocess.run(
        [sys.executable, "-c", "import sys, deployments.local_s3; print(sorted({'torch', 'moto'} & set(sys.modules)))"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert imported.stdout.strip() == "[]"  # what --help imports: nothing heavy
