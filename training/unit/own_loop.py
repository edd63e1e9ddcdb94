"""A loop of your own: Ray Train's model (``get_checkpoint`` / ``report``) on this product's commit path.

A recipe that defines ``train_loop(self, ctx)`` trains however it likes; the product builds nothing and owns no
DataLoader. Inside the loop the user calls ``ctx.get_checkpoint()`` (the run's newest good reported state, or
None for a fresh run) and ``ctx.report(metrics, state=...)`` at boundaries of their choosing. A report with a
``state`` is a checkpoint committed the way a unit's is (checkpointing/commit/committer.py: files, manifest, ``latest``,
fencing, retention, a background upload where enabled); one without is a metrics-only report (logged and shown
in the UI, nothing committed).

Several processes (``nproc_per_node``/``nnodes`` > 1): every rank runs the loop under torchrun (the gang of
training/distributed/gang.py); ``ctx.rank``/``ctx.world_size`` say where it runs, and ``ctx.report(...)`` is called by
every rank at the same point: rank 0's ``state`` and metrics are committed, and with them every rank's RNG state and
``rank_state`` in files of its own (Ray merges every rank's files into one checkpoint); ``ctx.get_checkpoint()`` gives
each rank the shared state with its own ``rank_state`` merged in, and puts its RNGs back. ``ctx.prepare_model`` wraps
a model for DDP and ``ctx.sampler`` gives each rank its exact share of every global batch, resumable at a sample
and across world-size changes (``ResumableBatchSampler``). ``report``, ``get_checkpoint``, ``should_checkpoint`` and
the loop's return are meeting points (training/unit/rank_meetings.py): a rank waits for the others through the process group's store, not
in a collective, so a call made on some ranks only (``if ctx.rank == 0: ctx.report(...)``, Ray's habit) is a
ReportError within ``report_timeout_seconds``, never a hang, and a stop request ends the wait.

``max_duration`` is measured on the counters the loop reports (``epoch``, ``step``, ``samples_seen``; ``step``
defaults to the previous report's + 1). The run is complete once a report with a state reaches it:
``ctx.should_stop`` turns True, and a relaunch returns at once. A report past that point is committed and warned
about. A loop that returns before any report reached ``max_duration`` fails the run (not retried).

Preemption (training/preemption.py): on a termination signal ``ctx.should_checkpoint`` turns True (and
``ctx.preempted``); the loop should report its state there. That report is committed and then raises
``Preempted``, which ends the attempt; the relaunch's ``get_checkpoint()`` returns it. A loop that never looks
keeps training until its next report (committed, then ``Preempted``) or until the SIGKILL after the grace
period; what it trained since its last report is then lost.
"""

from __future__ import annotations

import gc
import logging
import traceback
from collections.abc import Callable, Mapping
from typing import Any

import torch

from checkpointing import CheckpointInfo, CheckpointStore, CorruptCheckpointError, ranks
from checkpointing.commit.committer import Committer, PendingCommit
from checkpointing.store import STATE_FILE
from training import preemption
from training.config import ConfigError, TrainConfig
from training.exceptions import LoopEndedEarlyError
from training.position.progress import Progress, is_complete
from training.position.sampler import ResumableBatchSampler
from training.preemption import Preempted
from training.recipe.context import RunContext
from training.recipe.loader import load_recipe
from training.start.host_memory import commit_unsent, newest_snapshot
from training.start.identity import check_same_run
from training.start.load_path import read_checkpoint, read_weights
from training.start.store import open_store
from training.unit import rng
from training.unit.checkpointer import Checkpointer, rank_state_file
from training.unit.loop import InjectedFault, UnitResult
from training.unit.rank_meetings import RankMeetings
from training.unit.reported_state import ReportError, check_loadable, check_metrics
from training.unit.session import SINGLE_PROCESS, World, pick_device, rng_file
from training.unit.warm import PROCESS, SessionCache

logger = logging.getLogger(__name__)

COUNTERS = ("epoch", "step", "samples_seen")
OnReport = Callable[[UnitResult], None]
REPORT_TIMEOUT_SECONDS = 30.0  # how long a rank waits at a report for the others (ctx.report_timeout_seconds)
# get_checkpoint and the loop's return wait this many times as long: work on one rank only before the first report (a
# download) or after the last (a final evaluation, an export) is common, and a wait there is no step of training lost
EDGE_PATIENCE = 10.0


