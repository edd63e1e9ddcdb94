"""Metrics where people look: TensorBoard event files beside the run, MLflow when configured, a progress bar.

The loops call a tiny interface on ``metrics_for(config, store, world)``: ``start(step)`` when a unit (or a loop of
the recipe's own) begins at a step, ``log(step, values)`` for each step's or report's figures, ``checkpoint(step,
...)`` around each commit, ``end(complete)`` when the unit is over. Only rank 0 writes (other ranks get a no-op), one
object per run and process, kept across units. A backend that fails is warned about once and turned off for the
rest of the process: a metric never fails or stalls training.

A resumed or retried run continues one curve:
- TensorBoard: a start at step k that does not continue this process's writer opens a new event file with
  ``purge_step=k + 1``. Readers (TensorBoard, ``EventAccumulator``) then discard what earlier files hold past step k:
  the steps a killed attempt logged past the checkpoint it resumes from are replaced by the retrained ones, never
  shown twice. Events are flushed before
  every commit, so nothing a checkpoint covers is lost with the process.
- MLflow (training/metrics/mlflow_log.py): the run's id is kept in the run folder, so a relaunch continues the same
  MLflow run; steps MLflow already holds are not sent again (MLflow keeps every value it is sent).

URIs in these log lines go through checkpointing.io.redact: no password or signed query reaches a log.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from collections.abc import Mapping
from typing import Any, Protocol, TextIO

from checkpointing import CheckpointStore
from checkpointing.io import confine
from checkpointing.io.redact import redact_uri
from training.config import TrainConfig
from training.metrics.mlflow_log import MlflowRun, mlflow_wanted
from training.world import SINGLE_PROCESS, World

logger = logging.getLogger(__name__)

TB_FOLDER = "tb"  # beside checkpoints/ in a local run folder
WORKER_ENV = "PREFECT__FLOW_RUN_ID"  # set by a Prefect worker in the flow-run process: nobody watches that terminal


def tensorboard_dir(config: TrainConfig, store: CheckpointStore) -> str | None:
    """The local folder of the run's event files: ``<metrics_dir>/<run_name>``, else ``tb/`` in a local run folder;
    None for a run in an object store without ``metrics_dir`` (event files are appended to: a store cannot)."""
    if config.metrics_dir:
        return os.path.join(os.path.abspath(os.path.expanduser(config.metrics_dir)), config.run_name)
    if store.storage.is_local:
        return os.path.join(store.storage.root, TB_FOLDER)
    return None


def wants_progress_bar(config: TrainConfig, stdout: TextIO | None = None, stderr: TextIO | None = None) -> bool:
    """A bar only for a person at a terminal: ``progress_bar`` on, stdout and stderr both a TTY, no Prefect worker."""
    out, err = stdout or sys.stdout, stderr or sys.stderr
    return config.progress_bar and WORKER_ENV not in os.environ and _isatty(out) and _isatty(err)


def _isatty(stream: Any) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # a replaced or closed stream
        return False


class MetricLog(Protocol):
    """What the loops call (rank 0's ``MetricsLog``, or a no-op elsewhere)."""

    def start(self, step: int, total_steps: int | None = None) -> None: ...
    def log(self, step: int, values: Mapping[str, float]) -> None: ...
    def checkpoint(self, step: int, name: str = "", uri: str = "") -> None: ...
    def end(self, complete: bool = False) -> None: ...


class _Off:
    """What ranks other than 0 get."""

    def start(self, step: int, total_steps: int | None = None) -> None:
        pass

    def log(self, step: int, values: Mapping[str, float]) -> None:
        pass

    def checkpoint(self, step: int, name: str = "", uri: str = "") -> None:
        pass

    def end(self, complete: bool = False) -> None:
        pass


OFF = _Off()
_LOGS: dict[str, MetricsLog] = {}  # per run (store URI) in this process: the writer outlives units
KEEP_OPEN = 2  # runs whose writers stay open in one process (each holds a file and a writer thread)
_TOLD: set[str] = set()  # folders whose location was logged once


def metrics_for(config: TrainConfig, store: CheckpointStore, world: World = SINGLE_PROCESS) -> MetricLog:
    """The run's metrics log in this process (rank 0), or a no-op."""
    if world.rank != 0:
        return OFF
    log = _LOGS.pop(store.uri, None)
    if log is None or log.config != config:
        if log is not None:
            log.close()
        log = MetricsLog(config, store)
    while len(_LOGS) >= KEEP_OPEN:  # the oldest run's writer is closed (it reopens, purging correctly, if needed)
        _LOGS.pop(next(iter(_LOGS))).close()
    _LOGS[store.uri] = log  # newest last
    return log


def close_run(store: CheckpointStore) -> None:
    """A run is complete in this process: its writer (file and thread) and MLflow run close now, not when the process
    ends or another run pushes them out (``train(config)`` from Python left TensorBoard's writer thread running)."""
    log = _LOGS.pop(store.uri, None)
    if log is not None:
        log.close()


def close_all() -> None:
    """Flushes and closes every open writer (tests, the end of a process)."""
    for log in _LOGS.values():
        log.close()
    _LOGS.clear()


class MetricsLog:
    """Rank 0's metrics of one run: TensorBoard, MLflow and the progress bar behind four verbs."""

    def __init__(self, config: TrainConfig, store: CheckpointStore):
        self.config, self.store = config, store
        self._writer: Any = None  # torch's SummaryWriter, opened at a start
        self._tb_on = config.tensorboard
        self._last_step: int | None = None  # the newest step logged by this process's writer
        self._mlflow = MlflowRun(config, store) if mlflow_wanted(config) else None
        self._bar: _Bar | None = None
        self._bar_on = True

    # -- the four verbs ----------------------------------------------------------------------------
    def start(self, step: int, total_steps: int | None = None) -> None:
        """A unit or loop begins at ``step``: a writer continuing elsewhere is replaced by one that purges from it."""
        if self._tb_on and (self._writer is None or self._last_step != step):
            self._tensorboard(lambda: self._open_writer(step))
        self._last_step = step
        if self._mlflow is not None:
            self._mlflow.start(step)
        if self._bar_on and wants_progress_bar(self.config) and total_steps:
            try:
                self._bar = _Bar(step, total_steps)
            except Exception as exc:  # rich missing (a bare image installed with --no-deps), a strange terminal
                self._bar_on = False
                logger.warning("the progress bar is off for this process: %s: %s", type(exc).__name__, exc)

    def log(self, step: int, values: Mapping[str, float]) -> None:
        """Scalars at ``step`` (tags such as ``train/loss``, ``eval/accuracy``)."""
        if self._writer is not None:
            self._tensorboard(lambda: self._add(step, values))
        self._last_step = step
        if self._mlflow is not None:
            self._mlflow.log(step, values)
        if self._bar is not None and "train/loss" in values:
            self._bar.update(step, values["train/loss"])

    def checkpoint(self, step: int, name: str = "", uri: str = "") -> None:
        """Called before a commit (no name): what was logged reaches disk and MLflow; after it (name, uri): MLflow
        records the checkpoint."""
        if self._writer is not None:
            self._tensorboard(self._writer.flush)
        if self._mlflow is not None:
            self._mlflow.checkpoint(step, name, uri)

    def end(self, complete: bool = False) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        if self._writer is not None:
            self._tensorboard(self._writer.flush)
        if self._mlflow is not None:
            self._mlflow.end(complete)

    def close(self) -> None:
        self.end()
        if self._writer is not None:
            self._tensorboard(self._writer.close)
            self._writer = None

    # -- TensorBoard -------------------------------------------------------------------------------
    def _add(self, step: int, values: Mapping[str, float]) -> None:
        from tensorboard.compat.proto.summary_pb2 import Summary

        # One event per step holding every tag, built directly: SummaryWriter.add_scalar makes an event per tag through
        # numpy conversions, 130-180 us each here (bench/metrics.py), where this takes ~10 us on the training thread.
        summary = Summary(value=[Summary.Value(tag=tag, simple_value=float(v)) for tag, v in values.items()])
        self._writer.file_writer.add_summary(summary, step)
        if step % self.config.log_every_n_steps == 0:  # a live curve (the writer's own flush waits 30 s)
            self._writer.flush()

    def _open_writer(self, step: int) -> None:
        from torch.utils.tensorboard import SummaryWriter  # needs the tensorboard package

        if self._writer is not None:
            self._writer.close()
            self._writer = None
        folder = tensorboard_dir(self.config, self.store)
        if folder is None:
            self._tb_on = False
            logger.info(
                "TensorBoard is off: %s is an object store; set metrics_dir to a local folder",
                redact_uri(self.store.uri),
            )
            return
        if confine.local_roots() is not None:  # a deployment run: only under the worker's roots, through no link
            confine.check(folder, f"TensorBoard folder {folder!r}")
        _wait_for_a_later_second(folder)
        # purge_step: readers drop what earlier files hold past the step resumed at (a killed attempt's steps)
        # max_queue: events wait for the writer's thread instead of the training thread waiting for it (its default
        # of 10 made every few steps block on a write)
        self._writer = SummaryWriter(log_dir=folder, purge_step=step + 1, flush_secs=30, max_queue=10_000)
        if folder not in _TOLD:
            _TOLD.add(folder)
            logger.info("TensorBoard event files in %s (tensorboard --logdir %s)", folder, folder)

    def _tensorboard(self, call: Any) -> None:
        try:
            call()
        except Exception as exc:  # a metric never fails training: warned once, TensorBoard is off from here on
            logger.warning("TensorBoard metrics are off for the rest of this process: %s: %s", type(exc).__name__, exc)
            self._tb_on, self._writer = False, None


def _wait_for_a_later_second(folder: str) -> None:
    """Readers take event files in name order, and a name starts with its whole second: a file opened in the same
    second as the folder's newest (a quick retry) could sort before it, its purge read too early. Waits (at most a
    second, and only then) until the clock has passed the newest file's second."""
    try:
        names = os.listdir(folder)
    except OSError:
        return
    seconds = [
        int(n.split(".")[3]) for n in names if n.startswith("events.out.tfevents.") and n.split(".")[3].isdigit()
    ]
    newest, deadline = max(seconds, default=0), time.monotonic() + 1.5
    while int(time.time()) <= newest and time.monotonic() < deadline:
        time.sleep(0.02)


class _Bar:
    """A rich progress bar on stderr: steps of the run, the newest loss, time left."""

    def __init__(self, step: int, total_steps: int):
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        self._progress = Progress(
            TextColumn("step"),
            MofNCompleteColumn(),
            BarColumn(),
            TextColumn("loss {task.fields[loss]}"),
            TimeRemainingColumn(),
            console=Console(stderr=True),
            redirect_stdout=False,
            redirect_stderr=False,
            transient=True,  # gone at the unit's end, where the unit's log line says what it did
        )
        self._task = self._progress.add_task("train", total=total_steps, completed=step, loss="-")
        self._progress.start()

    def update(self, step: int, loss: float) -> None:
        self._progress.update(self._task, completed=step, loss=f"{loss:.4f}")

    def close(self) -> None:
        self._progress.stop()
