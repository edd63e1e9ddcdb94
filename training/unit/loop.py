"""One unit of training, in plain PyTorch: resolve where to start, train to the unit boundary, commit.

Every unit begins by resolving the run's newest good checkpoint (``session.restore``), so a Prefect
retry, a restarted flow or a new process elsewhere all resume the same way. A stop request (a termination
signal, a newer attempt taking over: training/preemption.py) ends the unit early at a step boundary, with a
checkpoint there, and raises ``Preempted``.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from pydantic import BaseModel
from torch.utils.data import DataLoader

from checkpointing import CheckpointStore, Writer
from checkpointing.commit.committer import PendingCommit
from checkpointing.errors import CheckpointError, Permanent, StorageError
from training import preemption
from training.config import ConfigError, TrainConfig
from training.exceptions import InjectedFault
from training.lifetimes import die_with, remove_orphaned_semaphores_once
from training.metrics.log import MetricLog, metrics_for
from training.position.iterable import loader_workers
from training.position.progress import crossed, ends_unit, is_complete, samples_left, unit_index
from training.position.sampler import ResumableBatchSampler
from training.position.worker_seeds import seed_generators
from training.preemption import Preempted, SaveBudget, Stop
from training.start.host_memory import commit_unsent, unsent_checkpoint
from training.start.store import open_store
from training.unit import session as sessions
from training.unit.checkpointer import Checkpointer, discard_host_snapshots
from training.unit.evaluation import evaluate_model, to_device
from training.unit.figures import AttemptFigures, UnitFigures
from training.unit.session import SINGLE_PROCESS, Origin, OriginKind, Session, World
from training.unit.warm import PROCESS, SessionCache

logger = logging.getLogger(__name__)


class UnitResult(BaseModel):
    """What a unit (or a ``train_loop`` report) reports: small, no tensors."""

    unit: int
    checkpoint: str
    checkpoint_name: str
    checkpoint_committed: bool  # False while its background upload is still in flight
    progress: dict[str, int]
    complete: bool
    origin: OriginKind  # where the unit's state came from
    resumed_from: str  # the same, for people
    steps: int
    attempt: int = 1  # this unit's attempt (a Prefect retry is attempt 2, ...)
    previous_failure: str = ""  # why the attempt before it failed, when the orchestrator recorded it
    metrics: dict[str, float]
    num_train_samples: int
    world_size: int = 1


class _StopAtStep(Exception):
    """Internal: a stop request was agreed at a step boundary (or during an evaluation)."""

    def __init__(self, stop: Stop):
        super().__init__(stop.reason)
        self.stop = stop


BUDGETS: dict[str, SaveBudget] = {}  # per run (store URI): this process's save times, for the grace budget


def run_unit(
    config: TrainConfig,
    *,
    start_checkpoint: str | None = None,
    attempt: int = 1,
    generation: int = 0,
    world: World = SINGLE_PROCESS,
    cache: SessionCache = PROCESS,
) -> UnitResult:
    """Trains one unit and commits its checkpoint. ``start_checkpoint`` is where the flow expects it to start
    (this process's state is reused only for that one); ``generation`` fences stale writers."""
    store = open_store(config)
    budget = BUDGETS.setdefault(store.uri, SaveBudget(config.preemption_grace_seconds))
    session, origin = _start(config, store, start_checkpoint, world, cache, generation)
    unit = unit_index(session.progress, config.interval)
    if origin.kind == "store" and is_complete(session.progress, config.duration):
        return _already_complete(config, store, session, origin, unit, attempt, cache)
    if world.rank == 0:
        _log_unit_start(unit, attempt, origin, session)
    log = metrics_for(config, store, world)  # TensorBoard, MLflow, the progress bar (rank 0)
    try:
        log.start(session.progress.step, _total_steps(session))
        checkpointer = Checkpointer(config, store, cache.committer, generation=generation, world=world)
        trained = _train(config, session, unit, attempt, checkpointer, log)
        pending, metrics = _commit(config, session, origin, checkpointer, log, budget, cache, trained)
        log.end(complete=is_complete(session.progress, config.duration))
    except BaseException as exc:
        log.end()
        cache.release(session)  # a failed attempt's state must not leak into the retry
        if isinstance(exc, Exception) and not isinstance(exc, (CheckpointError, StorageError, Permanent)):
            # training failed, not the store: the newest snapshot reaches the store before the retry starts
            cache.committer.keep_newest_snapshot()
        raise
    cache.keep(config, store, session, pending.name)
    if world.rank == 0:
        _log_unit_done(unit, session, pending, metrics)
    return UnitResult(
        unit=unit,
        checkpoint=pending.uri,
        checkpoint_name=pending.name,
        checkpoint_committed=pending.committed,
        progress=session.progress.as_dict(),
        complete=is_complete(session.progress, config.duration),
        origin=origin.kind,
        resumed_from=origin.text,
        steps=trained[1],
        attempt=attempt,
        metrics=metrics,
        num_train_samples=len(session.dataset),
        world_size=world.size,
    )


def _already_complete(
    config: TrainConfig,
    store: CheckpointStore,
    s: Session,
    origin: Origin,
    unit: int,
    attempt: int,
    cache: SessionCache,
) -> UnitResult:
    """The run's newest checkpoint is its last (a retry of the last unit after its checkpoint was committed: the
    failure came after, or ``_start`` just committed it from this machine's memory). Nothing is trained or committed
    again: the unit reports that checkpoint as its manifest recorded it. Trained as a unit of 0 steps, it was committed
    again with 0 samples, a train_loss of 0 and no evaluation, and a sweep decided on those."""
    assert origin.checkpoint is not None
    info = store.info(origin.checkpoint)
    if info is None:
        raise CheckpointError(f"checkpoint {origin.checkpoint} was resumed from but has no manifest now")
    if s.world.rank == 0:
        discard_host_snapshots(store, cache.committer)  # the run is complete: its snapshots leave this machine's memory
        logger.info("unit %d (attempt %d): %s is the run's last; nothing left to train", unit, attempt, info.name)
    cache.keep(config, store, s, info.name)
    return UnitResult(
        unit=unit,
        checkpoint=info.uri,
        checkpoint_name=info.name,
        checkpoint_committed=True,
        progress=s.progress.as_dict(),
        complete=True,
        origin=origin.kind,
        resumed_from=origin.text,
        steps=0,
        attempt=attempt,
        metrics=info.metrics,
        num_train_samples=len(s.dataset),
        world_size=s.world.size,
    )


def _start(
    config: TrainConfig,
    store: CheckpointStore,
    start_checkpoint: str | None,
    world: World,
    cache: SessionCache,
    generation: int,
) -> tuple[Session, Origin]:
    """The unit's state: this process's warm session when it is the one the flow expects (on every rank at once),
    else the run's newest good checkpoint (a cold resume). A checkpoint this machine's memory holds and the store
    never got (its upload failed, and this is the retry) is committed first, as it was recorded: resumed from, a
    unit's end would leave the retry a unit of 0 steps (training/start/host_memory.py)."""
    session, origin = cache.take(config, store, start_checkpoint, world)
    if world.size > 1 and not _everywhere(session is not None):
        if session is not None:
            cache.release(session)
        session = origin = None
    if session is None or origin is None:
        cache.committer.wait_quietly()  # a cold resume must see what the previous unit committed
        unsent = unsent_checkpoint(config, store) if world.rank == 0 else None
        if unsent is not None:
            commit_unsent(config, unsent, store, Writer.current(generation))
        session, origin = sessions.restore(config, store, world)
    return session, origin


def _commit(
    config: TrainConfig,
    s: Session,
    origin: Origin,
    checkpointer: Checkpointer,
    log: MetricLog,
    budget: SaveBudget,
    cache: SessionCache,
    trained: tuple[dict[str, float], int, Stop | None],
) -> tuple[PendingCommit, dict[str, float]]:
    """The unit's checkpoint, at its end or at the step where a stop was agreed (then ``Preempted`` is raised once it
    is saved); a stop before any step, or one the grace budget cannot fit, raises without saving."""
    (metrics, steps, stop), p = trained, s.progress
    if stop is not None and steps == 0:
        raise _preempted(stop, origin.checkpoint, s, None, cache)
    if stop is not None and not budget.fits(stop):
        raise _preempted(stop, origin.checkpoint, s, None, cache, budget.why_not(stop))
    log.log(
        p.step, {"unit/train_loss": metrics["train_loss"], "unit/samples_per_second": metrics["samples_per_second"]}
    )
    log.checkpoint(p.step)  # what was logged is on disk before the checkpoint that covers it exists
    metrics = {**metrics, **checkpointer.snapshot_figures()}
    saved = checkpointer.save(s, metrics)
    pending, stall = saved.pending, saved.seconds
    log.checkpoint(p.step, pending.name, pending.uri)
    budget.observe(stall)  # and once an upload in the background is done, the whole commit: a stop waits for it
    pending.when_committed(lambda seconds: budget.observe(max(seconds, stall)))
    if stop is not None:
        raise _preempted(stop, pending.name, s, stall, cache)
    if is_complete(p, config.duration):
        checkpointer.finish()  # the run is done only when its last checkpoint is committed
    return pending, {**metrics, "checkpoint_seconds": stall}


def _preempted(
    stop: Stop, checkpoint: str | None, s: Session, seconds: float | None, cache: SessionCache, note: str = ""
) -> Preempted:
    """The exception that ends a stopped unit; an upload still in flight is finished first (within the grace).
    ``seconds``: the save's stall; the upload waited for here is added, so the figure is the whole commit's."""
    started = time.monotonic()
    try:
        cache.committer.wait()
    except Exception as exc:  # that upload is lost; the relaunch resumes from what did commit
        note = f"{note}; the background upload before it failed ({type(exc).__name__})".lstrip("; ")
    if seconds is not None:
        seconds += time.monotonic() - started
    return Preempted(stop, checkpoint, s.progress.step, seconds, note)


def _everywhere(ok: bool) -> bool:
    """True on every rank when ``ok`` is True on every rank (a collective)."""
    import torch.distributed as dist

    flag = torch.tensor([1 if ok else 0])
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def _log_unit_start(unit: int, attempt: int, origin: Origin, s: Session) -> None:
    p = s.progress
    logger.info(
        "unit %d (attempt %d): starting from %s at epoch %d, step %d, %d samples seen",
        unit,
        attempt,
        origin.text,
        p.epoch,
        p.step,
        p.samples_seen,
    )


def _log_unit_done(unit: int, s: Session, pending: PendingCommit, metrics: dict[str, float]) -> None:
    p, how = s.progress, "committed in" if pending.committed else "handed to the upload after"
    logger.info(
        "unit %d done: train_loss %.4f, %.0f samples/s, checkpoint %s (%.1f MB) %s %.2fs; epoch %d, step %d, "
        "%d samples seen",
        unit,
        metrics["train_loss"],
        metrics["samples_per_second"],
        pending.name,
        pending.size_bytes / 1e6,
        how,
        metrics["checkpoint_seconds"],
        p.epoch,
        p.step,
        p.samples_seen,
    )


# -- train ----------------------------------------------------------------------------------------
@dataclass
class _Training:
    """What one ``_train`` call works with: the unit, where it saves and logs, and its running figures."""

    config: TrainConfig
    s: Session
    unit: int
    attempt: int
    checkpointer: Checkpointer
    log: MetricLog
    figures: UnitFigures  # from the unit's start: a unit resumed inside it goes on from the figures it recorded
    this_attempt: AttemptFigures


def _train(
    config: TrainConfig, s: Session, unit: int, attempt: int, checkpointer: Checkpointer, log: MetricLog
) -> tuple[dict[str, float], int, Stop | None]:
    """Trains to the end of the unit, or to the step boundary where a stop was agreed (returned), taking the
    snapshots of ``snapshot_interval`` on the way."""
    p, epoch_size = s.progress, len(s.dataset)
    s.model.train()
    # A unit resumed from a checkpoint inside it (a snapshot, a stop) carries the figures of the steps before it
    # (Session.figures), so it reports what an uninterrupted unit reports.
    figures = s.figures or UnitFigures(unit_start_samples=p.samples_seen)
    t = _Training(config, s, unit, attempt, checkpointer, log, figures, AttemptFigures(p.samples_seen))
    s.figures = None
    checkpointer.prepare(s)  # the first snapshot buffer is made in the background while the first steps run
    stop = preemption.agreed_stop(s.world.size)  # asked during start-up: nothing trained, nothing to save
    while stop is None and not is_complete(p, config.duration):
        unit_over, stop = _epoch(t, epoch_size)
        if unit_over:
            break
    if stop is not None:  # the stop's checkpoint is inside the unit: its resumption goes on from these figures
        s.figures = figures.copy()
    return t.this_attempt.metrics(figures, p.samples_seen), t.this_attempt.steps, stop


def _epoch(t: _Training, epoch_size: int) -> tuple[bool, Stop | None]:
    """Steps to the end of the epoch, the end of the unit (True) or a stop agreed at a step boundary (returned)."""
    s, p = t.s, t.s.progress
    sampler, loader = _loader(t.config, s, epoch_size)
    batches = iter(loader)
    for micro, global_n in sampler.steps():
        loss = _one_step(s, micro, global_n, batches)
        t.figures.add_step(loss, s.ctx.last_grad_norm if s.ctx is not None else None)
        t.this_attempt.step(loss)
        epoch_ended = p.advance(global_n, epoch_size)
        try:
            unit_over = _after_step(t, epoch_ended, global_n, epoch_size)
        except _StopAtStep as stopped:  # the evaluation was cut short; the step it followed stands
            return False, stopped.stop
        if unit_over:
            return True, None
        stop = preemption.agreed_stop(s.world.size)
        if stop is not None:
            return False, stop
    return False, None


def _one_step(s: Session, micro: list[list[int]], global_n: int, batches: Iterator[Any]) -> float:
    """One step, the recipe's own ``train_step`` or ours; returns this process's loss."""
    if s.ctx is not None:
        s.ctx.samples_seen = s.progress.samples_seen
    if s.hooks.on_train_batch is not None:
        s.hooks.on_train_batch([i for ids in micro for i in ids])  # every step, even an empty share
    if s.hooks.train_step is not None:
        return _own_step(s, s.hooks.train_step, next(batches), sum(map(len, micro)), global_n)
    return _step(s, micro, global_n, batches)


def _after_step(t: _Training, epoch_ended: bool, global_n: int, epoch_size: int) -> bool:
    """A step's scalars, an evaluation and a snapshot when due, a line every ``log_every_n_steps``, an injected fault;
    True when the step ends the unit."""
    config, s, p = t.config, t.s, t.s.progress
    every_n, rate = p.step % config.log_every_n_steps == 0, t.this_attempt.rate(p.samples_seen)
    t.log.log(p.step, _step_metrics(s, t.this_attempt.last_loss, rate if every_n else None))
    if config.eval_every is not None and crossed(p, config.eval_every, epoch_ended, global_n):
        t.figures.evaluated = _evaluate(config, s)
        t.log.log(p.step, {f"eval/{k[5:]}": v for k, v in t.figures.evaluated.items() if k != "eval_step"})
    if every_n and s.world.rank == 0:
        logger.info(
            "unit %d: step %d, epoch %d, sample %d/%d, train_loss %.4f, %.0f samples/s",
            t.unit,
            p.step,
            p.epoch,
            p.sample_in_epoch or epoch_size,
            epoch_size,
            t.this_attempt.last_loss,
            rate,
        )
    unit_over = ends_unit(p, config.interval, config.duration, epoch_ended, global_n)
    snapshot_every = config.snapshot_every
    if not unit_over and snapshot_every is not None and crossed(p, snapshot_every, epoch_ended, global_n):
        _snapshot(t)
    if config.inject_fault_at_step == p.step and t.attempt == 1:
        raise InjectedFault(f"injected fault after step {p.step} (inject_fault_at_step={p.step}, attempt 1)")
    return unit_over


def _snapshot(t: _Training) -> None:
    """A snapshot inside the unit (``snapshot_interval``); its manifest records the unit's figures so far."""
    t.log.checkpoint(t.s.progress.step)  # a snapshot may be resumed from: what it covers is logged first
    t.figures.snapshots += 1
    t.s.figures = t.figures.copy()  # in the snapshot's manifest
    stall = t.checkpointer.snapshot(t.s, {"train_loss": t.figures.train_loss, **t.figures.evaluated})
    t.s.figures = None
    if stall is not None:
        t.this_attempt.stalls.append(stall)


def _step_metrics(s: Session, loss: float, rate: float | None) -> dict[str, float]:
    """A step's scalars for TensorBoard and MLflow: this process's loss, the first group's learning rate and, every
    ``log_every_n_steps``, the unit's samples per second so far."""
    lr = s.optimizer.param_groups[0].get("lr") if s.optimizer.param_groups else None
    values = {"train/loss": loss, **({"train/lr": float(lr)} if lr is not None else {})}
    return {**values, "train/samples_per_second": rate} if rate is not None else values


def _total_steps(s: Session) -> int | None:
    """Steps of the whole run (the progress bar's total), when the run context can say."""
    try:
        return s.ctx.total_steps if s.ctx is not None else None
    except Exception:  # a context without the dataset's size
        return None


def _evaluate(config: TrainConfig, s: Session) -> dict[str, float]:
    """Evaluates inside the unit (eval_interval); the metrics, prefixed ``eval_``, go into the checkpoint's
    manifest. Every process evaluates (an FSDP forward needs them all); the training RNG is not touched. A stop
    agreed between two evaluation batches cuts it short (``_StopAtStep``)."""
    assert s.ctx is not None

    def stop_check() -> None:
        stop = preemption.agreed_stop(s.world.size)
        if stop is not None:
            raise _StopAtStep(stop)

    model = s.forward_model or s.model  # evaluated in micro-batches: no more memory than a training pass holds
    metrics = evaluate_model(s.recipe, model, s.device, s.ctx.micro_batch_size, s.ctx, between_batches=stop_check)
    s.model.train()
    out = {f"eval_{k}": v for k, v in metrics.items()}
    attribute = config.checkpoint_score_attribute
    if attribute and attribute.startswith("eval_") and attribute not in out:
        raise ConfigError(
            f"checkpoint_score_attribute={attribute!r}: the recipe's evaluate reports {sorted(out) or 'nothing'}; "
            f"choose one of those"
        )
    out["eval_step"] = float(s.progress.step)
    if s.world.rank == 0:
        logger.info(
            "evaluation at step %d: %s", s.progress.step, ", ".join(f"eval_{k} {v:.4f}" for k, v in metrics.items())
        )
    return out


def _loader(config: TrainConfig, s: Session, epoch_size: int) -> tuple[ResumableBatchSampler, Any]:
    """The sampler from the run's position, and the loader that loads what it yields. With ``num_workers > 0`` the
    loader is made once per session and its worker processes live across units and epochs (a unit boundary costs no
    worker start): only the sampler changes, and the workers' random numbers come from each batch's sample ids, so
    a worker's history (how many units it served, where the run resumed) changes nothing it loads."""
    p = s.progress
    left = samples_left(p, config.duration)
    stop = epoch_size if left is None else min(epoch_size, p.sample_in_epoch + left)
    sampler = ResumableBatchSampler(
        epoch_size,
        config.global_batch_size,
        seed=config.seed,
        epoch=p.epoch,
        start=p.sample_in_epoch,
        stop=stop,
        shuffle=config.shuffle,
        rank=s.world.rank,
        world_size=s.world.size,
        micro_batches=config.grad_accumulation if s.hooks.train_step is None else 1,
        order=getattr(s.dataset, "epoch_order", None),
    )
    # Every loader has a generator of its own: starting an iteration draws a seed from it, and from torch's global
    # generator (the run's own, checkpointed) without one. A stateful stream is read in this process: its workers, if
    # any, are its own (training/position/iterable.py).
    if not loader_workers(s.dataset, config.num_workers):
        return sampler, DataLoader(
            s.dataset,
            batch_sampler=sampler,
            collate_fn=s.hooks.collate_fn,
            pin_memory=s.device.type == "cuda",
            generator=torch.Generator(),
        )
    if s.loader is None:
        remove_orphaned_semaphores_once()  # what earlier SIGKILLed process groups' loaders left in /dev/shm
        # forkserver: workers forked straight from a Prefect process (which runs threads) died at exit.
        s.loader = DataLoader(
            _SeededByBatch(s.dataset, config.seed),
            batch_sampler=_CurrentSampler(),
            num_workers=config.num_workers,
            collate_fn=s.hooks.collate_fn,
            pin_memory=s.device.type == "cuda",
            multiprocessing_context="forkserver",
            persistent_workers=True,
            generator=torch.Generator(),
            worker_init_fn=functools.partial(die_with, os.getpid()),  # a forkserver's child: see lifetimes.py
        )
        s.loader.batch_sampler.current = sampler
        return sampler, _timed_start(s.loader, config.num_workers, s.world.rank == 0)
    s.loader.batch_sampler.current = sampler  # read when the loader's next iteration starts
    return sampler, s.loader


_NONE = object()  # an iterator's end, whatever a batch may be


def _timed_start(loader: Any, workers: int, say: bool) -> Iterator[Any]:
    """The new loader's first iteration, which starts its worker processes: one line says how long they took until
    their first batch (~30 s at load 15 for num_workers=2, paid by the first unit and said nowhere before)."""
    t0 = time.perf_counter()
    batches = iter(loader)
    first = next(batches, _NONE)
    if say:
        logger.info(
            "loader workers started (num_workers=%d) in %.2f s, their first batch included", workers,
            time.perf_counter() - t0,
        )  # fmt: skip
    if first is not _NONE:
        yield first
    yield from batches


class _CurrentSampler:
    """The batch sampler of a loader that outlives units: it yields what the current unit's sampler yields, each
    micro-batch's ids with its epoch (``_SeededByBatch`` seeds from both)."""

    current: Any = None

    def __iter__(self) -> Iterator[Any]:  # (epoch, ids): a "batch" only _SeededByBatch reads
        epoch = self.current.epoch
        return ((epoch, ids) for ids in self.current)

    def __len__(self) -> int:
        return len(self.current)


class _SeededByBatch(torch.utils.data.Dataset):
    """The recipe's dataset as a loader worker sees it: before each batch the worker's random generators (torch,
    random, numpy) are seeded from the run's seed, the epoch and the batch's sample ids
    (training/position/worker_seeds.py), so augmentation draws the same numbers for the same batch whatever the worker
    loaded before (a resumed run's new workers included), and other numbers in another epoch."""

    def __init__(self, dataset: Any, seed: int):
        self.dataset, self.seed = dataset, seed

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, i: int) -> Any:
        return self.dataset[i]

    def __getitems__(self, batch: tuple[int, list[int]]) -> list[Any]:
        epoch, ids = batch  # from _CurrentSampler, whose loader alone reads this dataset
        if torch.utils.data.get_worker_info() is not None:  # never the training process's own generators
            seed_generators(self.seed, epoch, len(ids), ids[0] if ids else -1, ids[-1] if ids else -1)
        many = getattr(self.dataset, "__getitems__", None)
        return list(many(ids)) if many is not None else [self.dataset[i] for i in ids]


