"""One unit of training, in plain PyTorch: resolve where to start, train to the unit boundary, commit.

Every unit begins by resolving the run's latest good checkpoint, so a Prefect retry, a restarted flow
or a new process elsewhere all resume the same way. The state a unit leaves behind after a successful
commit is kept in memory (``_warm``); the next unit in this process reuses it instead of downloading
the checkpoint it just wrote, but only if that checkpoint is still the run's latest. A failed unit's
state is dropped, never reused.
"""

from __future__ import annotations

import gc
import logging
import time
from dataclasses import dataclass
from typing import Any

import torch
from pydantic import BaseModel
from torch.utils.data import DataLoader

from checkpointing import CheckpointInfo, CheckpointStore, LoadedCheckpoint, Manifest, Writer, open_checkpoint_uri
from checkpointing.manifest import FileEntry
from checkpointing.storage import RetrySettings
from checkpointing.store import STATE_FILE, serialize
from checkpointing.uploader import BackgroundCommitter, commit_and_prune
from training import rng
from training.config import ConfigError, TrainConfig
from training.progress import Progress, ends_unit, is_complete, rescaled, unit_index
from training.recipe import Recipe, load_recipe
from training.sampler import ResumableBatchSampler

logger = logging.getLogger(__name__)
RNG_FILE = "rng-rank0.pt"


class InjectedFault(RuntimeError):
    """Raised by ``inject_fault_at_step``: a deliberate, retryable failure for demos and tests."""


class UnitResult(BaseModel):
    """What a unit reports: small, no tensors."""

    unit: int
    checkpoint: str
    checkpoint_name: str
    progress: dict[str, int]
    complete: bool
    resumed_from: str
    metrics: dict[str, float]
    num_train_samples: int


@dataclass
class _Session:
    """Live objects of a run, clean at checkpoint ``name`` (when kept in ``_warm``)."""

    key: tuple
    recipe: Recipe
    dataset: Any
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: Any
    progress: Progress
    device: torch.device
    rng_state: dict[str, Any] | None = None


_warm: _Session | None = None
_uploader = BackgroundCommitter()


def open_store(config: TrainConfig) -> CheckpointStore:
    retry = RetrySettings(attempts=config.store_retry_attempts, max_seconds=config.store_retry_max_seconds)
    return CheckpointStore(config.save_folder, config.run_name, storage_options=config.storage_options, retry=retry)


def pick_device(config: TrainConfig) -> torch.device:
    if config.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device='cuda': no CUDA device is visible; use device='auto' or 'cpu'")
    use_cuda = config.device == "cuda" or (config.device == "auto" and torch.cuda.is_available())
    return torch.device("cuda" if use_cuda else "cpu")


def run_unit(config: TrainConfig, *, start_checkpoint: str | None = None, attempt: int = 1,
             generation: int = 0, log: logging.Logger | logging.LoggerAdapter = logger) -> UnitResult:
    """Trains one unit and commits its checkpoint. ``start_checkpoint`` is where the flow began
    (data-skip options apply only when resuming from it); ``generation`` fences stale writers."""
    global _warm
    store = open_store(config)
    session, origin = _take_warm(config, store, start_checkpoint)
    if session is None:
        _uploader.wait_quietly()  # a cold resume must see what the previous unit committed
        session, origin = _restore(config, store, start_checkpoint, log)
    unit = unit_index(session.progress, config.interval)
    log.info("unit %d (attempt %d): starting from %s at epoch %d, step %d, %d samples seen",
             unit, attempt, origin, session.progress.epoch, session.progress.step, session.progress.samples_seen)
    try:
        metrics = _train(config, session, unit, attempt, log)
        info = _save(config, store, session, metrics, generation)
        if is_complete(session.progress, config.duration):
            _uploader.wait()  # the run is done only when its last checkpoint is committed
    except BaseException:
        _release(session)  # a failed attempt's state must not leak into the retry
        raise
    session.key = _warm_key(config, store, info.name)
    _warm = session
    p = session.progress
    how = "handed to the background upload after" if info.manifest.files and not next(
        iter(info.manifest.files.values())).sha256 else "committed in"
    log.info("unit %d done: loss %.4f, %.0f samples/s, checkpoint %s (%.1f MB) %s %.2fs; "
             "epoch %d, step %d, %d samples seen", unit, metrics["loss"], metrics["samples_per_second"],
             info.name, info.size_bytes / 1e6, how, metrics["checkpoint_seconds"], p.epoch, p.step, p.samples_seen)
    return UnitResult(unit=unit, checkpoint=info.uri, checkpoint_name=info.name, progress=p.as_dict(),
                      complete=is_complete(p, config.duration), resumed_from=origin, metrics=metrics,
                      num_train_samples=len(session.dataset))


def forget_warm_state() -> None:
    """Drops the in-memory state (tests use it to force a resume from the store)."""
    global _warm
    if _warm is not None:
        _release(_warm)


# -- restore --------------------------------------------------------------------------------------
def _warm_key(config: TrainConfig, store: CheckpointStore, name: str) -> tuple:
    return (store.uri, name, config.fingerprint(), config.global_batch_size, str(pick_device(config)))


