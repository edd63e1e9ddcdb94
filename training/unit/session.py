"""A run's live objects: built and restored from the store (``training.unit.checkpointer`` saves them back).

Restore order (Composer's autoresume, made safe): the run's newest good checkpoint, else ``load_path``
(optionally weights only), else a fresh seeded initialization. What outlives one unit in a process (the
warm session and the background committer) is kept by ``training.unit.warm.SessionCache``, not here.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from checkpointing import CheckpointStore, LoadedCheckpoint
from checkpointing.commit.agent import AGENT_LABEL
from checkpointing.store import STATE_FILE, CheckpointInfo
from training.config import ConfigError, TrainConfig
from training.position.iterable import StatefulIterable, prepare_stream
from training.position.progress import Progress, rescaled
from training.recipe.context import RunContext
from training.recipe.hooks import Hooks
from training.recipe.loader import Recipe, load_recipe, open_dataset
from training.start import carry_over
from training.start.host_memory import newest_snapshot, sharded_snapshot
from training.start.identity import check_same_run, requested_data_skip, same_data_skip
from training.start.load_path import read_checkpoint
from training.start.warm_start import load_start, load_weights
from training.unit import rng
from training.unit.figures import UNIT_SO_FAR, UnitFigures
from training.unit.state import SMALL, TrainState
from training.world import SINGLE_PROCESS, World, rng_file

logger = logging.getLogger(__name__)


# "store" (downloaded), "memory" (this process's warm state), "host" (a snapshot in this machine's shared memory, newer
# than the store's), "load_path" (another run or a weights file), "fresh"
OriginKind = Literal["store", "memory", "host", "load_path", "fresh"]


@dataclass(frozen=True)
class Origin:
    """Where a unit's state came from: ``kind`` is what code decides on, ``text`` what people read."""

    kind: OriginKind
    checkpoint: str | None = None
    text: str = "fresh initialization"


@dataclass
class Session:
    """Live objects of a run."""

    recipe: Recipe
    dataset: Any
    model: torch.nn.Module  # the module itself (its state_dict is what is saved)
    optimizer: torch.optim.Optimizer
    scheduler: Any
    progress: Progress
    device: torch.device
    world: World = field(default_factory=World)
    forward_model: torch.nn.Module | None = None  # DDP wrapper when world.size > 1
    ctx: RunContext | None = None  # what the recipe sees as recipe.ctx; the loop fills its step fields
    scaler: Any = None  # fp16's GradScaler
    rng_state: dict[str, Any] | None = None
    data_skip_applied: dict[str, Any] | None = None  # the data-skip options already applied to this run
    hooks: Hooks = field(default_factory=Hooks)
    loader: Any = None  # with num_workers > 0: one DataLoader whose worker processes live across units
    # The unit's figures so far when the state is inside a unit (a snapshot's or a stop's checkpoint): the resumed unit
    # reports its loss and samples over the whole unit, as an uninterrupted one does (training/unit/figures.py).
    figures: UnitFigures | None = None

    @property
    def unit_so_far(self) -> dict[str, Any] | None:
        """What a checkpoint taken now records of the unit's figures (manifest metadata ``UNIT_SO_FAR``)."""
        return self.figures.record() if self.figures is not None else None

    @property
    def state(self) -> TrainState:
        """The stateful parts, one bundle: what ``save`` writes is what ``restore`` reads."""
        return TrainState(self.model, self.optimizer, self.scheduler, self.scaler, self.hooks)


def pick_device(config: TrainConfig, world: World = SINGLE_PROCESS) -> torch.device:
    if config.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device='cuda': no CUDA device is visible; use device='auto' or 'cpu'")
    if config.device == "cuda" or (config.device == "auto" and torch.cuda.is_available()):
        return torch.device("cuda", world.local_rank % torch.cuda.device_count())
    return torch.device("cpu")