class LoopContext(RunContext):
    """The run context of ``train_loop(ctx)`` (everything of ``RunContext``: ``global_batch_size``, ``seed``,
    ``rank``, ``world_size``, ``device``, ``max_duration``, ...) plus ``get_checkpoint``, ``report``,
    ``should_stop``, ``should_checkpoint``, ``prepare_model``, ``sampler``, ``attempt`` (1, then 2, ... on
    Prefect retries) and ``report_timeout_seconds`` (how long a rank waits for the others at a report: set it on
    the context, ``ctx.report_timeout_seconds = 120``, when ranks reach reports far apart). ``num_train_samples`` stays None: the product never sees the loop's data (set it yourself to
    use ``ctx.total_steps`` with an '<n>ep' duration)."""

    attempt: int
    report_timeout_seconds: float = REPORT_TIMEOUT_SECONDS

    def __init__(
        self,
        config: TrainConfig,
        store: CheckpointStore,
        *,
        committer: Committer,
        generation: int = 0,
        attempt: int = 1,
        world: World = SINGLE_PROCESS,
        on_report: OnReport | None = None,
    ):
        base = RunContext.of(
            config,
            rank=world.rank,
            world_size=world.size,
            local_rank=world.local_rank,
            device=pick_device(config, world),
        )
        super().__init__(**{name: getattr(base, name) for name in RunContext.__dataclass_fields__})
        self.attempt = attempt
        self._config, self._store, self._committer, self._world = config, store, committer, world
        self._checkpointer = Checkpointer(config, store, committer, generation=generation, world=world)
        self._on_report = on_report
        committer.wait_quietly()  # a previous attempt's upload: let it land (or fail) before reading the store
        self._at: CheckpointInfo | None = ranks.on_rank0(store.latest)
        self._progress = self._recorded(self._at)  # the newest report's counters (committed or metrics-only)
        self._committed = dict(self._progress)  # the newest committed report's counters
        self._resumed_from = self._at
        self._from_memory = False  # resumed from a snapshot in this machine's memory (host_memory.py)
        self._asked = False
        self._last: PendingCommit | None = None
        self._last_metrics: dict[str, float] = {}
        self._num_reports = 0  # by this attempt
        self._warned_past_end = False
        self._meetings = RankMeetings(world)  # report, get_checkpoint, should_checkpoint: all ranks or an error

    # -- the user's verbs -------------------------------------------------------------------------
    def get_checkpoint(self, *, restore_rng: bool = True) -> dict[str, Any] | None:
        """The ``state`` of the run's newest good report (loaded with ``weights_only=True``), with this rank's
        ``rank_state`` of that report merged over it, or None when the run has none yet. With ``restore_rng`` (the
        default) this rank's torch, NumPy and Python RNGs are put back as they were at its report: build what draws
        random numbers at start-up before calling it. Call it at the top of ``train_loop``, on every rank: a retry or
        a relaunch continues from what it returns."""
        self._asked = True
        self._meet("ctx.get_checkpoint()", patience=EDGE_PATIENCE)
        self._committer.wait_quietly()
        mine = [STATE_FILE, rng_file(self._world.rank), rank_state_file(self._world.rank)]
        in_memory = newest_snapshot(self._config, self._store, self._world.rank, self._world.size)
        if in_memory is not None:  # a report newer than the store's, in this machine's memory (a hard kill's relaunch)
            if self._world.rank == 0:  # its upload died with its process: the store gets it first, as it was recorded
                commit_unsent(self._config, in_memory, self._store, self._checkpointer.writer)
            return self._resume(in_memory.info, in_memory.objects, restore_rng, from_memory=True)
        candidates = self._store.candidates() if self._world.rank == 0 else iter(())
        while (info := ranks.on_rank0(lambda: next(candidates, None))) is not None:
            try:
                loaded = ranks.on_every_rank(lambda: self._store.load(info, mine))
            except CorruptCheckpointError as exc:
                logger.warning("skipping checkpoint %s: %s", info.name, exc)
                continue
            return self._resume(info, loaded.objects, restore_rng)
        self._at = self._resumed_from = None
        self._progress = self._committed = self._recorded(None)
        return ranks.on_every_rank(lambda: load_path_state(self._config)) if self._config.load_path else None

    def _resume(
        self, info: CheckpointInfo, objects: Mapping[str, Any], restore_rng: bool, from_memory: bool = False
    ) -> dict[str, Any]:
        check_same_run(self._config, info)
        state, rank = objects.get(STATE_FILE), self._world.rank
        if not isinstance(state, dict) or "state" not in state:
            raise ConfigError(f"{info.uri} was not written by ctx.report (no 'state'); use a new run_name")
        self._at = self._resumed_from = info
        self._progress = self._committed = self._recorded(info)
        self._from_memory = from_memory
        saved_size = info.manifest.metadata.get("world_size")
        if rank == 0 and isinstance(saved_size, int) and saved_size != self._world.size:
            self._log_world_change(info.name, saved_size)
        if restore_rng:
            if objects.get(rng_file(rank)) is not None:
                rng.restore(objects[rng_file(rank)])
            else:
                logger.info(
                    "rank %d: %s has no RNG state for this rank (saved with world size %s); the RNG stays as "
                    "train_loop left it",
                    rank,
                    info.name,
                    saved_size,
                )
        own = objects.get(rank_state_file(rank))
        return {**state["state"], **own["state"]} if isinstance(own, dict) else state["state"]

    def report(
        self,
        metrics: Mapping[str, Any],
        state: Mapping[str, Any] | None = None,
        *,
        rank_state: Mapping[str, Any] | None = None,
        step: int | None = None,
        epoch: int | None = None,
        samples_seen: int | None = None,
    ) -> None:
        """Reports ``metrics``; with ``state`` (tensors and plain containers: ``model.state_dict()``,
        ``optimizer.state_dict()``, counters, a sampler position) also commits it as the run's newest checkpoint,
        together with every rank's RNG state and ``rank_state`` (what differs between ranks: each rank's own, which
        ``get_checkpoint()`` merges over ``state`` on that rank only, as Ray merges every rank's files).

        ``epoch`` (completed epochs), ``step`` and ``samples_seen`` are the run's progress counters; each one left
        out keeps the previous report's value, except ``step`` of a report with a state, which then is the previous
        one's + 1 (a metrics-only report leaves it where it is). ``max_duration`` is checked against them
        (``should_stop``). When several processes train, every rank calls it at the same point; rank 0's ``state``,
        counters and metrics are the ones committed (``state=None`` elsewhere is fine, as in Ray); a call missing on
        some rank is a ReportError on every rank within ``report_timeout_seconds``. Raises ReportError for a state
        that would need code to load, and ``Preempted`` after committing when a stop was requested."""
        values = check_metrics(metrics)
        self._meet("ctx.report()")
        previous_step = self._progress["step"]
        progress = self._next_progress({"epoch": epoch, "step": step, "samples_seen": samples_seen}, state is not None)
        # rank 0's counters and metrics count, and its state decides whether the report commits
        progress, values, commits = ranks.on_rank0(lambda: (progress, values, state is not None))
        self._warn_if_unusual(progress)
        stop = preemption.agreed_stop(self._world.size)
        seconds: float | None = None
        if commits:
            ranks.on_every_rank(lambda: self._check_states(state, rank_state))
            saved = self._checkpointer.save_report(
                state or {}, progress, values, self._report_index + 1, rank_state=rank_state
            )
            seconds = values["checkpoint_seconds"] = saved.seconds
            self._last, self._committed = saved.pending, dict(progress)
        else:
            ranks.on_every_rank(lambda: _no_rank_state(rank_state))
        self._progress, self._last_metrics, self._num_reports = progress, values, self._num_reports + 1
        self._log_report(values, progress, commits)
        self._tell_flow(self.result(steps=progress["step"] - previous_step))
        if stop is not None:
            name = self._last.name if self._last else (self._at.name if self._at else None)
            raise Preempted(stop, name, progress["step"], seconds, "" if commits else "(a metrics-only report)")
        if self._config.inject_fault_at_step == progress["step"] and self.attempt == 1:
            raise InjectedFault(f"injected fault after the report at step {progress['step']} (attempt 1)")

    @property
    def should_stop(self) -> bool:
        """True once a report (this attempt's or the one resumed from) reached ``max_duration``. Not a collective:
        the counters it reads are agreed at each report, so every rank gives the same answer, read anywhere. Raises
        the ReportError of another rank that gave up waiting for this one at a report (``report_timeout_seconds``)."""
        if (failure := self._meetings.failure()) is not None:
            raise failure
        return is_complete(Progress.from_dict(self._progress), self.max_duration)

    @property
    def should_checkpoint(self) -> bool:
        """True when the run was asked to stop (a termination signal, or a newer attempt taking over): report
        your state now. A collective when several processes train: read it at the same point on every rank (a read
        missing on some rank is a ReportError on every rank within ``report_timeout_seconds``)."""
        self._meet("ctx.should_checkpoint")
        return preemption.agreed_stop(self._world.size) is not None

    @property
    def preempted(self) -> bool:
        """The same as ``should_checkpoint`` (Lightning's and NeMo's name for it)."""
        return self.should_checkpoint

    def prepare_model(self, model: torch.nn.Module) -> torch.nn.Module:
        """``model`` on this rank's device, wrapped in DDP when several processes train (Ray's ``prepare_model``).
        Load a checkpoint's weights before wrapping, and save ``model.module.state_dict()`` (or keep the unwrapped
        model) so that the saved keys carry no ``module.`` prefix."""
        model = model.to(self.device)
        if self.world_size == 1:
            return model
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(model, device_ids=[self.device.index] if self.device.type == "cuda" else None)

    def sampler(self, num_samples: int, *, epoch: int = 0, start: int = 0, shuffle: bool = True) -> Any:
        """This rank's share of each global batch of ``global_batch_size`` over a dataset of ``num_samples``, from
        sample ``start`` of epoch ``epoch`` (``ResumableBatchSampler``): save ``epoch`` and the sample position in
        your state and resume exactly, at any world size."""
        return ResumableBatchSampler(
            num_samples,
            self.global_batch_size,
            seed=self.seed,
            epoch=epoch,
            start=start,
            shuffle=shuffle,
            rank=self.rank,
            world_size=self.world_size,
        )

    # -- the product's side -------------------------------------------------------------------------
    def finish(self) -> UnitResult:
        """After ``train_loop`` returned: waits for the last upload, then checks that the run is complete."""
        self._meet("the end of train_loop", patience=EDGE_PATIENCE)
        self._committer.wait()  # the run is done only when its last checkpoint is committed (errors are retried)
        p = self._committed
        if not is_complete(Progress.from_dict(p), self.max_duration):
            raise LoopEndedEarlyError(
                f"train_loop returned after {self._num_reports} report(s) in this attempt, at epoch {p['epoch']}, "
                f"step {p['step']}, {p['samples_seen']} samples (its newest report with a state), before "
                f"max_duration={self._config.max_duration} (measured on the counters passed to ctx.report): loop "
                f"while not ctx.should_stop and report a state at the end, pass epoch=/step=/samples_seen= to "
                f"ctx.report, or set max_duration to what the loop trains (with no counters passed, '<n>ba' is n "
                f"reports)"
            )
        self._checkpointer.finish()  # complete: the snapshots leave this machine's memory
        return self.result(steps=p["step"] - self._start_step, unit=0)  # the whole loop: the flow's only unit

    def result(self, steps: int, unit: int | None = None) -> UnitResult:
        """The run's newest report as a UnitResult: ``unit`` is the report's number (0-based) unless given."""
        info, origin, last = self._at, self._resumed_from, self._last
        return UnitResult(
            unit=max(self._report_index, 0) if unit is None else unit,
            checkpoint=last.uri if last else (info.uri if info else ""),
            checkpoint_name=last.name if last else (info.name if info else ""),
            checkpoint_committed=last.committed if last else True,
            progress=dict(self._progress),
            complete=self.should_stop,
            origin=("host" if self._from_memory else "store") if origin else "fresh",
            resumed_from=(
                (
                    f"snapshot {origin.name} in this machine's memory"
                    if self._from_memory
                    else f"checkpoint {origin.name}"
                )
                if origin
                else "fresh initialization"
            ),
            steps=max(steps, 0),
            attempt=self.attempt,
            metrics=self._last_metrics or (dict(info.metrics) if info else {}),
            num_train_samples=0,
            world_size=self._world.size,
        )

    # -- helpers ------------------------------------------------------------------------------------
    @staticmethod
    def _recorded(info: CheckpointInfo | None) -> dict[str, int]:
        recorded = info.progress if info else {}
        return {k: int(recorded.get(k, 0)) for k in COUNTERS}

    @property
    def _report_index(self) -> int:
        """Reports of the run so far, minus one: the newest report's number (0-based), -1 before any."""
        recorded = self._last.metadata.get("report") if self._last else None
        if recorded is None and self._at is not None:
            recorded = self._at.manifest.metadata.get("report", -1)
        return int(recorded) if isinstance(recorded, int) else -1

    @property
    def _start_step(self) -> int:
        return int(self._resumed_from.progress.get("step", 0)) if self._resumed_from else 0

    def _next_progress(self, given: dict[str, int | None], with_state: bool) -> dict[str, int]:
        previous = self._progress
        progress = {k: previous[k] if v is None else v for k, v in given.items()}
        if given["step"] is None and with_state:  # a metrics-only report trained nothing the counters could tell
            progress["step"] = previous["step"] + 1
        for name, value in progress.items():
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ReportError(f"ctx.report({name}={value!r}): use a non-negative int")
            if value < previous[name]:
                raise ReportError(
                    f"ctx.report({name}={value}): the run's newest report is at {name}={previous[name]}; counters "
                    f"never go back. Call ctx.get_checkpoint() at the top of train_loop and continue from its state"
                )
        return progress

    def _check_states(self, state: Mapping[str, Any] | None, rank_state: Mapping[str, Any] | None) -> None:
        if self._world.rank == 0:
            check_loadable(state)  # rank 0's state is the one committed
        if rank_state is not None:
            check_loadable(rank_state, "rank_state")

    def _meet(self, point: str, patience: float = 1.0) -> None:
        newest = self._last.name if self._last else (self._at.name if self._at else None)
        self._meetings.meet(point, patience * self.report_timeout_seconds, newest, self._progress["step"])

    def _warn_if_unusual(self, progress: dict[str, int]) -> None:
        if self._at is not None and not self._asked and self._num_reports == 0:
            logger.warning(
                "train_loop reported without calling ctx.get_checkpoint() although the run has checkpoint "
                "%s: its training restarted from scratch while the counters continue",
                self._at.name,
            )
        if self.should_stop and progress != self._progress and not self._warned_past_end:
            self._warned_past_end = True
            logger.warning(
                "train_loop reported epoch %d, step %d, %d samples after max_duration=%s was reached (at epoch %d, "
                "step %d): the run was already complete; loop while not ctx.should_stop",
                progress["epoch"],
                progress["step"],
                progress["samples_seen"],
                self.max_duration,
                *map(self._progress.get, COUNTERS[:2]),
            )

    def _log_report(self, values: dict[str, float], progress: dict[str, int], committed: bool) -> None:
        if self._world.rank != 0:
            return
        from training.metrics.log import metrics_for  # TensorBoard, MLflow (rank 0), from this attempt's start

        log = metrics_for(self._config, self._store, self._world)
        if self._num_reports == 1:
            log.start(self._start_step)
        log.log(progress["step"], {f"report/{k}": v for k, v in values.items() if k != "checkpoint_seconds"})
        if committed and self._last is not None:
            log.checkpoint(progress["step"], self._last.name, self._last.uri)
        if self.should_stop:
            log.end(complete=True)
        text = ", ".join(f"{k} {v:.4g}" for k, v in values.items() if k != "checkpoint_seconds") or "no metrics"
        saved = "metrics only"
        if committed and self._last is not None:
            how = "committed in" if self._last.committed else "handed to the upload after"
            saved = (
                f"checkpoint {self._last.name} ({self._last.size_bytes / 1e6:.1f} MB) {how} "
                f"{values['checkpoint_seconds']:.2f}s"
            )
        logger.info(
            "report %d: %s; %s; epoch %d, step %d, %d samples seen",
            max(self._report_index, 0),
            text,
            saved,
            progress["epoch"],
            progress["step"],
            progress["samples_seen"],
        )

    def _log_world_change(self, name: str, saved: int) -> None:
        """One line, as a unit's changed global batch size gets one (training/unit/session.py, ``reposition``)."""
        size = self._world.size
        rest = (
            f"{_span(saved, size - 1)} start{'s' if size - saved == 1 else ''} without a rank_state or RNG state "
            f"of {'its' if size - saved == 1 else 'their'} own"
            if size > saved
            else f"the rank_state and RNG state of {_span(size, saved - 1)} are not resumed"
        )
        logger.info(
            "world size changed %d -> %d: %s resumes on every rank; %s; ctx.sampler splits each global batch over "
            "%d process(es) (nothing repeated or dropped)",
            saved,
            size,
            name,
            rest,
            size,
        )

    def _tell_flow(self, result: UnitResult) -> None:
        if self._on_report is None:
            return
        try:
            self._on_report(result)
        except Exception as exc:  # the UI is a report of the checkpoints, never a reason to stop training
            logger.warning("report hook failed (%s: %s); training goes on", type(exc).__name__, exc)


