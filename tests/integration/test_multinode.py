"""One unit across machines, for real on one machine: hosts as network namespaces (tests/integration/hosts.py), a
Prefect server on their bridge, one worker of the process pool in each host (tests/integration/cluster.py), and
torchrun's rendezvous between the hosts. Node 0 is the unit task's process; the other nodes are runs of the
rank-node deployment that it starts, on whichever host's worker is free. Real servers, workers, torchrun and
SIGKILL; nothing may be left running on any host after each test.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterDeploymentId, LogFilter, LogFilterFlowRunId
from prefect.client.schemas.objects import StateType
from prefect.settings import PREFECT_API_URL, temporary_settings

from checkpointing import CheckpointStore
from checkpointing.store import STATE_FILE
from tests.conftest import RECORDING, ROOT
from tests.integration.cluster import SECRET, Cluster
from tests.integration.hosts import Hosts, alive, available
from tests.integration.stack_client import client, logs_of, start_run, wait_for, wait_for_state
from tests.integration.test_distributed import steps_by_rank
from training.config import TrainConfig
from training.distributed.gang import DistributedUnitError, run_on_gang
from training.distributed.node_run import FOLDER_PREFIX as NODE_FOLDER
from training.distributed.nodes import NodeOffer, Rendezvous, config_digest, make_offers, sign_offer

pytestmark = [pytest.mark.slow, pytest.mark.system]
NODE = "rank-node/default"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """Two hosts, the server on their bridge, a worker in each; all gone when the module ends."""
    reason = available()
    if reason:
        pytest.skip(f"no network namespaces on this machine: {reason}")
    hosts = Hosts(2)
    running = Cluster(hosts, tmp_path_factory.mktemp("prefect-home"), tmp_path_factory.mktemp("cluster-logs"),
                      allowed_root=tmp_path_factory.getbasetemp())  # fmt: skip
    try:
        hosts.up()
        running.up()
        with temporary_settings(updates={PREFECT_API_URL: running.api_url}):
            yield running
    finally:
        killed = running.down()
        assert not killed, f"still running on the hosts after their workers stopped: {killed}"


@pytest.fixture(autouse=True)
def nothing_left_on_any_host(cluster):
    yield
    left = cluster.wait_idle()
    assert not left, f"still running on the hosts after the test (beside their workers): {left}"


def config_for(folder: Path, run_name: str, record: Path, **overrides) -> dict:
    return {
        "run_name": run_name,
        "save_folder": str(folder),
        "recipe": RECORDING,
        "recipe_args": {"num_samples": 250, "record_dir": str(record)},
        "max_duration": "2ep",
        "save_interval": "1ep",
        "global_batch_size": 32,
        "seed": 7,
        "unit_retries": 0,
        "retry_delay_seconds": 0,
        **overrides,
    }


def train_on_pool(cluster: Cluster, config: dict, timeout: float = 240):
    """A run of train/default, to completion."""
    return wait_for_state(cluster, start_run(cluster, "train/default", {"config": config}), StateType.COMPLETED,
                          timeout=timeout)  # fmt: skip


def node_runs(cluster: Cluster) -> list:
    with client(cluster) as c:
        node = c.read_deployment_by_name(NODE)
        return c.read_flow_runs(flow_run_filter=FlowRunFilter(deployment_id=FlowRunFilterDeploymentId(any_=[node.id])))


def model_of(folder: Path, run_name: str) -> dict[str, torch.Tensor]:
    store = CheckpointStore(str(folder), run_name)
    return store.load(store.latest().name, files=[STATE_FILE]).objects[STATE_FILE]["state"]["model"]


def test_two_nodes_train_what_two_processes_on_one_machine_train(cluster, tmp_path, train_run):
    """`python -m flows.train --nnodes 2` as node 0 in the root namespace; its node run lands on a host. The two
    processes on one machine are only the reference (their ids and weights): trained without Prefect
    (tests.run_lifecycle's path, torchrun's two ranks as on the pool), not through a worker's flow-run process."""
    folder = tmp_path / "runs"
    one = config_for(folder, "one-machine", tmp_path / "one", nproc_per_node=2)
    train_run(TrainConfig(**one))
    before = {run.id for run in node_runs(cluster)}
    two = config_for(folder, "two-machines", tmp_path / "two", nnodes=2)
    flags = [arg for key, value in two.items() for arg in (f"--{key}", json.dumps(value) if isinstance(value, dict)
             else str(value))]  # fmt: skip
    env = cluster.env(TRAIN_NODE_ADDRESS=cluster.hosts.bridge_address, TRAIN_NODE_SECRET=SECRET)
    done = subprocess.run([sys.executable, "-m", "flows.train", *flags], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)  # fmt: skip
    (tmp_path / "cli.log").write_text(done.stdout + done.stderr)  # kept in the test's folder, for a person
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "run two-machines complete: epoch 2, step 16, 500 samples" in done.stdout

    nodes = [run for run in node_runs(cluster) if run.id not in before]
    assert [run.state.type for run in nodes] == [StateType.COMPLETED]  # one gang for both units: one node run
    assert (tmp_path / "two" / "ids-rank1.txt").exists()  # written on a host, by the node run's rank
    for rank in (0, 1):  # every rank trained the same samples at the same step as its twin on one machine
        assert (tmp_path / "two" / f"ids-rank{rank}.txt").read_text() == (
            tmp_path / "one" / f"ids-rank{rank}.txt"
        ).read_text()
    steps = steps_by_rank(tmp_path / "two", 2)
    assert len(steps) == 16 and set().union(*steps[:8]) == set(range(250))
    a, b = model_of(folder, "one-machine"), model_of(folder, "two-machines")
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=1e-5, atol=1e-6, msg=key)