# -- restore --------------------------------------------------------------------------------------
def restore(config: TrainConfig, store: CheckpointStore, world: World = SINGLE_PROCESS) -> tuple[Session, Origin]:
    """Builds the recipe's objects and loads the run's newest good checkpoint, load_path, or nothing."""
    device = pick_device(config, world)
    ctx = RunContext.of(config, rank=world.rank, world_size=world.size, local_rank=world.local_rank, device=device)
    recipe = load_recipe(config, ctx)
    hooks = Hooks.of(recipe)
    dataset = open_dataset(recipe)
    prepare_stream(dataset, config, world.rank, world.size)  # and with num_workers > 0, the workers that read it
    rng.seed_all(config.seed)
    if config.parallelism == "fsdp":
        return _restore_sharded(config, store, world, recipe, dataset, ctx)
    model = recipe.build_model().to(device)
    optimizer = recipe.build_optimizer(model)
    scheduler = hooks.build_scheduler(optimizer) if hooks.build_scheduler else None
    progress = Progress(global_batch_size=config.global_batch_size)
    session = Session(recipe, dataset, model, optimizer, scheduler, progress, device, world, ctx=ctx, hooks=hooks)
    session.scaler = torch.amp.GradScaler(device.type) if config.precision == "fp16" else None
    origin = _load_into(config, store, session)
    if world.size > 1:
        from torch.nn.parallel import DistributedDataParallel

        ids = [device.index] if device.type == "cuda" else None
        session.forward_model = DistributedDataParallel(model, device_ids=ids)
    ctx.model, ctx.optimizer, ctx.scaler = session.forward_model or model, optimizer, session.scaler
    return session, origin


def _restore_sharded(
    config: TrainConfig, store: CheckpointStore, world: World, recipe: Any, dataset: Any, ctx: RunContext
) -> tuple[Session, Origin]:
    """parallelism='fsdp': the model is sharded with FSDP2 before its optimizer is built, and checkpoints
    are DCP shards that every rank reads (only what its shards need) and writes in parallel."""
    from training.unit import fsdp

    hooks = Hooks.of(recipe)
    model = recipe.build_model()
    origin = Origin("fresh")
    if store.latest() is None and config.load_path:  # weights go into the whole model, before it is sharded
        weights_from = load_weights(config, model)
        if weights_from is None:
            raise ConfigError(
                f"load_path={config.load_path!r}: with parallelism='fsdp' a new run takes weights only; set "
                f"load_weights_only=True"
            )
        origin = Origin("load_path", None, weights_from)
    fsdp.shard_model(model, ctx.device)
    optimizer = recipe.build_optimizer(model)
    scheduler = hooks.build_scheduler(optimizer) if hooks.build_scheduler else None
    progress = Progress(global_batch_size=config.global_batch_size)
    session = Session(recipe, dataset, model, optimizer, scheduler, progress, ctx.device, world, ctx=ctx, hooks=hooks)
    session.scaler = _sharded_scaler() if config.precision == "fp16" else None
    ctx.model, ctx.optimizer, ctx.scaler = model, optimizer, session.scaler
    in_memory = sharded_snapshot(config, store, world.rank, world.size)
    if in_memory is not None:
        check_same_run(config, in_memory.info)
        fsdp.load_local_shards(model, optimizer, in_memory.objects[fsdp.SHARDS_FILE])
        found: Any = (
            in_memory.info,
            fsdp.LoadedExtra(
                common=in_memory.objects[fsdp.EXTRA_FILE], rank=in_memory.objects.get(fsdp.rank_extra_file(world.rank))
            ),
        )
    else:
        found = fsdp.restore_latest(store, model, optimizer)
    if found is None:
        rng.seed_all(config.seed + world.rank)  # same initial weights everywhere, own RNG streams after
        session.data_skip_applied = requested_data_skip(config)
        return session, origin
    info, extra = found
    check_same_run(config, info)
    session.state.load_state_dict(extra.common, SMALL)
    session.progress = Progress.from_dict(info.progress)
    session.data_skip_applied = info.manifest.metadata.get("data_skip_applied")
    _restore_rng(session, extra.rank, info)
    reposition(config, session)
    if in_memory is not None:
        return session, Origin("host", info.name, f"snapshot {info.name} in this machine's memory")
    if world.rank == 0:
        logger.info(
            "resharded %s (saved by %s process(es)) onto %d; this rank read %d file(s)",
            info.name,
            info.manifest.metadata.get("world_size"),
            world.size,
            len(extra.files_read),
        )
    return session, Origin("store", info.name, f"checkpoint {info.name}")


