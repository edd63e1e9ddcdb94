"""An object-store endpoint that goes away for seconds at a time, and a disk that fills up: the run absorbs the first
for as long as ``store_retry_max_seconds`` allows (checkpointing/io/storage.py's retry policy, the commit engine's
whole-commit retry in checkpointing/commit/committer.py), and says the second in one line, in its own words, at the path
(checkpointing/io/storage.py ``_os_error``), keeping the checkpoint before it.

Real parts: moto's S3 server behind a plain TCP proxy on loopback that stops accepting and drops every connection
(what a restarted endpoint or a cut network looks like to a client), a real tmpfs, real subprocesses.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from checkpointing import CheckpointStore
from tests.conftest import ROOT

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

OUTAGE_SECONDS = 5.0
OUTAGES = 3


class OutageProxy:
    """Forwards TCP connections on a loopback port to moto's. ``down()`` stops accepting (a connect is refused) and
    drops every open connection; ``up()`` listens again on the same port. Counts the bytes sent upstream."""

    def __init__(self, upstream_port: int):
        self.upstream_port = upstream_port
        probe = socket.socket()
        probe.bind(("127.0.0.1", 0))
        self.port = probe.getsockname()[1]
        probe.close()
        self.lock = threading.Lock()
        self.connections: set[socket.socket] = set()
        self.sent = 0  # bytes forwarded to the store
        self._listener: socket.socket | None = None
        self._stop = threading.Event()
        self._accepting: threading.Thread | None = None

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def up(self) -> None:
        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", self.port))
        listener.listen(64)
        listener.settimeout(0.05)
        self._listener, self._stop = listener, threading.Event()
        self._accepting = threading.Thread(target=self._accept, args=(listener, self._stop), daemon=True)
        self._accepting.start()

    def down(self) -> None:
        self._stop.set()
        if self._accepting is not None:
            self._accepting.join()
        if self._listener is not None:
            self._listener.close()
        with self.lock:
            dropped, self.connections = list(self.connections), set()
        for conn in dropped:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
            conn.close()

    def _accept(self, listener: socket.socket, stop: threading.Event) -> None:
        while not stop.is_set():
            try:
                client, _ = listener.accept()
            except TimeoutError:
                continue
            client.settimeout(None)
            try:
                upstream = socket.create_connection(("127.0.0.1", self.upstream_port))
            except OSError:
                client.close()
                continue
            with self.lock:
                self.connections |= {client, upstream}
            threading.Thread(target=self._pump, args=(client, upstream, True), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, client, False), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, counted: bool) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
                if counted:
                    with self.lock:
                        self.sent += len(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)

    def sent_bytes(self) -> int:
        with self.lock:
            return self.sent


def _outages(proxy: OutageProxy, training: threading.Thread, every: int, log: list[tuple[float, bool]]) -> None:
    """Takes the endpoint down for OUTAGE_SECONDS each time ``every`` more bytes went to the store, OUTAGES times;
    records (when, was the run still training) for each."""
    for _ in range(OUTAGES):
        mark = proxy.sent_bytes()
        while proxy.sent_bytes() < mark + every and training.is_alive():
            time.sleep(0.01)
        log.append((time.monotonic(), training.is_alive()))
        proxy.down()
        time.sleep(OUTAGE_SECONDS)
        proxy.up()


def test_a_run_completes_exactly_through_three_five_second_endpoint_outages(s3, moto_server, make_config, train_run):
    """Before the fix (6 attempts, ~4.5 s of back-off at most) the first outage failed a store call and the run."""
    folder, options = s3
    recipe = {"num_samples": 256, "in_features": 64, "hidden": 256}

    def config(save_folder: str, endpoint: str):
        return make_config(
            save_folder=save_folder,
            storage_options={"client_kwargs": {"endpoint_url": endpoint}},
            recipe_args=recipe,
            max_duration="8ep",
            unit_retries=0,  # and train_run has no Prefect retry either: only the store's policy may help
        )

    reference = train_run(config(folder.replace("/runs", "/reference"), options["client_kwargs"]["endpoint_url"]))
    proxy = OutageProxy(moto_server)
    proxy.up()
    result: list = []
    failure: list[BaseException] = []
    outages: list[tuple[float, bool]] = []

    def train() -> None:
        try:
            result.append(train_run(config(folder, proxy.endpoint)))
        except BaseException as exc:  # the test reports it below
            failure.append(exc)

    training = threading.Thread(target=train, daemon=True)
    started = time.monotonic()
    training.start()
    try:
        _outages(proxy, training, every=50_000, log=outages)
        training.join(timeout=240)
    finally:
        proxy.down()
    assert not failure, f"{type(failure[0]).__name__}: {failure[0]}"
    ended = time.monotonic()
    assert [alive for _, alive in outages] == [True] * OUTAGES  # each outage hit the run while it trained
    assert ended - outages[-1][0] >= OUTAGE_SECONDS  # and the last one ended before the run did
    assert ended - started < 120
    (ours,) = result
    assert (ours.epoch, ours.samples_seen) == (reference.epoch, reference.samples_seen) == (8, 8 * 256)
    mine = CheckpointStore(folder, "r", storage_options=options)
    theirs = CheckpointStore(folder.replace("/runs", "/reference"), "r", storage_options=options)
    assert all(mine.check(i, deep=True) == [] for i in mine.list())
    a = mine.load_latest(["state.pt"]).objects["state.pt"]["state"]["model"]
    b = theirs.load_latest(["state.pt"]).objects["state.pt"]["state"]["model"]
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in b)


# ~8.6 MB of state (weights and SGD momentum): one checkpoint fits in what the filler leaves, the next does not.
DISK_RECIPE = {"num_samples": 128, "hidden": 1024, "num_layers": 3}


def _lifecycle(folder: Path, tier: Path, log: Path) -> subprocess.CompletedProcess:
    command = [
        sys.executable, "-m", "tests.run_lifecycle", "--run_name", "r", "--save_folder", str(folder),
        "--recipe", "recipes.synthetic:SyntheticRecipe", "--recipe_args", json.dumps(DISK_RECIPE),
        "--max_duration", "3ep", "--save_interval", "1ep", "--global_batch_size", "32", "--seed", "7",
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TRAIN_HOST_TIER_DIR": str(tier)}
    with open(log, "w") as out:
        return subprocess.run(command, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, timeout=240)


@contextlib.contextmanager
def _small_disk(where: Path, size: str = "30m"):
    where.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"a tmpfs cannot be mounted here: {mounted.stderr.decode().strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", str(where)], check=True)


def test_a_full_disk_mid_run_is_one_line_at_the_path_and_the_relaunch_after_freeing_space_is_exact(tmp_path):
    """Before the fix: ``RuntimeError: [enforce fail at inline_container.cc...] unexpected pos ...`` (torch.save's
    words for a failed write), naming neither the disk nor the path."""
    tier = tmp_path / "tier"
    reference = _lifecycle(tmp_path / "reference", tier, tmp_path / "reference.log")
    assert reference.returncode == 0, (tmp_path / "reference.log").read_text()[-3000:]
    ref = CheckpointStore(str(tmp_path / "reference"), "r")
    first = ref.list()[0]
    with _small_disk(tmp_path / "disk") as disk:
        free = os.statvfs(disk).f_bavail * os.statvfs(disk).f_frsize
        filler = disk / "filler"
        filler.write_bytes(b"\0" * int(free - 1.5 * first.size_bytes))  # room for ep1, not for ep2 beside it
        failed = _lifecycle(disk / "runs", tier, tmp_path / "full.log")
        text = (tmp_path / "full.log").read_text()
        assert failed.returncode != 0, text[-3000:]
        last = text.strip().splitlines()[-1]  # the exception's own line, below the traceback
        where = f"no space left on device at {disk}/runs/r/checkpoints/ep2-"
        assert where in last and "enforce fail" not in last, text[-3000:]
        store = CheckpointStore(str(disk / "runs"), "r")
        assert [i.name for i in store.list()] == [first.name] and store.check(store.latest(deep=True), deep=True) == []
        filler.unlink()
        relaunched = _lifecycle(disk / "runs", tier, tmp_path / "relaunched.log")
        assert relaunched.returncode == 0, (tmp_path / "relaunched.log").read_text()[-3000:]
        log = (tmp_path / "relaunched.log").read_text()
        result = json.loads(log.strip().splitlines()[-1])
        second = ref.list()[
            1
        ].name  # the unit whose write failed, in this machine's memory: committed first, as recorded
        assert result["started_from"] == f"checkpoint {second}", log[-3000:]
        assert f"checkpoint {second} was in this machine's memory only" in log
        assert store.info(second).metrics["samples"] == ref.info(second).metrics["samples"]  # not a unit of 0 steps
        ours = store.load_latest(["state.pt"]).objects["state.pt"]["state"]["model"]
        assert store.latest().name == ref.latest().name
    theirs = ref.load_latest(["state.pt"]).objects["state.pt"]["state"]["model"]
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in theirs)