def rank_hosts(cluster: Cluster, rank: int) -> list[int]:
    """The hosts where a rank process of global rank ``rank`` runs."""
    found = []
    for i in range(cluster.hosts.count):
        for pid in cluster.hosts.pids(i):
            try:
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
                environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            except OSError:
                continue
            if b"training.distributed.rank" in cmdline and b"torch.distributed.run" not in cmdline \
                    and f"RANK={rank}".encode() in environ:  # fmt: skip
                found.append(i)
    return found


def test_a_node_killed_mid_unit_ends_the_attempt_and_the_retry_resumes_exactly(cluster, tmp_path):
    folder, record = tmp_path / "runs", tmp_path / "ids"
    config = config_for(folder, "killed", record, nnodes=2, max_duration="3ep", global_batch_size=16, unit_retries=2,
                        recipe_args={"num_samples": 4000, "hidden": 256, "record_dir": str(record)})  # fmt: skip
    run_id = start_run(cluster, "train/default", {"config": config})
    pointer, ids = folder / "killed" / "latest", record / "ids-rank1.txt"
    per_epoch = 4000 // 16
    wait_for(pointer.exists, 180, "unit 0's checkpoint", interval=0.05)
    wait_for(lambda: len(ids.read_text().splitlines()) > per_epoch + 20, 120, "unit 1's first steps", interval=0.02)
    [host] = rank_hosts(cluster, 1)
    victims = [pid for pid in cluster.hosts.pids(host) if pid != cluster.workers[host].pid]
    for pid in victims:  # the node's flow-run process, its torchrun and its rank, all at once
        os.kill(pid, signal.SIGKILL)

    wait_for_state(cluster, run_id, StateType.COMPLETED, timeout=300)
    latest = CheckpointStore(str(folder), "killed").latest()
    assert latest.progress["samples_seen"] == 3 * 4000
    with client(cluster) as c:
        task_runs = c.read_task_runs(flow_run_filter=FlowRunFilter(id={"any_": [run_id]}))
    attempts = {t.name: t.run_count for t in task_runs if "-unit-" in t.name}
    assert attempts == {"killed-unit-0": 1, "killed-unit-1": 2, "killed-unit-2": 1}
    nodes = sorted((run for run in node_runs(cluster) if run.name.startswith("killed-")), key=lambda r: r.created)
    assert len(nodes) == 2  # the first attempt's gang (units 0 and 1), then the retry's (units 1 and 2)
    assert nodes[0].state.type in (StateType.CRASHED, StateType.CANCELLED)  # reported by its worker, or cancelled
    assert nodes[1].state.type == StateType.COMPLETED, (nodes[1].state.message, logs_of(cluster, nodes[1].id)[-3000:])
    for rank in (0, 1):  # the retry trained unit 1 from its checkpoint: exactly what the killed attempt had begun
        lines = (record / f"ids-rank{rank}.txt").read_text().splitlines()
        killed_part, retried = lines[per_epoch : -2 * per_epoch], lines[-2 * per_epoch : -per_epoch]
        assert len(killed_part) >= (20 if rank == 1 else 19)
        assert retried[: len(killed_part)] == killed_part
    for epoch in (0, 1, 2):
        steps = steps_by_rank_lines(record, epoch, per_epoch)
        assert sorted(i for step in steps for i in step) == list(range(4000))
    # the killed node process ran no cleanup; the retry's node removed its folder (its torchrun's config and logs)
    assert sorted(Path(os.environ["TMPDIR"]).glob(f"{NODE_FOLDER}*")) == []