def _by_agent(info: CheckpointInfo) -> str:
    """What the unit's first line adds when the checkpoint agent committed it (checkpointing/commit/agent.py): the
    agent's own line went where the dead trainer's output went, which a relaunch elsewhere does not see."""
    label = info.manifest.writer.label
    return f" (committed by the {label}, after that process died)" if label.startswith(AGENT_LABEL) else ""


def _sharded_scaler() -> Any:
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    return ShardedGradScaler()  # agrees on inf/nan across ranks: each holds only its shards' gradients


def _load_into(config: TrainConfig, store: CheckpointStore, session: Session) -> Origin:
    files = [STATE_FILE, session.world.rng_file]
    _refuse_sharded(store)
    in_memory = newest_snapshot(config, store, session.world.rank, session.world.size)
    loaded = in_memory or store.load_latest(files)
    if loaded is not None:
        check_same_run(config, loaded.info)
        fix = (
            f"the recipe builds another model or optimizer than the one that wrote it; to train this one, start a "
            f"new run from its weights: load_path={loaded.info.uri!r} load_weights_only=true load_strict=false"
        )
        _apply(session, loaded, fix)
        _restore_stream(config, session, loaded)
        session.figures = UnitFigures.from_record(loaded.info.manifest.metadata.get(UNIT_SO_FAR))
        reposition(config, session)
        if in_memory is not None:
            return Origin("host", loaded.info.name, f"snapshot {loaded.info.name} in this machine's memory")
        return Origin("store", loaded.info.name, f"checkpoint {loaded.info.name}{_by_agent(loaded.info)}")
    if config.load_path:
        return _start_from_load_path(config, session, files)
    if session.world.size > 1:
        rng.seed_all(config.seed + session.world.rank)  # same initial weights everywhere, own RNG streams after
    session.data_skip_applied = requested_data_skip(config)  # nothing to skip at the start of a run
    return Origin("fresh")


def _start_from_load_path(config: TrainConfig, session: Session, files: list[str]) -> Origin:
    """A new run from ``load_path``: weights only, or (load_weights_only=false) a full checkpoint, ours or a peer's,
    whose state and progress are carried under this run's hyper-parameters and LR schedule (training/start/carry_over.py)."""
    this_run = carry_over.ThisRun.of(session.optimizer, session.scheduler)  # as the recipe built them, before any load
    start = load_start(config, session.model, session.optimizer)  # weights loaded; None: our folder's full state
    if start is not None and start.weights_only:
        session.data_skip_applied = requested_data_skip(config)  # a new run: nothing to skip
        return Origin("load_path", None, start.origin)
    if start is None:
        loaded = read_checkpoint(config, files)
        fix = "check recipe and recipe_args, or take the weights that fit: load_weights_only=true load_strict=false"
        _apply(session, loaded, fix, what=f"load_path={config.load_path!r} ({loaded.info.name})")
        text, carried_optimizer = f"state of {loaded.info.uri} (load_path)", True
    else:
        session.state.load_state_dict(start.state, list(start.state))  # checked to fit by load_start
        if start.progress:
            session.progress, note = carry_over.peer_progress(start.progress, len(session.dataset))
            if note:
                logger.info("load_path: progress: %s", note)
        text, carried_optimizer = start.origin, "optimizer" in start.state
    changes = this_run.restore(session.optimizer, session.scheduler)
    if carried_optimizer:
        carry_over.log_hyperparameters(changes)
    carried = start is None or bool(start.progress)
    session.data_skip_applied = None if carried else requested_data_skip(config)  # another run's record: none yet
    reposition(config, session)
    if session.scheduler is not None:
        exact = carry_over.continue_schedule(session.scheduler, session.progress.step)
        logger.info(
            "load_path: the recipe's %s continues at step %d (learning rate %s)%s",
            type(session.scheduler).__name__,
            session.progress.step,
            ", ".join(f"{g['lr']:.6g}" for g in session.optimizer.param_groups),
            "" if exact else ": it has no closed form, so only its counter was moved",
        )
    return Origin("load_path", None, text)


