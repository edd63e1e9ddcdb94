"""Running a unit under torchrun: PyTorch's own launcher and DDP, not a home-made one.

The Prefect task calls ``launch_unit``, which starts ``torchrun`` in a process group of its own and
waits. Each rank runs ``main`` here: it joins the process group (gloo on CPU, nccl on CUDA), trains its
share of every global batch, and rank 0 commits the checkpoint with every rank's RNG state. If any
rank dies, torchrun stops the others and exits non-zero; ``launch_unit`` then kills whatever is left
of the group, so a retry starts with no orphan processes and no held ports.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

from training.config import TrainConfig, load_config
from training.recipe import ALLOWED_ENV, resolve_recipe

logger = logging.getLogger(__name__)
_PR_SET_PDEATHSIG = 1


class DistributedUnitError(RuntimeError):
    """A torchrun unit ended without a result (a rank failed or was killed). Retried by Prefect."""


def die_with_parent() -> None:
    """``preexec_fn`` for children that must not outlive this process: the kernel sends SIGKILL when the parent
    dies, even by SIGKILL (Linux; elsewhere a no-op)."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def torchrun_command(config: TrainConfig, args: list[str], rdzv_id: str) -> list[str]:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc-per-node={config.nproc_per_node}",
        "--max-restarts=0",
    ]
    if config.nnodes > 1:
        cmd += [
            f"--nnodes={config.nnodes}",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint={config.rdzv_endpoint}",
            f"--rdzv-id={rdzv_id}",
        ]
    else:
        cmd += ["--standalone"]  # rendezvous on a free local port
    return [*cmd, "-m", "training.distributed", *args]


def launch_unit(config: TrainConfig, *, attempt: int, generation: int, log):
    """Runs one unit under torchrun and returns rank 0's UnitResult."""
    from training.loop import UnitResult

    with tempfile.TemporaryDirectory(prefix="unit-") as tmp:
        config_file, result_file = Path(tmp, "config.json"), Path(tmp, "result.json")
        config_file.write_text(config.model_dump_json())  # storage_options excluded: passed by environment
        config_file.chmod(0o600)
        args = [
            "--config",
            str(config_file),
            "--result",
            str(result_file),
            "--attempt",
            str(attempt),
            "--generation",
            str(generation),
        ]
        env = dict(os.environ)
        if config.storage_options:
            env["TRAIN_STORAGE_OPTIONS"] = json.dumps(config.storage_options)
        # This process already decided the recipe may run here; its ranks inherit that decision, nothing more.
        env[ALLOWED_ENV] = ",".join(filter(None, [env.get(ALLOWED_ENV, ""), resolve_recipe(config.recipe)]))
        rdzv_id = f"{config.run_name}-g{generation}-a{attempt}"
        cmd = torchrun_command(config, args, rdzv_id)
        log.info(
            "unit (attempt %d): torchrun with %d process(es) per node on %d node(s)",
            attempt,
            config.nproc_per_node,
            config.nnodes,
        )
        code = _run_group(cmd, env, log)
        if not result_file.exists():
            raise DistributedUnitError(
                f"torchrun exited with code {code} before the unit committed; all its "
                f"processes were stopped (a retry resumes from the last checkpoint)"
            )
        if code != 0:  # the result is written only after the commit: the unit is done, only teardown failed
            log.warning("torchrun exited with code %d after the unit committed; keeping its result", code)
        return UnitResult.model_validate_json(result_file.read_text())


def _run_group(cmd: list[str], env: dict[str, str], log) -> int:
    """Runs ``cmd`` in a new session, relays its output, and always leaves nothing of it running."""
    proc = subprocess.Popen(
        cmd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
        preexec_fn=die_with_parent,  # torchrun stops its ranks when the unit's process dies, however it dies
    )
    assert proc.stdout is not None
    try:
        for line in proc.stdout:
            log.info("%s", line.rstrip())
        return proc.wait()
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # ranks torchrun could not stop, or any we were interrupted in
        proc.wait()


def main(argv: list[str] | None = None) -> int:
    """Entry point of one rank (started by torchrun)."""
    import torch
    import torch.distributed as dist

    from training.loop import run_unit
    from training.session import World

    parser = argparse.ArgumentParser(description=__doc__)
    for flag in ("--config", "--result"):
        parser.add_argument(flag)
    parser.add_argument("--attempt", type=int, default=1)
    parser.add_argument(
        "--generation",
        type=int,
        default=None,
        help="writer generation; without it rank 0 claims a new one (standalone use)",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="[rank %(rank)s] %(message)s")
    world = World(
        rank=int(os.environ["RANK"]), size=int(os.environ["WORLD_SIZE"]), local_rank=int(os.environ["LOCAL_RANK"])
    )
    logging.getLogger().handlers[0].addFilter(_RankFilter(world.rank))
    # From the unit task: a config file. Standalone (e.g. a Kubernetes Job per unit): TRAIN_* variables.
    config = TrainConfig(**json.loads(Path(args.config).read_text())) if args.config else load_config([])
    use_nccl = torch.cuda.is_available() and config.device != "cpu"
    if use_nccl:
        torch.cuda.set_device(world.local_rank % torch.cuda.device_count())
    dist.init_process_group("nccl" if use_nccl else "gloo")
    if world.rank == 0:
        logger.info("%d process(es) joined a %s process group", world.size, dist.get_backend())
    try:
        generation = args.generation if args.generation is not None else _claim_on_rank0(config, world)
        result = run_unit(
            config,
            attempt=args.attempt,
            generation=generation,
            world=world,
            log=logger,
        )
        if world.local_rank == 0 and args.result:
            Path(args.result).write_text(result.model_dump_json())
        # Leave together: a gloo rank that tears down while another still talks to it can abort ("terminate
        # called without an active exception"), which makes torchrun report a failure after the commit.
        dist.barrier()
    finally:
        dist.destroy_process_group()
    return 0


def _claim_on_rank0(config: TrainConfig, world) -> int:
    import torch.distributed as dist

    from training.session import open_store

    box = [open_store(config).claim_generation(label="torchrun unit") if world.rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return int(box[0] or 0)


class _RankFilter(logging.Filter):
    def __init__(self, rank: int):
        super().__init__()
        self.rank = rank

    def filter(self, record: logging.LogRecord) -> bool:
        record.rank = self.rank
        return True


if __name__ == "__main__":
    sys.exit(main())