def steps_by_rank_lines(record: Path, epoch: int, per_epoch: int) -> list[set[int]]:
    """Epoch ``epoch``'s steps as trained in the end (the last ``per_epoch`` lines of each epoch's block)."""
    ranks = [(record / f"ids-rank{r}.txt").read_text().splitlines() for r in (0, 1)]
    blocks = [[lines[:per_epoch], lines[-2 * per_epoch : -per_epoch], lines[-per_epoch:]][epoch] for lines in ranks]
    return [{int(i) for block in blocks for i in block[s].split()} for s in range(per_epoch)]


def test_two_nodes_then_one_then_two_see_every_sample_once_per_epoch(cluster, tmp_path, train_run):
    """The two-node segments run on the pool (node 0's flow run and a node run on the other host); the one-node
    segment is one process, with no node run or rendezvous, so it trains without Prefect (tests.run_lifecycle's
    path) in this machine, from and into the same save folder: a worker's flow-run process start was most of it."""
    n, folder, record = 225, tmp_path / "runs", tmp_path / "ids"  # 225 = 7 x 32 + 1: the epoch ends with 1 sample
    plan = [(2, 32, "5ba", "5ba"), (1, 16, "14ba", "2ba"), (2, 32, "2ep", "1ep")]  # as test_distributed's 2 -> 1 -> 2
    global_steps = []
    for segment, (nnodes, gbs, duration, interval) in enumerate(plan):
        config = config_for(folder, "elastic", record, nnodes=nnodes, global_batch_size=gbs, max_duration=duration,
                            save_interval=interval, recipe_args={"num_samples": n, "record_dir": str(record)})  # fmt: skip
        if nnodes == 1:
            train_run(TrainConfig(**config))
        else:
            train_on_pool(cluster, config)
        global_steps += steps_by_rank(record, nnodes)
        for f in record.glob("ids-rank*.txt"):
            f.rename(record / f"segment{segment}-{f.name}")
    seen = [i for step in global_steps for i in sorted(step)]
    assert len(seen) == 2 * n
    assert set(seen[:n]) == set(seen[n:]) == set(range(n))
    assert CheckpointStore(str(folder), "elastic").latest().manifest.metadata["world_size"] == 2


