"""A run's live objects: built, restored from the store, saved back, and kept warm between units.

Restore order (Composer's autoresume, made safe): the run's latest good checkpoint, else ``load_path``
(optionally weights only), else a fresh seeded initialization. The state a unit leaves behind after a
successful commit is kept in memory (``_warm``); the next unit in this process reuses it instead of
downloading the checkpoint it just wrote, but only while that checkpoint is still the run's latest (or
is its own upload in flight). A failed unit's state is dropped, never reused.
"""

from __future__ import annotations

import gc
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from checkpointing import CheckpointInfo, CheckpointStore, LoadedCheckpoint, Manifest, Writer, open_checkpoint_uri
from checkpointing.manifest import FileEntry
from checkpointing.storage import RetrySettings
from checkpointing.store import STATE_FILE, serialize
from checkpointing.uploader import BackgroundCommitter, commit_and_prune
from training import rng
from training.config import ConfigError, TrainConfig
from training.progress import Progress, rescaled
from training.recipe import Recipe, load_recipe
from training.warm_start import load_weights

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class World:
    """This process's place among the processes that train one unit together."""

    rank: int = 0
    size: int = 1
    local_rank: int = 0

    @property
    def rng_file(self) -> str:
        return rng_file(self.rank)


SINGLE_PROCESS = World()


def rng_file(rank: int) -> str:
    return f"rng-rank{rank}.pt"


@dataclass
class Session:
    """Live objects of a run, clean at checkpoint ``key[1]`` while kept in ``_warm``."""

    recipe: Recipe
    dataset: Any
    model: torch.nn.Module  # the module itself (its state_dict is what is saved)
    optimizer: torch.optim.Optimizer
    scheduler: Any
    progress: Progress
    device: torch.device
    world: World = field(default_factory=World)
    forward_model: torch.nn.Module | None = None  # DDP wrapper when world.size > 1
    key: tuple = ()
    rng_state: dict[str, Any] | None = None


_warm: Session | None = None
uploader = BackgroundCommitter()


def open_store(config: TrainConfig) -> CheckpointStore:
    retry = RetrySettings(attempts=config.store_retry_attempts, max_seconds=config.store_retry_max_seconds)
    return CheckpointStore(config.save_folder, config.run_name, storage_options=config.storage_options, retry=retry)


def pick_device(config: TrainConfig, world: World = SINGLE_PROCESS) -> torch.device:
    if config.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device='cuda': no CUDA device is visible; use device='auto' or 'cpu'")
    if config.device == "cuda" or (config.device == "auto" and torch.cuda.is_available()):
        return torch.device("cuda", world.local_rank % torch.cuda.device_count())
    return torch.device("cpu")


# -- warm state -----------------------------------------------------------------------------------
def warm_key(config: TrainConfig, store: CheckpointStore, name: str) -> tuple:
    return (store.uri, name, config.fingerprint(), config.global_batch_size, str(pick_device(config)))


def warm_session(config: TrainConfig, store: CheckpointStore, name: str) -> Session | None:
    """The in-memory session if it is clean at checkpoint ``name`` of this run and config."""
    return _warm if _warm is not None and _warm.key == warm_key(config, store, name) else None


def take_warm(config: TrainConfig, store: CheckpointStore, start_checkpoint: str | None) -> tuple[Session | None, str]:
    """Takes the in-memory session out for a unit, if it is still the run's latest state."""
    global _warm
    session, _warm = _warm, None
    if session is None:
        return None, ""
    in_flight = uploader.pending_name if uploader.pending_store_uri == store.uri else None
    if in_flight and session.key == warm_key(config, store, in_flight):
        rng.restore(session.rng_state)
        return session, f"checkpoint {in_flight} (in memory; its upload is in flight)"
    latest = None if in_flight else store.latest()
    skip_applies = (
        latest is not None
        and latest.name == start_checkpoint
        and (config.ignore_data_skip or config.data_skip_steps is not None)
    )
    if latest is not None and not skip_applies and session.key == warm_key(config, store, latest.name):
        rng.restore(session.rng_state)
        return session, f"checkpoint {latest.name} (in memory, not downloaded)"
    release(session)
    return None, ""


def keep_warm(config: TrainConfig, store: CheckpointStore, session: Session, name: str) -> None:
    global _warm
    session.key = warm_key(config, store, name)
    _warm = session


