"""Bring your own loop: Ray Train's model (``get_checkpoint`` / ``report``) on this product's commit protocol.

A recipe that defines ``train_loop(self, ctx)`` trains however it likes; the product builds nothing and owns
no DataLoader. Inside the loop the user calls ``ctx.get_checkpoint()`` (the run's newest good reported state,
or None for a fresh run) and ``ctx.report(metrics, state=...)`` at boundaries of their choosing. Each report
is a checkpoint committed the way a unit's is: ``state.pt`` through the committer (files, manifest, then
``latest``), fenced by the flow's writer generation, with retention and (when enabled) a background upload.

``max_duration`` is measured on the counters the loop reports (``epoch``, ``step``, ``samples_seen``; ``step``
defaults to the previous report's + 1). The run is complete once a report reaches it: ``ctx.should_stop`` turns
True then, and the flow treats the run as complete, so a relaunch returns at once. The product never interrupts
the loop; a loop that returns before any report reached ``max_duration`` fails the run (not retried), because
a relaunch could not tell that it had finished.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import time
import traceback
from collections.abc import Callable, Mapping
from typing import Any

import torch

from checkpointing import CheckpointInfo, CheckpointStore, Writer
from checkpointing.serialization import serialize
from checkpointing.store import STATE_FILE
from checkpointing.uploader import CommitRequest, Committer, PendingCommit
from training import rng
from training.config import ConfigError, TrainConfig
from training.context import RunContext
from training.identity import check_same_run
from training.loop import InjectedFault, UnitResult
from training.progress import Progress, is_complete
from training.recipe import load_recipe, recipe_class
from training.reported_state import ReportError, check_loadable, check_metrics
from training.session import SINGLE_PROCESS, checkpoint_metadata, open_store, pick_device, use_async_upload
from training.warm import PROCESS, SessionCache

logger = logging.getLogger(__name__)

COUNTERS = ("epoch", "step", "samples_seen")
# Options of the unit loop that a loop of the user's own cannot honour: set explicitly, they earn a warning.
IGNORED_OPTIONS = (
    "save_interval",
    "eval_interval",
    "eval_each_unit",
    "grad_clip_norm",
    "grad_accumulation",
    "ignore_data_skip",
    "data_skip_steps",
    "num_workers",
    "log_every_n_steps",
)


class LoopEndedEarlyError(ConfigError):
    """``train_loop`` returned before any report reached ``max_duration``. Never retried."""


def uses_own_loop(config: TrainConfig) -> bool:
    """Whether the recipe brings its own loop (``train_loop``), which then wins over build_model/loss/..."""
    return callable(getattr(recipe_class(config), "train_loop", None))


def check_own_loop(config: TrainConfig, log: Any = logger) -> None:
    """Start-up checks for a recipe with ``train_loop``: it constructs, and no option asks for what the loop owns."""
    for option in ("nproc_per_node", "nnodes"):
        if getattr(config, option) > 1:
            raise ConfigError(
                f"{option}={getattr(config, option)}: a recipe with train_loop runs in one process (the product does "
                f"not start its loop under torchrun); use {option}=1, or a recipe with build_model/loss for DDP"
            )
    if config.parallelism == "fsdp":
        raise ConfigError(
            "parallelism='fsdp': a recipe with train_loop runs in one process and shards nothing; use "
            "parallelism='ddp' (the default), or a recipe with build_model/loss for FSDP"
        )
    if config.load_path:
        raise ConfigError(
            f"load_path={config.load_path!r}: not applied to a recipe with train_loop (the loop builds its own "
            f"model); load weights inside train_loop when ctx.get_checkpoint() returns None"
        )
    load_recipe(config)  # its constructor's complaints about recipe_args, as one ConfigError
    ignored = sorted(set(config.model_fields_set) & set(IGNORED_OPTIONS))
    if ignored:
        log.warning(
            "%s: not used with a recipe that has train_loop (the loop decides when to report)", ", ".join(ignored)
        )


class LoopContext(RunContext):
    """The run context of ``train_loop(ctx)`` (everything of ``RunContext``: ``global_batch_size``, ``seed``,
    ``rank``, ``world_size``, ``device``, ``max_duration``, ...) plus ``get_checkpoint``, ``report``,
    ``should_stop`` and ``attempt`` (1, then 2, ... on Prefect retries). ``num_train_samples`` stays None: the
    product never sees the loop's data (set it yourself to use ``ctx.total_steps`` with an '<n>ep' duration)."""

    attempt: int

    def __init__(self, config: TrainConfig, store: CheckpointStore, *, committer: Committer, generation: int = 0,
                 attempt: int = 1, log: Any = logger, on_report: Callable[[UnitResult], None] | None = None):  # fmt: skip
        base = RunContext.of(config, device=pick_device(config))
        super().__init__(**{f.name: getattr(base, f.name) for f in dataclasses.fields(RunContext)})
        self.attempt = attempt
        self._config, self._store, self._committer = config, store, committer
        self._generation, self._log, self._on_report = generation, log, on_report
        committer.wait_quietly()  # a previous attempt's upload: let it land (or fail) before reading the store
        self._at: CheckpointInfo | None = store.latest()
        self._resumed_from = self._at
        self._asked = False
        self._last: PendingCommit | None = None
        self._last_metrics: dict[str, float] = {}
        self._num_reports = 0  # by this attempt

    # -- the user's two verbs ---------------------------------------------------------------------
    def get_checkpoint(self) -> dict[str, Any] | None:
        """The ``state`` of the run's newest good report (loaded with ``weights_only=True``), or None when the run
        has none yet. Call it at the top of ``train_loop``: a retry or a relaunch continues from what it returns."""
        self._asked = True
        self._committer.wait_quietly()
        loaded = self._store.load_latest([STATE_FILE])
        self._at = self._resumed_from = loaded.info if loaded else None
        if loaded is None:
            return None
        check_same_run(self._config, loaded.info)
        state = loaded.objects[STATE_FILE]
        if not isinstance(state, dict) or "state" not in state:
            raise ConfigError(f"{loaded.info.uri} was not written by ctx.report (no 'state'); use a new run_name")
        return state["state"]

    def report(self, metrics: Mapping[str, Any], state: Mapping[str, Any], *, step: int | None = None,
               epoch: int | None = None, samples_seen: int | None = None) -> None:  # fmt: skip
        """Commits ``state`` (tensors and plain containers: ``model.state_dict()``, ``optimizer.state_dict()``,
        counters, a sampler position) as the run's newest checkpoint, with ``metrics`` in its manifest.

        ``epoch`` (completed epochs), ``step`` and ``samples_seen`` are the run's progress counters; each one left
        out keeps the previous report's value, except ``step``, which then counts reports. ``max_duration`` is
        checked against them (``should_stop``). Raises ReportError for a state that would need code to load."""
        values = check_metrics(metrics)
        previous_step = self._at_progress["step"]
        progress = self._next_progress({"epoch": epoch, "step": step, "samples_seen": samples_seen})
        if self._at is not None and not self._asked and self._num_reports == 0:
            self._log.warning(
                "train_loop reported without calling ctx.get_checkpoint() although the run has checkpoint %s: "
                "its training restarted from scratch while the counters continue",
                self._at.name,
            )
        check_loadable(state)
        t0 = time.perf_counter()
        pending = self._commit(values, state, progress)
        values["checkpoint_seconds"] = time.perf_counter() - t0
        self._last, self._last_metrics, self._num_reports = pending, values, self._num_reports + 1
        self._log.info(
            "report %d: %s; checkpoint %s (%.1f MB) %s %.2fs; epoch %d, step %d, %d samples seen",
            self._report_index, _metrics_text(values), pending.name, pending.size_bytes / 1e6,
            "committed in" if pending.committed else "handed to the upload after", values["checkpoint_seconds"],
            progress["epoch"], progress["step"], progress["samples_seen"],
        )  # fmt: skip
        self._tell_flow(self.result(steps=progress["step"] - previous_step))
        if self._config.inject_fault_at_step == progress["step"] and self.attempt == 1:
            raise InjectedFault(f"injected fault after the report at step {progress['step']} (attempt 1)")

    @property
    def should_stop(self) -> bool:
        """True once a report (this attempt's or the one resumed from) reached ``max_duration``."""
        return is_complete(Progress.from_dict(self._at_progress), self.max_duration)

    # -- the product's side -------------------------------------------------------------------------
    def finish(self) -> UnitResult:
        """After ``train_loop`` returned: waits for the last upload, then checks that the run is complete."""
        self._committer.wait()  # the run is done only when its last checkpoint is committed (errors are retried)
        p = self._at_progress
        if not self.should_stop:
            raise LoopEndedEarlyError(
                f"train_loop returned after {self._num_reports} report(s) in this attempt, at epoch {p['epoch']}, "
                f"step {p['step']}, {p['samples_seen']} samples, before max_duration={self._config.max_duration} "
                f"(measured on the counters passed to ctx.report): loop while not ctx.should_stop, pass "
                f"epoch=/step=/samples_seen= to ctx.report, or set max_duration to what the loop trains (with no "
                f"counters passed, '<n>ba' is n reports)"
            )
        return self.result(steps=p["step"] - self._start_step, unit=0)  # the whole loop: the flow's only unit

    def result(self, steps: int, unit: int | None = None) -> UnitResult:
        """The run's newest report as a UnitResult: ``unit`` is the report's number (0-based) unless given."""
        info = self._at
        origin = self._resumed_from
        return UnitResult(
            unit=max(self._report_index, 0) if unit is None else unit,
            checkpoint=self._last.uri if self._last else (info.uri if info else ""),
            checkpoint_name=self._last.name if self._last else (info.name if info else ""),
            checkpoint_committed=self._last.committed if self._last else True,
            progress=self._at_progress,
            complete=self.should_stop,
            origin="store" if origin else "fresh",
            resumed_from=f"checkpoint {origin.name}" if origin else "fresh initialization",
            steps=max(steps, 0),
            attempt=self.attempt,
            metrics=self._last_metrics or (dict(info.metrics) if info else {}),
            num_train_samples=0,
        )

    # -- helpers ------------------------------------------------------------------------------------
    @property
    def _at_progress(self) -> dict[str, int]:
        recorded = self._at.progress if self._at else {}
        return {k: int(recorded.get(k, 0)) for k in COUNTERS}

    @property
    def _report_index(self) -> int:
        """Reports of the run so far, minus one: the newest report's number (0-based), -1 before any."""
        recorded = self._at.manifest.metadata.get("report", -1) if self._at else -1
        return int(recorded) if isinstance(recorded, int) else -1

    @property
    def _start_step(self) -> int:
        return int(self._resumed_from.progress.get("step", 0)) if self._resumed_from else 0

    def _next_progress(self, given: dict[str, int | None]) -> dict[str, int]:
        previous = self._at_progress
        progress = {k: previous[k] if v is None else v for k, v in given.items()}
        if given["step"] is None:
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

    def _commit(self, metrics: dict[str, float], state: Mapping[str, Any], progress: dict[str, int]) -> PendingCommit:
        config, store = self._config, self._store
        progress = {**progress, "global_batch_size": config.global_batch_size}
        index = self._report_index + 1
        base = f"ep{progress['epoch']}-ba{progress['step']}-sa{progress['samples_seen']}"
        metadata = {**_run_metadata(config, metrics), "train_loop": True, "report": index}
        request = CommitRequest(
            store=store,
            name=store.name_for(base, self._generation),
            blobs=serialize({STATE_FILE: {"state": dict(state), "progress": progress}}),
            progress=progress,
            metadata=metadata,
            writer=Writer.current(self._generation),
            keep=config.num_checkpoints_to_keep,
            score=(config.checkpoint_score_attribute, config.checkpoint_score_order)
            if config.checkpoint_score_attribute
            else None,
        )
        background = use_async_upload(config, store)
        pending = self._committer.submit(request) if background else self._committer.commit(request)
        self._at = pending.wait() if pending.committed else _uncommitted_info(request)
        return pending

    def _tell_flow(self, result: UnitResult) -> None:
        if self._on_report is None:
            return
        try:
            self._on_report(result)
        except Exception as exc:  # the UI is a report of the checkpoints, never a reason to stop training
            self._log.warning("report hook failed (%s: %s); training goes on", type(exc).__name__, exc)