def _apply(session: Session, loaded: LoadedCheckpoint, fix: str, what: str = "") -> None:
    """Loads a ``state.pt`` checkpoint into the session: every part of the bundle, progress, data-skip record, RNG.
    Model and optimizer state must fit whole: else one ConfigError naming the first keys that differ, and ``fix``."""
    state = loaded.objects[STATE_FILE]["state"]
    what = what or f"checkpoint {loaded.info.uri}"
    carry_over.load_model_state(session.model, state["model"], what, fix)
    if state.get("optimizer") is not None:
        names = carry_over.optimizer_param_names(session.model, session.optimizer)
        carry_over.check_optimizer_fits(session.optimizer, state["optimizer"], names, what, fix)
    session.state.load_state_dict(state, [p for p in state if p != "model"])
    session.progress = Progress.from_dict(loaded.info.progress)
    session.data_skip_applied = loaded.info.manifest.metadata.get("data_skip_applied")
    _restore_rng(session, loaded.objects.get(rng_file(session.world.rank)), loaded.info)


def _restore_stream(config: TrainConfig, session: Session, loaded: LoadedCheckpoint) -> None:
    """A stateful stream's position: this rank's state, saved beside its RNG state (training/position/iterable.py)."""
    if isinstance(session.dataset, StatefulIterable):
        saved = (loaded.objects.get(rng_file(session.world.rank)) or {}).get("data")
        size, gbs, workers = session.world.size, config.global_batch_size, config.num_workers
        session.dataset.restore(saved, size, gbs, workers, f"checkpoint {loaded.info.name}")


def _restore_rng(session: Session, state: dict[str, Any] | None, info: Any) -> None:
    if state is not None:
        rng.restore(state)
        return
    rank = session.world.rank  # the world grew: this rank has no saved stream; derive one from the position
    rng.seed_all(info.progress.get("samples_seen", 0) * 1000 + rank)
    logger.info(
        "rank %d: %s has no RNG state for this rank (saved with world size %s); seeded a new stream",
        rank,
        info.name,
        info.manifest.metadata.get("world_size"),
    )


def _refuse_sharded(store: CheckpointStore) -> None:
    latest = store.latest()
    if latest is not None and latest.sharded:
        raise ConfigError(
            f"checkpoint {latest.name} is sharded (written with parallelism='fsdp'); resume it with "
            f"parallelism='fsdp' at any number of processes, or export it: python -m checkpointing export {latest.uri}"
        )


def reposition(config: TrainConfig, session: Session) -> None:
    """Carries the data position over to this run's global batch size, and applies the data-skip options
    once per run: the checkpoint records that they were applied, so a restart does not skip again."""
    p, new = session.progress, config.global_batch_size
    epoch_size = len(session.dataset)
    if p.global_batch_size and p.global_batch_size != new:
        old_step, old_size = p.step, p.global_batch_size
        session.progress = p = rescaled(p, new)
        if not carry_over.continue_schedule(session.scheduler, p.step):
            logger.warning(
                "%s has no closed form: its step counter now reads %d, but its learning rate continues from where "
                "it was",
                type(session.scheduler).__name__,
                p.step,
            )
        logger.info(
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
    requested = requested_data_skip(config)
    if requested is None or same_data_skip(requested, session.data_skip_applied):
        session.data_skip_applied = requested
        return
    session.data_skip_applied = requested
    if config.ignore_data_skip:
        logger.info(
            "ignore_data_skip: epoch %d restarts from its first sample (was at sample %d); applied once "
            "(recorded in the checkpoint)",
            p.epoch,
            p.sample_in_epoch,
        )
        p.sample_in_epoch = 0
    elif config.data_skip_steps is not None:
        target = min(config.data_skip_steps * new, epoch_size)
        logger.info(
            "data_skip_steps=%d: epoch %d resumes at sample %d (= %d batches of %d; was sample %d); applied once "
            "(recorded in the checkpoint)",
            config.data_skip_steps,
            p.epoch,
            target,
            config.data_skip_steps,
            new,
            p.sample_in_epoch,
        )
        p.sample_in_epoch = target