def _span(first: int, last: int) -> str:
    return f"rank {first}" if first == last else f"ranks {first}..{last}"


def _no_rank_state(rank_state: Mapping[str, Any] | None) -> None:
    if rank_state is not None:
        raise ReportError(
            "ctx.report(rank_state=...) on a metrics-only report: rank_state is committed with a state, and rank 0's "
            "state= decides whether a report commits one"
        )


def load_path_state(config: TrainConfig) -> dict[str, Any]:
    """What ``get_checkpoint()`` returns for a run that has no checkpoint of its own yet but a ``load_path`` (Ray's
    ``resume_from_checkpoint``): the reported state of that checkpoint or run folder, or ``{"model": weights}`` of a
    weights file (or of a folder with ``load_weights_only``)."""
    weights = read_weights(config)
    if weights is not None:
        if weights.from_file:
            what = weights.peer.weights.description
            logger.info(
                "no checkpoint of this run yet: get_checkpoint() returns {'model': ...} of load_path (%s)", what
            )
        return {"model": weights.peer.weights.state_dict}
    loaded = read_checkpoint(config)
    logger.info("no checkpoint of this run yet: get_checkpoint() returns the state of %s (load_path)", loaded.info.uri)
    return dict(loaded.objects[STATE_FILE]["state"])


