"""The trial task: one segment of a sweep's trial, an ordinary training run in a process of its own.

While a sweep runs, that process is one of its warm runners (tasks/trial_runner.py), reset between segments, which
reports the same exit code and stderr a fresh process would; outside a sweep (or with the internal switch
SWEEP_PROCESS_PER_SEGMENT=1) it is a fresh ``python -m flows.sweep_trial`` per segment.

A trial is a run of this product like any other (flows/train.py, its own flow run in Prefect, its retries, its
snapshots and preemption); it runs in a child process because a run owns process-wide things (the global RNGs, the
warm state kept between units, signal handlers) that two trials in one process would share. The child is
``python -m flows.sweep_trial <spec>``; it dies with the sweep's process (PR_SET_PDEATHSIG), so a SIGKILLed sweep
leaves no orphan training on, and a relaunch resumes the segment from its newest checkpoint.

A child that died (killed, out of memory) is started again by Prefect's task retry: the run autoresumes, so the
retry continues where the dead process last committed. A child that stopped on request (SIGTERM: preemption) is
not retried: the sweep itself is stopping. A child whose run failed (its own unit retries spent) or whose
configuration was refused is not retried either: the sweep records the trial as failed and goes on.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import uuid
from typing import Any

from prefect import task
from prefect.cache_policies import NO_CACHE
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import (
    FlowRunFilter,
    FlowRunFilterId,
    FlowRunFilterState,
    FlowRunFilterStateType,
    FlowRunFilterTags,
    TaskRunFilter,
    TaskRunFilterState,
    TaskRunFilterStateType,
)
from prefect.client.schemas.objects import StateType
from prefect.logging import get_run_logger
from prefect.states import Cancelled, Crashed, State
from pydantic import BaseModel

from checkpointing.commit.committer import INTERMEDIATE
from tasks.trial_runner import RUNNERS
from training.config import TrainConfig
from training.exceptions import TrialDied, TrialFailed, TrialStopped
from training.lifetimes import die_with_parent
from training.recipe.loader import ALLOWED_ENV
from training.run_states import PREEMPTED
from training.start.store import open_store

# How the child says what happened (flows/sweep_trial.py): the CLI's codes.
EXIT_OK, EXIT_FAILED, EXIT_CONFIG = 0, 1, 2
EXIT_STOPPED = (130, 143)
UNTRUSTED_ENV = "SWEEP_TRIAL_UNTRUSTED"  # set by the sweep: this trial's parameters came from a deployment run's API
TRIAL_TAG = "sweep-trial"  # the tag of a trial's flow run, "sweep-trial-<random>": finds it if its process dies
_TAIL = 2000  # characters of a failed child's stderr kept for its message
PROCESS_DIED = (
    "ProcessDied"  # the state of a dead trial process's flow run: not Crashed, which restart automations watch
)
_UNFINISHED = [StateType.PENDING, StateType.SCHEDULED, StateType.RUNNING]


class UnitCheckpoint(BaseModel):
    """One committed unit checkpoint of a trial's run, as its manifest vouches for it."""

    progress: dict[str, int]
    metrics: dict[str, float]
    checkpoint: str


class SegmentOutcome(BaseModel):
    """What one segment left: the run's unit checkpoints (every one, oldest first), and what the launch that
    finished it reported (how many units it trained, where it started)."""

    run_name: str
    checkpoints: list[UnitCheckpoint]
    units_trained: int
    started_from: str