def _step(s: Session, micro: list[list[int]], global_n: int, batches: Iterator[Any]) -> float:
    """One optimizer step over this process's micro-batches (``grad_accumulation`` of them), each loaded,
    run and freed in turn. Each backward is weighted by ``world_size * len(micro-batch) / global_n``, so
    the gradient summed over micro-batches and averaged over processes is the global batch's mean; DDP
    syncs gradients only on the last micro-batch. Returns this process's mean loss over its samples."""
    ctx = s.ctx
    assert ctx is not None
    model = s.forward_model or s.model
    s.optimizer.zero_grad(set_to_none=True)
    total, count, last_loss = 0.0, 0, 0.0
    for j, ids in enumerate(micro):
        batch = to_device(next(batches), s.device)
        ctx.batch_weight = s.world.size * len(ids) / global_n
        with _gradient_sync(s, last=j == len(micro) - 1):
            with ctx.autocast():
                loss = s.recipe.loss(model, batch)
            ctx.backward(loss)
        last_loss = float(loss.detach())
        total, count = total + last_loss * len(ids), count + len(ids)
        del batch, loss  # the micro-batch's activations are freed before the next one is loaded
    ctx.step(s.optimizer)
    if s.scheduler is not None:
        s.scheduler.step()
    return total / count if count else last_loss


def _own_step(s: Session, train_step: Any, batch: Any, n: int, global_n: int) -> float:
    """The recipe's ``train_step(ctx, batch)``, with the whole share of the step; the scheduler stays ours."""
    ctx = s.ctx
    assert ctx is not None
    ctx.batch_weight = s.world.size * n / global_n
    loss = train_step(ctx, to_device(batch, s.device))
    if s.scheduler is not None:
        s.scheduler.step()
    return float(loss.detach()) if isinstance(loss, torch.Tensor) else float(loss)


def _gradient_sync(s: Session, last: bool) -> Any:
    """DDP's all-reduce only on the last micro-batch of a step: the others accumulate locally."""
    set_sync = getattr(s.model, "set_requires_gradient_sync", None)  # an FSDP2 module
    if callable(set_sync):
        set_sync(last)
        return contextlib.nullcontext()
    no_sync = getattr(s.forward_model, "no_sync", None)
    return contextlib.nullcontext() if last or not callable(no_sync) else no_sync()