def test_forged_expired_or_unsigned_offers_are_refused_before_connecting_anywhere(cluster, tmp_path):
    listener = socket.create_server((cluster.hosts.bridge_address, 0))  # where the offers say node 0 is
    listener.setblocking(False)
    config = json.loads(
        TrainConfig(**config_for(tmp_path / "runs", "lured", tmp_path / "ids", nnodes=2)).model_dump_json()
    )
    rendezvous = Rendezvous(cluster.hosts.bridge_address, listener.getsockname()[1], "rt-lured")
    [genuine] = make_offers(TrainConfig(**config), rendezvous, 0, config, SECRET)
    [forged] = make_offers(TrainConfig(**config), rendezvous, 0, config, "x" * 64)  # the creator's own key
    unsigned = {k: v for k, v in genuine.items() if k != "signature"}
    expired = sign_offer(NodeOffer.model_validate({**unsigned, "expires": int(time.time()) - 1}), SECRET)
    attempts = {
        "its signature does not match": (forged, config),
        "it expired at": (expired, config),
        "it is not signed": (unsigned, config),
        "the config is not the one node 0 signed": (genuine, {**config, "save_folder": "/"}),
    }
    with client(cluster) as c:
        node = c.read_deployment_by_name(NODE)
        runs = {why: c.create_flow_run_from_deployment(node.id, parameters={"offer": offer, "config": cfg}).id
                for why, (offer, cfg) in attempts.items()}  # fmt: skip
    for why, run_id in runs.items():
        run = wait_for_state(cluster, run_id, StateType.FAILED, timeout=120)
        assert run.state.message.startswith("node offer refused: ") and why in run.state.message, run.state.message
    with client(cluster) as c:
        logs = "\n".join(
            log.message for log in c.read_logs(LogFilter(flow_run_id=LogFilterFlowRunId(any_=list(runs.values()))))
        )
    assert (
        "rank process(es), rendezvous" not in logs
    )  # training/distributed/node_run.py's line before it starts torchrun
    with pytest.raises(BlockingIOError):
        listener.accept()  # no node connected to the rendezvous the offers named
    listener.close()
    assert config_digest(config) == genuine["config_sha256"]


def test_a_node_run_that_ends_before_joining_fails_the_attempt_in_seconds(cluster, tmp_path, monkeypatch):
    """Node 0 reads its node runs' states while it waits: a node refused or gone before it joined fails the attempt
    at once (retried like any node failure), instead of after the 300 s rendezvous timeout."""
    monkeypatch.setenv("TRAIN_NODE_ADDRESS", cluster.hosts.bridge_address)
    monkeypatch.setenv("TRAIN_NODE_SECRET", SECRET)
    stopped: list[float] = []

    class EndedNode:
        def start(self, offers, config):
            self.started = time.monotonic()

        def problem(self):
            return (
                "node run early-node-1 ended Failed: node offer refused"
                if time.monotonic() > self.started + 3
                else None
            )

        def stop(self, grace=0.0):
            stopped.append(grace)

    config = TrainConfig(**config_for(tmp_path / "runs", "early", tmp_path / "ids", nnodes=2))
    started = time.monotonic()
    with pytest.raises(DistributedUnitError, match="ended Failed: node offer refused"):
        run_on_gang(config, {"op": "unit", "unit": 0, "start_checkpoint": None, "attempt": 1}, generation=1,
                    launch_nodes=EndedNode)  # fmt: skip
    assert time.monotonic() - started < 30
    assert stopped == [0.0]  # the other nodes are cancelled at once, not given time to end by themselves
    marker = f"TRAIN_NODE_ADDRESS={cluster.hosts.bridge_address}".encode()  # in the gang's torchrun and ranks
    assert not wait_gone(lambda: [p for p in processes_with(marker) if p != os.getpid()]), "left running"


def processes_with(environ_entry: bytes) -> list[int]:
    found = []
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            if environ_entry in (entry / "environ").read_bytes().split(b"\0") and alive(entry):
                found.append(int(entry.name))
        except OSError:
            continue
    return found


def wait_gone(find, timeout: float = 10) -> list[int]:
    deadline = time.monotonic() + timeout
    while (left := find()) and time.monotonic() < deadline:
        time.sleep(0.2)
    return left


def test_the_pool_secret_reached_no_parameter_log_or_artifact(cluster):
    """Runs above signed offers with it: the server's database (parameters, logs, artifacts, states) and the
    worker and server logs never hold it."""
    home, logs = cluster.stack.home, cluster.logs
    files = [*home.glob("prefect.db*"), *logs.glob("*.log")]
    assert any(f.name == "prefect.db" for f in files)
    for f in files:
        assert SECRET.encode() not in f.read_bytes(), f
