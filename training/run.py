"""One run's lifecycle, without Prefect: open → checks → claim → roll back → resolve the start → units or a loop
of its own → finish. The ``train`` flow (and a test, or a script with no scheduler) drives it:

    with Run.open(config) as run:
        while not run.complete:
            run.record(run_unit(config, start_checkpoint=run.head, generation=run.generation))
        result = run.finish(run.final_metrics() or evaluate_checkpoint(config, run.head))

Both loops go through it (a recipe's own ``train_loop`` is one unit that reports many checkpoints), and so does
every way of running a run again: the newest good checkpoint decides where it starts. Opening claims the run for
this attempt (a writer generation, and a lease: checkpointing/fencing.py), taking it over from a previous attempt
that is still alive; closing releases the lease.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import socket
from collections.abc import Callable
from typing import Any, NamedTuple

from pydantic import BaseModel

from checkpointing import CheckpointInfo, CheckpointStore
from checkpointing.export import export_checkpoint
from checkpointing.fencing import LEASE_STALE, Lease
from checkpointing.io.redact import redact_text, redact_uri
from checkpointing.manifest import Writer
from checkpointing.uris import split_run_uri
from training.config import TrainConfig
from training.config.limits import check_limits
from training.config.trust import confine_locations, release_locations
from training.distributed.nodes import NodeLauncher
from training.metrics.log import close_run
from training.position.progress import Progress, at, check_progress, is_complete, is_past, rescaled, unit_index
from training.preemption import STOP, raise_if_requested
from training.recipe.loader import uses_own_loop
from training.start.host_memory import commit_unsent, newest_snapshot, unsent_checkpoint
from training.start.identity import check_same_run, requested_data_skip, same_data_skip
from training.start.overwrite import start_over, starts_over
from training.start.phases import Phases
from training.start.preflight import preflight
from training.start.rollback import pending_roll_back, roll_back
from training.start.store import open_store
from training.start.warm_start import check_load_path
from training.unit.checkpointer import discard_host_snapshots
from training.unit.loop import UnitResult, run_unit
from training.unit.warm import PROCESS

logger = logging.getLogger(__name__)

MAX_REPEATS = 2  # units that end where an earlier one ended, before the run stops instead of retraining


class ScoredCheckpoint(NamedTuple):
    """One kept checkpoint and the metrics it was scored by: Ray's ``(Checkpoint, metrics)`` pair, unpacked the same
    way (``for checkpoint, metrics in result.best_checkpoints_with_metrics``); ``checkpoint`` is its URI."""

    checkpoint: str
    metrics: dict[str, float]


class TrainResult(BaseModel):
    """What a run reports: where it stands and where its last checkpoint is (never the model)."""

    run_name: str
    checkpoint: str
    checkpoint_name: str = ""
    epoch: int
    step: int
    samples_seen: int
    sample_in_epoch: int
    metrics: dict[str, float]  # the final evaluation's, named eval_<metric> (a loop of its own: its last report's)
    units: list[UnitResult]
    started_from: str
    store: str = ""
    warnings: list[str] = []
    best_checkpoints: list[str] = []  # URIs, best first by checkpoint_score_attribute (empty without it)
    best_checkpoint_names: list[str] = []  # the same checkpoints' names
    best_checkpoint_metrics: list[dict[str, float]] = []  # the same checkpoints' metrics
    best_checkpoints_with_metrics: list[ScoredCheckpoint] = []  # Ray's Result.best_checkpoints: (checkpoint, metrics)


class Run:
    """One attempt at a run: where it stands, whose it is, and what it trained so far."""

    def __init__(
        self,
        config: TrainConfig,
        store: CheckpointStore,
        start: CheckpointInfo | None,
        generation: int,
        lease: Lease | None,
        warnings: list[str],
    ):
        self.config, self.store, self.start, self.generation = config, store, start, generation
        self.lease, self.warnings = lease, warnings
        self.confined = False  # its local files are confined to the worker's roots until it closes (Run.open)
        self.own_loop = uses_own_loop(config)
        progress = Progress.from_dict(start.progress) if start else Progress()
        # A unit run's counters continue at this launch's batch size; a loop of its own keeps its own counters.
        self.progress = rescaled(progress, config.global_batch_size) if start and not self.own_loop else progress
        self.units: list[UnitResult] = []
        self._guard = RepeatGuard(self.progress)
        self.startup = Phases()  # where its opening went, phase by phase (Run.open)

    # -- opening ------------------------------------------------------------------------------------
    @classmethod
    def open(
        cls,
        config: TrainConfig,
        *,
        attempt: int = 1,
        owner: str = "",
        label: str = "",
        untrusted: bool = False,
        phases: Phases | None = None,
    ) -> Run:
        """Every check that can fail runs before anything is written; then the run is claimed for this attempt
        (a live previous attempt is asked to hand over first), rolled back if ``resume_from`` asks, and its start
        resolved. ``owner`` (e.g. a flow run id) and ``label`` say who trains in the run's claims; ``untrusted``: the
        config came from a flow-run parameter (its locations are checked, and every local file of the run is reached
        from the worker's allowed roots without following a link until the run is closed: training/config/trust.py).
        ``phases`` (training/start/phases.py), a clock the caller started, times each phase for the run's first line."""
        phases = phases or Phases()
        if not untrusted:
            phases.mark("trust")
            return cls._open(config, attempt, owner, label, phases)
        check_limits(config)  # what one run may start on this worker: training/config/limits.py
        confine_locations(config)
        phases.mark("trust")
        try:
            run = cls._open(config, attempt, owner, label, phases)
        except BaseException:
            release_locations()
            raise
        run.confined = True
        return run

    @classmethod
    def _open(cls, config: TrainConfig, attempt: int, owner: str, label: str, phases: Phases) -> Run:
        epoch_size = preflight(config)  # recipe allowed, arguments sane, model builds: before anything is written
        phases.mark("preflight")
        store = open_store(config)
        start = store.latest()
        unsent = unsent_checkpoint(config, store, lambda: start)  # in this machine's memory only: committed below
        phases.mark("store")
        newest = unsent.info if unsent is not None else start
        ours = newest  # the run's newest checkpoint, wherever it is: a snapshot only this machine's memory holds counts
        if ours is None and not config.autoresume:  # too, and must not be resumed from silently
            in_memory = newest_snapshot(config, store)
            ours = in_memory.info if in_memory else None
        # autoresume=False on a run with checkpoints: refused, or (save_overwrite=True) started over once it is claimed
        over = starts_over(config, store, ours, attempt, in_memory=ours is not start)
        if newest is not None and not over:
            check_same_run(config, newest, store if unsent is None else None)  # (a fit is checked when it loads)
        elif config.load_path and not uses_own_loop(config):
            check_load_path(config)  # a folder, or a safe weights file that fits the model; else ConfigError
        rollback_to = pending_roll_back(config, store)  # a bad resume_from fails here, before anything is written
        if newest is not None and not over and not rollback_to:
            check_resumable(config, newest, epoch_size)
        raise_if_requested(start.name if start else None)  # stopped during start-up: nothing claimed, nothing lost
        phases.mark("checks")
        label = label or f"process {os.getpid()} on {socket.gethostname()} (attempt {attempt})"
        handover = config.preemption_grace_seconds + 2 * LEASE_STALE
        generation = store.claim_generation(label=label, owner=owner, handover_seconds=handover)
        lease = Lease(store.fence, generation, on_stop=_handover_requested).start()
        phases.mark("claim")
        try:
            if over or rollback_to:  # what this machine's memory holds of the run must not be resumed from
                discard_host_snapshots(store, PROCESS.committer)
            if over:
                start_over(store, generation)
            if rollback_to:
                roll_back(store, rollback_to, generation)
            elif unsent is not None and not over:  # its upload died with its process: committed before the run
                commit_unsent(config, unsent, store, Writer.current(generation, label))  # decides where it stands
            start = resolve_start(config, store)
            run = cls(config, store, start, generation, lease, [])
        except BaseException:
            lease.release()
            raise
        run.warnings = [w for w in (load_path_warning(run), overshoot_warning(run)) if w]
        phases.mark("start")
        run.startup = phases
        for warning in run.warnings:
            logger.warning(warning)
        logger.info(
            "run %s in %s%s: %s; %s; %s",
            config.run_name,
            redact_uri(store.uri),
            " (train_loop)" if run.own_loop else "",
            run.started_from,
            "nothing left" if run.complete else f"training to {config.max_duration}",
            phases.line(),
        )
        return run

    def __enter__(self) -> Run:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Ends what this attempt started, on every path (completed, failed, preempted): its rank processes, its
        kept session and the loader workers it holds, its snapshot engine (the uploads still owed land first, under
        the lease, then its threads end and its buffers go back to the machine; the host-memory tier's files stay for a
        relaunch here), and releases the run for the next attempt (at once, rather than when the lease goes stale)."""
        from training.distributed.gang import close_gangs

        try:
            close_gangs()  # the rank processes of this attempt, if any
            PROCESS.committer.drop_snapshots()  # after a completed run's finish(): nothing left to do
            # Its loader workers end now, each the ordinary way (its exit handlers run), not killed at this process's
            # exit: one killed there left the folder multiprocessing made for it (/tmp/pymp-*) at every launch. After
            # the uploads still owed (a preemption's grace is theirs), and without a full collection: no retry in this
            # process needs the memory at once, and the workers end as their loader's last reference goes.
            PROCESS.forget(collect=False)
            close_run(self.store)  # its TensorBoard writer (file and thread); MLflow's run stays open for the next
            if self.lease is not None:
                self.lease.release()
        finally:
            if self.confined:
                self.confined = False
                release_locations()

    # -- where it stands ------------------------------------------------------------------------------
    @property
    def started_from(self) -> str:
        return f"checkpoint {self.start.name}" if self.start else "no checkpoint"

    @property
    def complete(self) -> bool:
        if self.own_loop and self.units:
            return self.units[-1].complete
        return is_complete(self.progress, self.config.duration)

    @property
    def next_unit(self) -> int:
        return 0 if self.own_loop else unit_index(self.progress, self.config.interval)

    @property
    def head(self) -> str | None:
        """The checkpoint the run stands at: the last unit's, or the one it started from."""
        return self.units[-1].checkpoint_name if self.units else (self.start.name if self.start else None)

    def record(self, result: UnitResult) -> None:
        """Takes a unit's result (or a loop's final one) into the run; stops a run whose commits are lost."""
        if not self.own_loop:
            self._guard.check(result)
        self.units.append(result)
        self.progress = Progress.from_dict(result.progress)

    # -- the end --------------------------------------------------------------------------------------
    def final_metrics(self) -> dict[str, float] | None:
        """The metrics the run ends with when no evaluation is needed: the last unit's own evaluation when it ran
        at the final step, or a loop of its own's last report; None when the final checkpoint needs evaluating."""
        if self.own_loop:
            info = self.store.info(self.head) if self.head else None
            return info.metrics if info else {}  # as reported, from the manifest: a rerun returns the same
        if not self.units:
            return None
        last = self.units[-1].metrics
        if last.get("eval_step") != float(self.progress.step):
            return None
        return {k: v for k, v in last.items() if k.startswith("eval_") and k != "eval_step"}

    def finish(self, metrics: dict[str, float]) -> TrainResult:
        """The end of a complete run: the log line, the export, the best checkpoints and the result."""
        config, store, p = self.config, self.store, self.progress
        if self.units:
            name, uri = self.units[-1].checkpoint_name, self.units[-1].checkpoint
        else:
            assert self.start is not None, "a complete run without units started from a checkpoint"
            name, uri = self.start.name, self.start.uri
        logger.info(
            "run %s complete: epoch %d, step %d, %d samples; %d unit(s) trained now; checkpoint %s; %s",
            config.run_name,
            p.epoch,
            p.step,
            p.samples_seen,
            len(self.units),
            redact_uri(uri),
            ", ".join(f"{k} {v:.4f}" for k, v in metrics.items()) or "no metrics",
        )
        close_run(store)  # after the final evaluation's curves: the run's writer threads end with it
        if config.export_on_complete:
            exported = export_checkpoint(uri, config.export_on_complete, storage_options=config.storage_options)
            logger.info(redact_text(exported))
        best = (
            store.best(config.checkpoint_score_attribute, config.checkpoint_score_order)
            if config.checkpoint_score_attribute
            else []
        )
        return TrainResult(
            run_name=config.run_name,
            checkpoint=uri,
            checkpoint_name=name,
            epoch=p.epoch,
            step=p.step,
            samples_seen=p.samples_seen,
            sample_in_epoch=p.sample_in_epoch,
            metrics=metrics,
            units=self.units,
            started_from=self.started_from,
            store=store.uri,
            warnings=self.warnings,
            best_checkpoints=[i.uri for i in best],
            best_checkpoint_names=[i.name for i in best],
            best_checkpoint_metrics=[i.metrics for i in best],
            best_checkpoints_with_metrics=[ScoredCheckpoint(i.uri, i.metrics) for i in best],
        )


def _handover_requested(request: dict[str, Any]) -> None:
    who = request.get("by") or "another attempt"
    STOP.request("handover", f"run taken over by {who}", request)


def resolve_start(config: TrainConfig, store: CheckpointStore) -> CheckpointInfo | None:
    """The checkpoint the run stands at. When it says the run is complete, it is what the run returns, and
    no unit will load (and hash) it: verify every byte now, and fall back to retrain what is lost."""
    start = store.latest()
    if start is None or not is_complete(Progress.from_dict(start.progress), config.duration):
        return start
    verified = store.latest(deep=True)
    if verified is None or verified.name != start.name:
        logger.warning(
            "the final checkpoint %s failed verification; resuming from %s and retraining from there",
            start.name,
            verified.name if verified else "the start",
        )
    return verified


def check_resumable(config: TrainConfig, start: CheckpointInfo, epoch_size: int) -> None:
    """The progress a run resumes from places it in its data (training/position/progress.py): else one ConfigError, before
    the run is claimed. A loop of its own keeps its own counters (the product never positions its data)."""
    if uses_own_loop(config):
        return
    listing = f"python -m checkpointing ls {'/'.join(split_run_uri(start.uri)[:2])}"
    fix = f"go back to an earlier checkpoint with resume_from=<name> ({listing})"
    progress, applied = Progress.from_dict(start.progress), start.manifest.metadata.get("data_skip_applied")
    requested = requested_data_skip(config)
    if requested is not None and not same_data_skip(requested, applied):  # the option places it first (reposition)
        progress, applied = dataclasses.replace(progress, sample_in_epoch=0), True
    what = f"run {config.run_name!r}: its newest checkpoint {start.name}"
    check_progress(progress, epoch_size, what, fix, skipped=bool(applied))


class RepeatGuard:
    """Stops a run whose units keep ending where an earlier unit already ended (its commits are being
    lost, e.g. a checkpoint that never verifies): it would otherwise retrain the same data forever."""

    def __init__(self, start: Progress):
        self.furthest, self.repeats = start.samples_seen, 0

    def check(self, result: UnitResult) -> None:
        if result.steps == 0 and not result.complete:
            raise RuntimeError(f"unit {result.unit} trained no step; stopping rather than looping")
        ended = result.progress.get("samples_seen", 0)
        if ended > self.furthest:
            self.furthest = ended
            return
        self.repeats += 1
        if self.repeats > MAX_REPEATS:
            raise RuntimeError(
                f"unit {result.unit} ended at {ended} samples, where earlier units of this run already got "
                f"({self.repeats} times): its checkpoints are not being kept (last: {result.checkpoint}). Stopping "
                f"instead of retraining the same data; check the store: python -m checkpointing verify "
                f"{'/'.join(split_run_uri(result.checkpoint)[:2])}"
            )


def load_path_warning(run: Run) -> str:
    """load_path only starts a run: once the run has checkpoints it resumes from them, and is told so."""
    config, start = run.config, run.start
    if start is None or not config.load_path:
        return ""
    return (
        f"load_path={config.load_path!r} is ignored: run {config.run_name!r} already has checkpoints and resumes "
        f"from its checkpoint {start.name}. To start from load_path, choose a new run_name; to go back to an "
        f"earlier checkpoint of this run, set resume_from=<checkpoint name> (python -m checkpointing ls {run.store.uri})"
    )


def overshoot_warning(run: Run) -> str:
    """A launch asking for less than the run already trained gets the run's newest checkpoint, and is told so."""
    config, start, p = run.config, run.start, run.progress
    if start is None or not is_past(p, config.duration):
        return ""
    match = next((i for i in reversed(run.store.list()) if at(i.progress, config.duration)), None)
    there = (
        f"the checkpoint at {config.max_duration} is {match.name}; to go back to it: resume_from={match.name}"
        if match
        else f"no checkpoint sits exactly at {config.max_duration} (retention may have removed it)"
    )
    return (
        f"run {config.run_name!r} already trained past max_duration={config.max_duration} (its newest checkpoint "
        f"{start.name} is at epoch {p.epoch}, step {p.step}, {p.samples_seen} samples); returning it unchanged. "
        f"{there[0].upper()}{there[1:]}"
    )


def execute_unit(
    config: TrainConfig,
    *,
    unit: int,
    start_checkpoint: str | None = None,
    attempt: int = 1,
    generation: int = 0,
    on_report: Callable[[UnitResult], None] | None = None,
    launch_nodes: Callable[[], NodeLauncher] | None = None,
) -> UnitResult:
    """Trains unit ``unit`` (or, for a recipe with its own ``train_loop``, the loop) wherever it runs: in this
    process, or on this attempt's gang of rank processes. ``on_report`` sees every committed checkpoint;
    ``launch_nodes`` starts the other machines of a gang with ``nnodes > 1`` (tasks/nodes.py)."""
    distributed = config.nproc_per_node > 1 or config.nnodes > 1 or config.parallelism == "fsdp"
    own = uses_own_loop(config)
    if distributed:
        from training.distributed.gang import Op, run_on_gang

        command = {
            "op": Op.LOOP if own else Op.UNIT,
            "unit": unit,
            "start_checkpoint": start_checkpoint,
            "attempt": attempt,
        }
        result = run_on_gang(config, command, generation, on_report if own else None, launch_nodes)
    elif own:
        from training.unit.own_loop import run_own_loop

        return run_own_loop(config, attempt=attempt, generation=generation, on_report=on_report)
    else:
        result = run_unit(config, start_checkpoint=start_checkpoint, attempt=attempt, generation=generation)
    if on_report is not None and not own:
        on_report(result)
    return result
