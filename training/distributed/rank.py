"""One rank of a gang (training/distributed/gang.py): started by torchrun, serves the attempt's units until told to leave.

Each rank joins the process group (gloo on CPU, nccl on CUDA). Global rank 0 connects to the unit task's process
(``TRAIN_GANG_ADDRESS``, with the gang's token) and reads its commands; every command is passed to the other
ranks through the process group, so all ranks run the same unit (``training.unit.loop.run_unit``, with their own
warm session kept between units) or the same loop of the user's own (``training.unit.own_loop``). Rank 0 sends
back the result, and a loop's reports as they happen.

Any error ends this rank: it writes what it raised to the gang's folder (``error-rank<r>.json``, typed: see
training/distributed/errors.py) and exits non-zero; torchrun then stops the others. A rank stopped by a signal
reports ``Preempted`` and nothing more: the signal may be torchrun's cleanup after a peer died, and only the launcher
can tell (training/distributed/deaths.py). A stop request reaches a rank as a
termination signal of its own or, forwarded by the parent, through rank 0's connection; the ranks agree on it at
the next step boundary (training/preemption.py). A rank dies with torchrun, which dies with the unit's process.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import queue
import socket
import sys
import threading
from pathlib import Path
from typing import Any

from training import preemption
from training.config import TrainConfig
from training.distributed.errors import error_record
from training.distributed.gang import ADDRESS_ENV, MAX_MESSAGE, TOKEN_ENV, Op
from training.distributed.launcher import FOLDER_ENV
from training.lifetimes import die_with_parent_now, exit_now
from training.unit.session import World

logger = logging.getLogger(__name__)


class ParentChannel:
    """Rank 0's connection to the unit task's process: commands in (a queue), results and reports out."""

    def __init__(self, address: str, token: str):
        host, port = address.rsplit(":", 1)
        self.sock = socket.create_connection((host, int(port)), timeout=60)
        self.sock.settimeout(None)
        self._lock = threading.Lock()
        self.commands: queue.Queue[dict[str, Any]] = queue.Queue()
        self.send({"token": token})
        threading.Thread(target=self._read, name="gang-commands", daemon=True).start()

    def _read(self) -> None:
        with self.sock.makefile("rb") as stream:
            for line in stream:
                if len(line) > MAX_MESSAGE:
                    break
                message = json.loads(line)
                if message.get("op") == Op.STOP:  # acted on by the training thread at its next step boundary
                    kind: preemption.StopKind = "handover" if message.get("kind") == "handover" else "signal"
                    preemption.STOP.request(kind, str(message.get("reason", "")))
                else:
                    self.commands.put(message)
        self.commands.put({"op": Op.EXIT, "why": "the unit's process closed the connection"})

    def send(self, message: dict[str, Any]) -> None:
        with self._lock:
            self.sock.sendall(json.dumps(message).encode() + b"\n")


def serve(world: World, channel: ParentChannel | None) -> None:
    """Runs the parent's commands on every rank until it says exit."""
    import torch.distributed as dist

    from training.unit.loop import run_unit
    from training.unit.own_loop import run_own_loop
    from training.unit.warm import SessionCache

    cache = SessionCache()
    while True:
        box: list[Any] = [channel.commands.get() if channel is not None else None]
        dist.broadcast_object_list(box, src=0)
        command = box[0]
        if command.get("op") == Op.EXIT:
            cache.forget()  # its loader workers end the ordinary way before this rank leaves without teardown
            return
        config = TrainConfig(**command["config"])
        args = {"attempt": int(command.get("attempt", 1)), "generation": int(command["generation"])}
        if command["op"] == Op.LOOP:
            on_report = (lambda r: channel.send({"report": r.model_dump()})) if channel is not None else None
            result = run_own_loop(config, world=world, cache=cache, on_report=on_report, **args)
        else:
            result = run_unit(
                config, start_checkpoint=command.get("start_checkpoint"), world=world, cache=cache, **args
            )
        if channel is not None:
            channel.send({"result": result.model_dump()})


def main(argv: list[str] | None = None) -> int:
    """Entry point of one rank (started by torchrun)."""
    import torch
    import torch.distributed as dist

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--config", required=True)
    args = parser.parse_args(argv)
    die_with_parent_now(os.getppid())  # torchrun: when it goes, this rank goes
    logging.basicConfig(level=logging.INFO, format="[rank %(rank)s] %(message)s")
    world = World(
        rank=int(os.environ["RANK"]), size=int(os.environ["WORLD_SIZE"]), local_rank=int(os.environ["LOCAL_RANK"])
    )
    logging.getLogger().handlers[0].addFilter(_RankFilter(world.rank))
    config = TrainConfig(**json.loads(Path(args.config).read_text()))
    use_nccl = torch.cuda.is_available() and config.device != "cpu"
    if use_nccl:
        torch.cuda.set_device(world.local_rank % torch.cuda.device_count())
    folder = Path(os.environ.get(FOLDER_ENV, "."))
    channel = None
    try:
        with preemption.handling(config.preemption_signals):
            dist.init_process_group("nccl" if use_nccl else "gloo")
            if world.rank == 0:
                logger.info("%d process(es) joined a %s process group", world.size, dist.get_backend())
                channel = ParentChannel(os.environ[ADDRESS_ENV], os.environ[TOKEN_ENV])
            serve(world, channel)
            dist.barrier()  # leave together: a gloo rank torn down while another still talks to it aborts
    except BaseException as exc:
        record = error_record(exc, world.rank)
        (folder / f"error-rank{world.rank}.json").write_text(json.dumps(record))
        if channel is not None:
            with contextlib.suppress(OSError):
                channel.send({"error": record})
        if isinstance(exc, preemption.Preempted):  # this rank's view only: the launcher decides (deaths.py)
            logger.warning("rank %d stopped (%s); the launcher decides whether a peer died or the run was preempted",
                           world.rank, exc)  # fmt: skip
        else:
            logger.error("rank %d: %s: %s", world.rank, type(exc).__name__, exc)
        exit_now(1)  # no teardown that could wait on a peer that is gone
    # Past the barrier every rank is done and owes its peers nothing. Tearing gloo down (destroy_process_group, then
    # the interpreter's own teardown) after a peer has already closed its connections aborts the rank in about 1
    # exit in 5 across machines ("terminate called without an active exception"), which fails that node's run
    # and leaves node 0's torchrun waiting for it at its exit barrier. So: flush, and leave as an error does.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    exit_now(0)


class _RankFilter(logging.Filter):
    def __init__(self, rank: int):
        super().__init__()
        self.rank = rank

    def filter(self, record: logging.LogRecord) -> bool:
        record.rank = self.rank
        return True


if __name__ == "__main__":
    sys.exit(main())