def release(session: Session) -> None:
    """Drops a session's objects so that nothing of a failed attempt survives into a retry."""
    global _warm
    if _warm is session:
        _warm = None
    session.model = session.optimizer = session.scheduler = session.forward_model = None  # type: ignore[assignment]
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def forget_warm_state() -> None:
    """Drops the in-memory state (tests use it to force a resume from the store)."""
    if _warm is not None:
        release(_warm)


# -- restore --------------------------------------------------------------------------------------
def restore(
    config: TrainConfig, store: CheckpointStore, start_checkpoint: str | None, log, world: World = SINGLE_PROCESS
) -> tuple[Session, str]:
    """Builds the recipe's objects and loads the run's latest good checkpoint, load_path, or nothing."""
    recipe = load_recipe(config)
    dataset = recipe.train_dataset()
    device = pick_device(config, world)
    rng.seed_all(config.seed)
    model = recipe.build_model().to(device)
    optimizer = recipe.build_optimizer(model)
    build_scheduler = getattr(recipe, "build_scheduler", None)
    scheduler = build_scheduler(optimizer) if build_scheduler else None
    session = Session(
        recipe,
        dataset,
        model,
        optimizer,
        scheduler,
        Progress(global_batch_size=config.global_batch_size),
        device,
        world,
    )
    origin = _load_into(config, store, session, start_checkpoint, log)
    if world.size > 1:
        from torch.nn.parallel import DistributedDataParallel

        ids = [device.index] if device.type == "cuda" else None
        session.forward_model = DistributedDataParallel(model, device_ids=ids)
    return session, origin


def _load_into(config: TrainConfig, store: CheckpointStore, session: Session, start_checkpoint: str | None, log) -> str:
    files = [STATE_FILE, session.world.rng_file]
    loaded = store.load_latest(files)
    if loaded is not None:
        _apply(session, loaded, weights_only=False, log=log)
        _reposition(config, session, applies_skip=loaded.info.name == start_checkpoint, log=log)
        return f"checkpoint {loaded.info.name}"
    if config.load_path:
        origin = load_weights(config, session.model, log)  # a weights file, or a folder's weights only
        if origin is not None:
            return origin
        loaded = open_checkpoint_uri(
            config.load_path,
            storage_options=config.storage_options,
            files=[STATE_FILE] if config.load_weights_only else files,
        )
        _apply(session, loaded, weights_only=config.load_weights_only, log=log)
        if not config.load_weights_only:
            _reposition(config, session, applies_skip=True, log=log)
        what = "weights" if config.load_weights_only else "state"
        return f"{what} of {loaded.info.uri} (load_path)"
    if session.world.size > 1:
        rng.seed_all(config.seed + session.world.rank)  # same initial weights everywhere, own RNG streams after
    return "fresh initialization"


def _apply(session: Session, loaded: LoadedCheckpoint, weights_only: bool, log) -> None:
    state = loaded.objects[STATE_FILE]
    session.model.load_state_dict(state["state"]["model"])
    if weights_only:
        return
    session.optimizer.load_state_dict(state["state"]["optimizer"])
    if session.scheduler is not None and state["state"].get("scheduler") is not None:
        session.scheduler.load_state_dict(state["state"]["scheduler"])
    session.progress = Progress.from_dict(loaded.info.progress)
    rank = session.world.rank
    if rng_file(rank) in loaded.objects:
        rng.restore(loaded.objects[rng_file(rank)])
    else:  # the world grew: this rank has no saved stream; derive one from the position
        rng.seed_all(loaded.info.progress.get("samples_seen", 0) * 1000 + rank)
        log.info(
            "rank %d: %s has no RNG state for this rank (saved with world size %s); seeded a new stream",
            rank,
            loaded.info.name,
            loaded.info.manifest.metadata.get("world_size"),
        )