def run_own_loop(config: TrainConfig, *, attempt: int = 1, generation: int = 0, log: Any = logger,
                 cache: SessionCache = PROCESS,
                 on_report: Callable[[UnitResult], None] | None = None) -> UnitResult:  # fmt: skip
    """Runs ``recipe.train_loop(ctx)`` once (an attempt) and returns the run's newest report."""
    recipe: Any = load_recipe(config)
    store = open_store(config)
    rng.seed_all(config.seed)  # the loop's fresh initialization is the same on every attempt
    ctx = LoopContext(config, store, committer=cache.committer, generation=generation, attempt=attempt, log=log,
                      on_report=on_report)  # fmt: skip
    recipe.ctx = ctx
    at = ctx._at
    log.info("train_loop (attempt %d): the run's newest report is %s", attempt, at.name if at else "none (fresh)")
    try:
        recipe.train_loop(ctx)
        return ctx.finish()
    except BaseException as exc:
        # A retry runs in this process: the failed loop's locals (model, optimizer, batches) must not outlive it.
        traceback.clear_frames(exc.__traceback__)
        raise
    finally:
        recipe.ctx = None
        del recipe
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


# -- small pieces --------------------------------------------------------------------------------
def _metrics_text(metrics: dict[str, float]) -> str:
    return ", ".join(f"{k} {v:.4g}" for k, v in metrics.items() if k != "checkpoint_seconds") or "no metrics"


class _OneProcess:
    """What ``checkpoint_metadata`` reads of a unit's session, for a loop that has none: one process, no data skip."""

    world = SINGLE_PROCESS
    data_skip_applied = None


def _run_metadata(config: TrainConfig, metrics: dict[str, float]) -> dict[str, Any]:
    """The same run identity as a unit's checkpoint (``check_same_run`` reads it), with the report's metrics."""
    return checkpoint_metadata(config, _OneProcess(), metrics)  # type: ignore[arg-type]


def _uncommitted_info(request: CommitRequest) -> CheckpointInfo:
    """The checkpoint a background upload will commit, as its manifest will describe it (for counters only)."""
    from checkpointing.manifest import Manifest

    manifest = Manifest(name=request.name, files={}, progress=request.progress, metadata=request.metadata,
                        writer=request.writer)  # fmt: skip
    return CheckpointInfo(request.name, request.uri, manifest)