def run_own_loop(
    config: TrainConfig,
    *,
    attempt: int = 1,
    generation: int = 0,
    world: World = SINGLE_PROCESS,
    cache: SessionCache = PROCESS,
    on_report: OnReport | None = None,
) -> UnitResult:
    """Runs ``recipe.train_loop(ctx)`` once (an attempt) on this rank and returns the run's newest report."""
    store = open_store(config)
    rng.seed_all(config.seed)  # the loop's fresh initialization: the same on every attempt and every rank
    ctx = LoopContext(
        config,
        store,
        committer=cache.committer,
        generation=generation,
        attempt=attempt,
        world=world,
        on_report=on_report,
    )
    recipe: Any = load_recipe(config, ctx)
    if world.rank == 0:
        logger.info(
            "train_loop (attempt %d) on %d process(es): the run's newest report is %s",
            attempt,
            world.size,
            ctx._at.name if ctx._at else "none (fresh)",
        )
    try:
        recipe.train_loop(ctx)
        return ctx.finish()
    except BaseException as exc:
        instead: Exception | None = state_misfit(config, exc)
        if instead is None and world.size > 1 and isinstance(exc, RuntimeError):
            instead = ctx._meetings.failure()  # the loop's own collective broke: a rank gave up waiting for this one
        # A retry runs in this process: the failed loop's locals (model, optimizer, batches) must not outlive it.
        traceback.clear_frames(exc.__traceback__)
        if instead is not None:
            raise instead from exc
        raise
    finally:
        recipe.ctx = None
        del recipe
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