def _reposition(config: TrainConfig, session: Session, applies_skip: bool, log) -> None:
    """Carries the data position over to this run's global batch size and data-skip options."""
    p, new = session.progress, config.global_batch_size
    epoch_size = len(session.dataset)
    if p.global_batch_size and p.global_batch_size != new:
        old_step, old_size = p.step, p.global_batch_size
        session.progress = p = rescaled(p, new)
        if not _continue_schedule(session.scheduler, p.step):
            log.warning(
                "%s has no closed form: its step counter now reads %d, but its learning rate continues "
                "from where it was",
                type(session.scheduler).__name__,
                p.step,
            )
        log.info(
            "global_batch_size changed %d -> %d: %d samples already trained; epoch %d resumes at sample "
            "%d of %d (nothing repeated or dropped); the step counter, LR schedule and '<n>ba' durations "
            "continue at step %d = %d // %d (was step %d)",
            old_size,
            new,
            p.samples_seen,
            p.epoch,
            p.sample_in_epoch,
            epoch_size,
            p.step,
            p.samples_seen,
            new,
            old_step,
        )
    p.global_batch_size = new
    if not applies_skip:
        return
    if config.ignore_data_skip and p.sample_in_epoch:
        log.info(
            "ignore_data_skip: epoch %d restarts from its first sample (was at sample %d)", p.epoch, p.sample_in_epoch
        )
        p.sample_in_epoch = 0
    elif config.data_skip_steps is not None:
        target = min(config.data_skip_steps * new, epoch_size)
        log.info(
            "data_skip_steps=%d: epoch %d resumes at sample %d (= %d batches of %d; was sample %d)",
            config.data_skip_steps,
            p.epoch,
            target,
            config.data_skip_steps,
            new,
            p.sample_in_epoch,
        )
        p.sample_in_epoch = target


def _continue_schedule(scheduler: Any, step: int) -> bool:
    """Moves a step-based LR schedule to ``step`` (after a batch-size change renumbered steps).
    False when only the counter could be moved (a chainable scheduler without a closed form)."""
    if scheduler is None:
        return True
    scheduler.last_epoch = step
    closed_form = getattr(scheduler, "_get_closed_form_lr", None)
    if closed_form is None and isinstance(scheduler, torch.optim.lr_scheduler.LambdaLR):

        def closed_form() -> list[float]:
            return [base * fn(step) for base, fn in zip(scheduler.base_lrs, scheduler.lr_lambdas, strict=True)]

    if closed_form is not None:
        lrs = closed_form()
        for group, lr in zip(scheduler.optimizer.param_groups, lrs, strict=True):
            group["lr"] = lr
        scheduler._last_lr = list(lrs)
    return closed_form is not None


# -- save -----------------------------------------------------------------------------------------
def save(
    config: TrainConfig,
    store: CheckpointStore,
    s: Session,
    metrics: dict[str, float],
    generation: int,
    rng_states: list[dict[str, Any]] | None = None,
) -> CheckpointInfo:
    """Serializes the session (the only stall) and commits it, in the background when async upload is on.

    ``rng_states`` holds every rank's RNG state (gathered by rank 0) when several processes train."""
    p = s.progress
    s.rng_state = rng.capture()
    state = {
        "state": {
            "model": s.model.state_dict(),
            "optimizer": s.optimizer.state_dict(),
            "scheduler": s.scheduler.state_dict() if s.scheduler is not None else None,
        },
        "progress": p.as_dict(),
    }
    metadata = {
        "config_fingerprint": config.fingerprint(),
        "recipe": config.recipe,
        "global_batch_size": config.global_batch_size,
        "world_size": s.world.size,
        "seed": config.seed,
        "metrics": {k: float(v) for k, v in metrics.items()},
    }
    name = f"ep{p.epoch}-ba{p.step}-sa{p.samples_seen}"
    t0 = time.perf_counter()
    objects = {STATE_FILE: state}
    objects.update({rng_file(r): st for r, st in enumerate(rng_states or [s.rng_state])})
    blobs = serialize(objects)
    score = (
        (config.checkpoint_score_attribute, config.checkpoint_score_order)
        if config.checkpoint_score_attribute
        else None
    )
    args = dict(
        progress=p.as_dict(),
        metadata=metadata,
        writer=Writer.current(generation),
        keep=config.num_checkpoints_to_keep,
        score=score,
    )
    if use_async_upload(config, store) and s.world.size == 1:
        uploader.submit(store, name, blobs, **args)  # waits for the previous upload first
        # Provisional: sizes only. The committer hashes the bytes off the training thread.
        manifest = Manifest(
            name=name,
            files={f: FileEntry(len(b), "") for f, b in blobs.items()},
            progress=p.as_dict(),
            metadata=metadata,
            writer=args["writer"],
        )
        info = CheckpointInfo(name=name, uri=store.storage.uri(f"checkpoints/{name}"), manifest=manifest)
    else:
        info = commit_and_prune(store, name, blobs, **args)
    metrics["checkpoint_seconds"] = time.perf_counter() - t0  # the stall training sees
    return info


def use_async_upload(config: TrainConfig, store: CheckpointStore) -> bool:
    """Async upload overlaps the next unit's training; it needs the next unit in this same process."""
    if config.async_upload is not None:
        return config.async_upload
    return not (store.storage.is_local or store.storage.protocol == "memory")