class _Children:
    """The trial processes running now: the sweep forwards a stop request (SIGTERM) to them."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._running: set[subprocess.Popen[bytes]] = set()

    def add(self, child: subprocess.Popen[bytes]) -> None:
        with self._lock:
            self._running.add(child)

    def discard(self, child: subprocess.Popen[bytes]) -> None:
        with self._lock:
            self._running.discard(child)

    def signal(self, signum: int = signal.SIGTERM) -> int:
        with self._lock:
            children = list(self._running)
        for child in children:
            if child.poll() is None:
                child.send_signal(signum)
        return len(children)


CHILDREN = _Children()


def retry_if_died(task, task_run, state) -> bool:
    """Retry condition (a plain function: Prefect 3.8 ignores partials): only a process that died is started again."""
    exc = state.data if isinstance(state.data, BaseException) else state.result(raise_on_failure=False)
    return isinstance(exc, TrialDied)


@task(name="trial", task_run_name="{config.run_name}", cache_policy=NO_CACHE, retry_condition_fn=retry_if_died)
def run_trial(config: TrainConfig, recipe_path: str, untrusted: bool) -> SegmentOutcome | State:
    """Train ``config`` (one trial's run, up to its segment's max_duration) in a child process; its checkpoints."""
    logger = get_run_logger()
    # Under the sweep's own trial folder (tasks/trial_runner.py), which the next sweep removes if this one is killed.
    with tempfile.TemporaryDirectory(prefix="trial-", dir=RUNNERS.folder, ignore_cleanup_errors=True) as folder:
        spec, result = os.path.join(folder, "spec.json"), os.path.join(folder, "result.json")
        fields = config.model_dump(mode="json", exclude={"storage_options", "config_file"})
        tag = f"{TRIAL_TAG}-{uuid.uuid4().hex[:12]}"  # finds the child's flow run if the child dies
        payload = {"config": fields, "result_file": result, "tag": tag}
        env = _child_env(config, recipe_path, untrusted)
        if RUNNERS.is_open:  # a warm runner of this sweep (tasks/trial_runner.py): no process start, no imports
            code, stderr = RUNNERS.run(payload, env, config.run_name, track=CHILDREN)
        else:
            with open(os.open(spec, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as f:
                json.dump(payload, f)
            code, stderr = _run_child(spec, env)
        if code == EXIT_OK:
            with open(result) as f:
                reported = json.load(f)
            logger.info("trial run %s reached %s", config.run_name, config.max_duration)
            return SegmentOutcome(
                run_name=config.run_name,
                checkpoints=unit_checkpoints(config),
                units_trained=int(reported["units_trained"]),
                started_from=str(reported["started_from"]),
            )
    tail = stderr.strip()[-_TAIL:]
    if code in EXIT_STOPPED:  # Cancelled, named Preempted (as a unit's task run): raised again by the future
        stopped = f"trial run {config.run_name} stopped on request (exit {code}); the sweep's relaunch resumes it"
        return Cancelled(name=PREEMPTED, message=stopped, data=TrialStopped(stopped))
    if code in (EXIT_FAILED, EXIT_CONFIG):
        raise TrialFailed(f"trial run {config.run_name} did not complete (exit {code}): {_last_error(tail)}")
    end_dead_flow_runs(tag, f"the process of trial run {config.run_name} died (exit {code}); the retry resumes the run")
    raise TrialDied(f"trial run {config.run_name}'s process died (exit {code}); a retry resumes it: {tail[-300:]}")


def end_dead_flow_runs(tag: str, message: str) -> None:
    """A killed process leaves its flow run (and the unit's task run) Running in the UI for ever: nothing else
    ends them. They are set Crashed, named ProcessDied (the retry's new flow run takes the run over). A report
    only: an API failure is a warning."""
    unfinished_runs = FlowRunFilterState(type=FlowRunFilterStateType(any_=_UNFINISHED))
    unfinished_tasks = TaskRunFilter(state=TaskRunFilterState(type=TaskRunFilterStateType(any_=_UNFINISHED)))
    try:
        with get_client(sync_client=True) as client:
            runs = client.read_flow_runs(
                flow_run_filter=FlowRunFilter(tags=FlowRunFilterTags(all_=[tag]), state=unfinished_runs)
            )
            for run in runs:
                only_this = FlowRunFilter(id=FlowRunFilterId(any_=[run.id]))
                for task_run in client.read_task_runs(flow_run_filter=only_this, task_run_filter=unfinished_tasks):
                    client.set_task_run_state(task_run.id, Crashed(name=PROCESS_DIED, message=message), force=True)
                client.set_flow_run_state(run.id, Crashed(name=PROCESS_DIED, message=message), force=True)
    except Exception as exc:
        get_run_logger().warning("could not end the dead trial process's flow run in Prefect: %s", exc)


def _run_child(spec: str, env: dict[str, str]) -> tuple[int, str]:
    """Runs the trial's process to its end: its stdout goes to ours, its stderr too and is kept for a message."""
    child = subprocess.Popen(
        [sys.executable, "-m", "flows.sweep_trial", spec],
        env=env,
        stderr=subprocess.PIPE,
        preexec_fn=die_with_parent,
    )
    CHILDREN.add(child)
    kept: list[str] = []
    try:
        assert child.stderr is not None
        for raw in child.stderr:
            line = raw.decode(errors="replace")
            sys.stderr.write(line)
            kept.append(line)
            del kept[:-50]
        return child.wait(), "".join(kept)
    finally:
        CHILDREN.discard(child)


def _child_env(config: TrainConfig, recipe_path: str, untrusted: bool) -> dict[str, str]:
    """The sweep's environment (the Prefect API it uses, the worker's roots and allow-list), plus the recipe this
    sweep was allowed to run and, never on disk, the storage options (credentials may be among them)."""
    from prefect.settings import PREFECT_API_URL

    env = dict(os.environ)
    env[ALLOWED_ENV] = ",".join(filter(None, [env.get(ALLOWED_ENV, ""), recipe_path]))
    api = PREFECT_API_URL.value()
    if api:
        env["PREFECT_API_URL"] = api
    if config.storage_options:
        env["TRAIN_STORAGE_OPTIONS"] = json.dumps(config.storage_options)
    if untrusted:
        env[UNTRUSTED_ENV] = "1"
    else:
        env.pop(UNTRUSTED_ENV, None)
    return env


def unit_checkpoints(config: TrainConfig) -> list[UnitCheckpoint]:
    """Every committed unit checkpoint of the run (snapshots taken inside a unit left out), oldest first."""
    found = []
    for info in open_store(config).list():
        if info.manifest.metadata.get(INTERMEDIATE):
            continue
        found.append(UnitCheckpoint(progress=dict(info.progress), metrics=dict(info.metrics), checkpoint=info.uri))
    return sorted(found, key=lambda c: c.progress.get("samples_seen", 0))


def _last_error(stderr: str) -> str:
    """The child's ``error:`` line (the CLI's one clear message), else the end of what it printed."""
    lines = [line for line in stderr.splitlines() if line.startswith("error: ")]
    return lines[-1][len("error: ") :] if lines else stderr[-300:]


def trial_error(exc: BaseException) -> dict[str, Any]:
    """What the ledger keeps of a failed segment: the kind and our own message (bounded)."""
    return {"error": f"{type(exc).__name__}: {str(exc)[:500]}"}