def _take_warm(config: TrainConfig, store: CheckpointStore, start_checkpoint: str | None):
    global _warm
    session, _warm = _warm, None
    if session is None:
        return None, ""
    in_flight = _uploader.pending_store_uri == store.uri and _uploader.pending_name
    latest = (store.latest() or None) if not in_flight else None
    if in_flight and session.key == _warm_key(config, store, in_flight):
        rng.restore(session.rng_state)
        return session, f"checkpoint {in_flight} (in memory; its upload is in flight)"
    skip_applies = latest is not None and latest.name == start_checkpoint and (
        config.ignore_data_skip or config.data_skip_steps is not None)
    if latest is not None and not skip_applies and session.key == _warm_key(config, store, latest.name):
        rng.restore(session.rng_state)
        return session, f"checkpoint {latest.name} (in memory, not downloaded)"
    _release(session)
    return None, ""


def _restore(config: TrainConfig, store: CheckpointStore, start_checkpoint: str | None, log) -> tuple[_Session, str]:
    recipe = load_recipe(config)
    dataset = recipe.train_dataset()
    device = pick_device(config)
    rng.seed_all(config.seed)
    model = recipe.build_model().to(device)
    optimizer = recipe.build_optimizer(model)
    build_scheduler = getattr(recipe, "build_scheduler", None)
    scheduler = build_scheduler(optimizer) if build_scheduler else None
    session = _Session(None, recipe, dataset, model, optimizer, scheduler,
                       Progress(global_batch_size=config.global_batch_size), device)
    loaded = store.load_latest()
    if loaded is not None:
        _apply(session, loaded, weights_only=False)
        _reposition(config, session, applies_skip=loaded.info.name == start_checkpoint, log=log)
        return session, f"checkpoint {loaded.info.name}"
    if config.load_path:
        loaded = open_checkpoint_uri(config.load_path, storage_options=config.storage_options,
                                     files=[STATE_FILE] if config.load_weights_only else None)
        _apply(session, loaded, weights_only=config.load_weights_only)
        what = "weights" if config.load_weights_only else "state"
        if not config.load_weights_only:
            _reposition(config, session, applies_skip=True, log=log)
        return session, f"{what} of {loaded.info.uri} (load_path)"
    return session, "fresh initialization"


def _apply(session: _Session, loaded: LoadedCheckpoint, weights_only: bool) -> None:
    state = loaded.objects[STATE_FILE]
    session.model.load_state_dict(state["state"]["model"])
    if weights_only:
        return
    session.optimizer.load_state_dict(state["state"]["optimizer"])
    if session.scheduler is not None and state["state"].get("scheduler") is not None:
        session.scheduler.load_state_dict(state["state"]["scheduler"])
    session.progress = Progress.from_dict(loaded.info.progress)
    if RNG_FILE in loaded.objects:
        rng.restore(loaded.objects[RNG_FILE])


def _reposition(config: TrainConfig, session: _Session, applies_skip: bool, log) -> None:
    """Carries the data position over to this run's global batch size and data-skip options."""
    p, new = session.progress, config.global_batch_size
    epoch_size = len(session.dataset)
    if p.global_batch_size and p.global_batch_size != new:
        old_step, old_size = p.step, p.global_batch_size
        session.progress = p = rescaled(p, new)
        _continue_schedule(session.scheduler, p.step)
        log.info("global_batch_size changed %d -> %d: %d samples already trained; epoch %d resumes at sample "
                 "%d of %d (nothing repeated or dropped); the step counter, LR schedule and '<n>ba' durations "
                 "continue at step %d = %d // %d (was step %d)", old_size, new, p.samples_seen,
                 p.epoch, p.sample_in_epoch, epoch_size, p.step, p.samples_seen, new, old_step)
    p.global_batch_size = new
    if not applies_skip:
        return
    if config.ignore_data_skip and p.sample_in_epoch:
        log.info("ignore_data_skip: epoch %d restarts from its first sample (was at sample %d)",
                 p.epoch, p.sample_in_epoch)
        p.sample_in_epoch = 0
    elif config.data_skip_steps is not None:
        target = min(config.data_skip_steps * new, epoch_size)
        log.info("data_skip_steps=%d: epoch %d resumes at sample %d (= %d batches of %d; was sample %d)",
                 config.data_skip_steps, p.epoch, target, config.data_skip_steps, new, p.sample_in_epoch)
        p.sample_in_epoch = target


def _continue_schedule(scheduler: Any, step: int) -> None:
    """Moves a step-based LR schedule to ``step`` (after a batch-size change renumbered steps)."""
    if scheduler is None:
        return
    scheduler.last_epoch = step
    closed_form = getattr(scheduler, "_get_closed_form_lr", None)
    if closed_form is None and isinstance(scheduler, torch.optim.lr_scheduler.LambdaLR):
        closed_form = lambda: [base * fn(step) for base, fn in zip(scheduler.base_lrs, scheduler.lr_lambdas)]  # noqa: E731
    if closed_form is not None:
        lrs = closed_form()
        for group, lr in zip(scheduler.optimizer.param_groups, lrs):
            group["lr"] = lr
        scheduler._last_lr = list(lrs)


