"""The persisting agent (checkpointing/commit/agent.py), a real process: when the process that started it goes away
without closing its run, it commits the newest snapshot of this machine's tier to the store, as the writer it was,
and exits; never for a writer whose generation moved on; never when the run closed; and a run's agent never outlives
the run. The relaunch on another machine after a real SIGKILL is test_host_memory_kill.py's S3 case."""

from __future__ import annotations

import os
import signal
import time

import torch

from checkpointing import CheckpointStore
from checkpointing.commit import agent
from checkpointing.commit.agent import Agent
from checkpointing.commit.committer import INTERMEDIATE, CommitTerms, Retention
from checkpointing.commit.snapshots import SnapshotPipeline
from checkpointing.host_tier.gc import claim_of
from checkpointing.host_tier.tier import HostTier
from checkpointing.io.storage import RetrySettings
from checkpointing.manifest import Writer
from tests.procs import children, cmdline
from tests.unit.test_run_owns_its_threads import train_to_end


def orders_for(store: CheckpointStore, folder: str) -> dict:
    return agent.orders(folder, store.run_name, None, RetrySettings(), 0, Retention(), False)


def snapshots_never_uploaded(store: CheckpointStore, monkeypatch, steps: int) -> tuple[int, dict]:
    """A writer's snapshots of steps 1..``steps`` in this machine's tier and none in the store (the upload thread never
    runs: it rests, as between snapshots inside a unit); its generation and the newest state."""
    generation = store.claim_generation(label="trainer")
    monkeypatch.setattr(SnapshotPipeline, "_pump", lambda self: None)
    pipeline = SnapshotPipeline(store.uri, 0, HostTier(store.uri))
    state = {}
    for step in range(1, steps + 1):
        progress = {"epoch": 0, "step": step, "samples_seen": 32 * step, "sample_in_epoch": 32 * step}
        state = {"w": torch.full((1000,), float(step)), "step": step}
        objects = {"state.pt": {"state": state, "progress": progress}}
        terms = CommitTerms(store, progress, Writer.current(generation), {"metrics": {}, INTERMEDIATE: True})
        pipeline.take(objects, terms, f"ep0-ba{step}", must_upload=False, claim=claim_of(store, generation))
        pipeline._wait_published()
    pipeline.close()
    return generation, state


def test_when_its_trainer_goes_away_without_closing_it_commits_the_newest_snapshot_and_exits(tmp_path, monkeypatch):
    folder = str(tmp_path / "runs")
    store = CheckpointStore(folder, "r")
    generation, newest = snapshots_never_uploaded(store, monkeypatch, steps=3)
    assert store.latest() is None
    waiting = Agent.start(orders_for(store, folder))
    assert waiting is not None
    forked = os.fork()  # a DataLoader worker of the fork context, alive after the trainer: it holds no end of the pipe
    if forked == 0:
        time.sleep(120)
        os._exit(0)
    try:
        waiting.proc.stdin.close()  # what the kernel does when the trainer dies: the pipe ends, no "close"
        assert waiting.proc.wait(timeout=60) == 0
    finally:
        os.kill(forked, signal.SIGKILL)
        os.waitpid(forked, 0)
    info = store.latest(deep=True)
    assert info is not None and info.progress["step"] == 3
    assert info.manifest.writer.generation == generation
    assert "checkpoint agent" in info.manifest.writer.label
    committed = store.load(info, files=["state.pt"]).objects["state.pt"]["state"]
    assert torch.equal(committed["w"], newest["w"]) and committed["step"] == 3
    lease = store.fence.read_lease(generation)
    assert lease is not None and lease["released"]  # a relaunch elsewhere need not wait for it to go stale


def test_it_never_commits_for_a_writer_whose_generation_moved_on(tmp_path, monkeypatch):
    folder = str(tmp_path / "runs")
    store = CheckpointStore(folder, "r")
    generation, _ = snapshots_never_uploaded(store, monkeypatch, steps=2)
    assert store.claim_generation(label="a relaunch elsewhere") == generation + 1
    outcome = agent._persist(orders_for(store, folder))
    assert outcome.startswith(f"nothing to commit: writer generation {generation + 1} has claimed the run"), outcome
    assert store.latest() is None and store.list() == []


def test_a_relaunch_that_claims_while_it_reads_the_snapshot_is_left_to_commit_it(tmp_path, monkeypatch):
    """A relaunch on this machine claims the run at once (the trainer's pid has exited) and commits the snapshot itself
    (training/start/host_memory.py): an agent that began before the claim must not write the same checkpoint beside
    it. It checks the claims again once it has read the snapshot, and writes nothing."""
    from checkpointing.host_tier import tier as tiers

    folder = str(tmp_path / "runs")
    store = CheckpointStore(folder, "r")
    generation, _ = snapshots_never_uploaded(store, monkeypatch, steps=2)
    read = tiers.verified

    def read_then_a_relaunch_claims(*args, **kwargs):
        objects = read(*args, **kwargs)
        store.claim_generation(label="a relaunch here")
        return objects

    monkeypatch.setattr(tiers, "verified", read_then_a_relaunch_claims)
    outcome = agent._persist(orders_for(store, folder))
    assert outcome == "nothing to commit: a relaunch claimed the run while snapshot ep0-ba2 was read", outcome
    assert store.latest() is None and store.list() == []
    assert store.fence.newest() == generation + 1


def test_a_run_that_closes_ends_its_agent_which_commits_nothing(tmp_path, monkeypatch):
    folder = str(tmp_path / "runs")
    store = CheckpointStore(folder, "r")
    snapshots_never_uploaded(store, monkeypatch, steps=2)
    waiting = Agent.start(orders_for(store, folder))
    assert waiting is not None
    waiting.close()
    assert waiting.proc.returncode == 0
    assert store.latest() is None


def test_a_run_on_s3_starts_its_agent_and_no_agent_outlives_the_run(make_config, s3, monkeypatch):
    """Where a relaunch may run on another machine (an object store), rank 0's pipeline has an agent waiting while
    the run trains; the run's end (``Run.close``) ends it, and the run committed its checkpoints itself."""
    folder, options = s3
    config = make_config(save_folder=folder, storage_options=options, snapshot_interval="2ba", max_duration="2ep")
    started: list[Agent] = []
    real_start = Agent.start.__func__  # type: ignore[attr-defined]

    def start(cls, orders):
        started.append(real_start(cls, orders))
        return started[-1]

    monkeypatch.setattr(Agent, "start", classmethod(start))
    train_to_end(config, [])
    assert len(started) == 1 and started[0] is not None
    assert started[0].proc.returncode == 0  # waited for: closed, not killed
    assert not [pid for pid in children(os.getpid()) if b"checkpointing.commit.agent" in cmdline(pid)]
    store = CheckpointStore(folder, config.run_name, storage_options=options)
    assert "checkpoint agent" not in store.latest(deep=True).manifest.writer.label


def test_nothing_in_the_working_folder_runs_in_the_agent(tmp_path, monkeypatch):
    """The agent starts in the trainer's working folder, which may hold anything (a notebook's folder, a shared one):
    a ``json.py`` there is not what the waiting agent imports (``python -I``; the orders' sys.path comes after)."""
    planted = tmp_path / "planted"
    planted.mkdir()
    (planted / "json.py").write_text(f"open({str(tmp_path / 'ran')!r}, 'w').close()\nraise SystemExit(3)\n")
    monkeypatch.chdir(planted)
    waiting = Agent.start({"save_folder": str(tmp_path)})
    assert waiting is not None
    waiting.close()
    assert waiting.proc.returncode == 0
    assert not (tmp_path / "ran").exists()