# Where torch refuses a state that does not fit: raised in these functions, an error repeats on every attempt.
_LOADERS = ("torch/nn/modules/module.py", "torch/optim/optimizer.py")


def state_misfit(config: TrainConfig, exc: BaseException) -> ConfigError | None:
    """A ConfigError (never retried) for torch's ``load_state_dict`` refusing the state the loop loads into its model
    or optimizer: the same checkpoint and the same model fail the same way on every attempt and on every rank (a
    retry only spent its backoff to reach the same line). None for anything else."""
    if not isinstance(exc, (RuntimeError, ValueError)) or isinstance(exc, torch.OutOfMemoryError):
        return None
    frames = [frame.f_code for frame, _ in traceback.walk_tb(exc.__traceback__)]
    if not frames or frames[-1].co_name != "load_state_dict" or not frames[-1].co_filename.endswith(_LOADERS):
        return None
    what = "optimizer" if frames[-1].co_filename.endswith(_LOADERS[1]) else "model"
    first = str(exc).strip().splitlines()[0][:300] if str(exc).strip() else type(exc).__name__  # torch's, no keys
    return ConfigError(
        f"recipe {config.recipe!r}: train_loop loaded a state that does not fit its {what} ({first}); every attempt "
        f"would fail the same way, so it is not retried. Check recipe and recipe_args against the state "
        f"ctx.get_checkpoint() returns (load_path={config.load_path!r}, or this run's newest report), or start a new "
        f"run_name"
    )