# -- train ----------------------------------------------------------------------------------------
def _train(config: TrainConfig, s: _Session, unit: int, attempt: int, log) -> dict[str, float]:
    p, epoch_size = s.progress, len(s.dataset)
    s.model.train()
    losses, start_samples, t0 = [], p.samples_seen, time.perf_counter()
    while not is_complete(p, config.duration):
        loader = _loader(config, s, epoch_size)
        unit_over = False
        for batch in loader:
            losses.append(_step(s, batch))
            num = min(config.global_batch_size, epoch_size - p.sample_in_epoch)
            epoch_ended = p.advance(num, epoch_size)
            if p.step % config.log_every_n_steps == 0:
                rate = (p.samples_seen - start_samples) / max(time.perf_counter() - t0, 1e-9)
                log.info("unit %d: step %d, epoch %d, sample %d/%d, loss %.4f, %.0f samples/s", unit, p.step,
                         p.epoch, p.sample_in_epoch or epoch_size, epoch_size, losses[-1], rate)
            if config.inject_fault_at_step == p.step and attempt == 1:
                raise InjectedFault(f"injected fault after step {p.step} (inject_fault_at_step={p.step}, attempt 1)")
            if ends_unit(p, config.interval, config.duration, epoch_ended):
                unit_over = True
                break
        if unit_over:
            break
    seconds = time.perf_counter() - t0
    trained = p.samples_seen - start_samples
    return {"loss": sum(losses) / max(len(losses), 1), "samples": float(trained), "steps": float(len(losses)),
            "train_seconds": seconds, "samples_per_second": trained / max(seconds, 1e-9)}


def _loader(config: TrainConfig, s: _Session, epoch_size: int) -> DataLoader:
    p = s.progress
    sampler = ResumableBatchSampler(epoch_size, config.global_batch_size, seed=config.seed, epoch=p.epoch,
                                    start=p.sample_in_epoch, shuffle=config.shuffle)
    # The loader's own generator (worker seeds) is derived from the position, not from global RNG.
    generator = torch.Generator().manual_seed(hash((config.seed, p.epoch, p.sample_in_epoch)) % (2**63))
    return DataLoader(s.dataset, batch_sampler=sampler, num_workers=config.num_workers, generator=generator,
                      collate_fn=getattr(s.recipe, "collate_fn", None), pin_memory=s.device.type == "cuda",
                      persistent_workers=False, multiprocessing_context="forkserver" if config.num_workers else None)


def _step(s: _Session, batch: Any) -> float:
    batch = to_device(batch, s.device)
    s.optimizer.zero_grad(set_to_none=True)
    loss = s.recipe.loss(s.model, batch)
    loss.backward()
    s.optimizer.step()
    if s.scheduler is not None:
        s.scheduler.step()
    return float(loss.detach())


def to_device(batch: Any, device: torch.device) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, dict):
        return {k: to_device(v, device) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(to_device(v, device) for v in batch)
    return batch


# -- save -----------------------------------------------------------------------------------------
def _save(config: TrainConfig, store: CheckpointStore, s: _Session, metrics: dict[str, float], generation: int):
    p = s.progress
    s.rng_state = rng.capture()
    state = {"state": {"model": s.model.state_dict(), "optimizer": s.optimizer.state_dict(),
                       "scheduler": s.scheduler.state_dict() if s.scheduler is not None else None},
             "progress": p.as_dict()}
    metadata = {"config_fingerprint": config.fingerprint(), "recipe": config.recipe,
                "global_batch_size": config.global_batch_size, "world_size": 1, "seed": config.seed,
                "metrics": {k: float(v) for k, v in metrics.items()}}
    name = f"ep{p.epoch}-ba{p.step}-sa{p.samples_seen}"
    t0 = time.perf_counter()
    blobs = serialize({STATE_FILE: state, RNG_FILE: s.rng_state})
    args = dict(progress=p.as_dict(), metadata=metadata, writer=Writer.current(generation),
                keep=config.num_checkpoints_to_keep)
    if use_async_upload(config, store):
        _uploader.submit(store, name, blobs, **args)  # waits for the previous upload first
        # Provisional: sizes only. The committer hashes the bytes off the training thread.
        manifest = Manifest(name=name, files={f: FileEntry(len(b), "") for f, b in blobs.items()}, progress=p.as_dict(),
                            metadata=metadata, writer=args["writer"])
        info = CheckpointInfo(name=name, uri=store.storage.uri(f"checkpoints/{name}"), manifest=manifest)
    else:
        info = commit_and_prune(store, name, blobs, **args)
    metrics["checkpoint_seconds"] = time.perf_counter() - t0  # the stall training sees
    return info


def use_async_upload(config: TrainConfig, store: CheckpointStore) -> bool:
    if config.async_upload is not None:
        return config.async_upload
    return not (store.storage.is_local or store.storage.protocol == "memory")


def _release(session: _Session) -> None:
    global _warm
    if _warm is session:
        _warm = None
    session.model = session.optimizer = session.scheduler = None  # type: ignore[assignment]
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
