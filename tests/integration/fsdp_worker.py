"""One rank of the FSDP tests, started by torchrun: follows a plan (train, save, load, dump) from a JSON file.

The model is built with the same seed on every rank, and each global step's batch is a pure function of
the step number, split evenly between ranks: the same math whatever the world size, up to the order in
which gradients are summed. Storage options come from TRAIN_STORAGE_OPTIONS (never from argv). Rank 0
writes one JSON line per op, with what every rank saw, to the plan's ``result`` file.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from checkpointing import CheckpointStore, Writer
from checkpointing.commit.committer import CommitTerms
from training.unit import fsdp

GLOBAL_BATCH = 16


def build(device: torch.device) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 4))
    fsdp.shard_model(model, device)
    return model, torch.optim.Adam(model.parameters(), lr=1e-3)


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, step: int, device: torch.device) -> float:
    g = torch.Generator().manual_seed(1000 + step)
    x, y = torch.randn(GLOBAL_BATCH, 64, generator=g), torch.randint(0, 4, (GLOBAL_BATCH,), generator=g)
    share = GLOBAL_BATCH // dist.get_world_size()
    rows = slice(dist.get_rank() * share, (dist.get_rank() + 1) * share)
    optimizer.zero_grad(set_to_none=True)
    loss = F.cross_entropy(model(x[rows].to(device)), y[rows].to(device))
    loss.backward()  # FSDP averages the ranks' gradients: the global batch's mean
    optimizer.step()
    return float(loss.detach())


class Rank:
    def __init__(self, plan: dict, device: torch.device):
        self.rank, self.world, self.device = dist.get_rank(), dist.get_world_size(), device
        options = json.loads(os.environ.get("TRAIN_STORAGE_OPTIONS", "{}"))
        self.store = CheckpointStore(plan["save_folder"], plan["run_name"], storage_options=options)
        self.model, self.optimizer = build(device)
        self.step = 0

    def run(self, op: dict) -> dict:
        kind = op["op"]
        if kind == "train":
            losses = [train_step(self.model, self.optimizer, self.step + i, self.device) for i in range(op["steps"])]
            self.step += op["steps"]
            return {"losses": losses}
        if kind == "save":
            progress = {"samples_seen": self.step * GLOBAL_BATCH, "step": self.step}
            terms = CommitTerms(self.store, progress, Writer.current(op.get("generation", 1)))
            pending = fsdp.save_sharded(  # named by the store from the progress: ep0-ba<step>-sa<16 * step>
                terms,
                self.model,
                self.optimizer,
                {"step": self.step},
                rank_extra={"rank": self.rank, "rng": torch.get_rng_state()},
            )
            info = pending.wait()
            assert info.name == op["name"], (info.name, op["name"])
            return {"name": info.name, "files": sorted(info.manifest.files)}
        if kind in ("load", "restore_latest"):
            return self.load(op)
        if kind == "dump":
            state = fsdp.full_state(self.model, self.optimizer)
            if self.rank == 0:
                torch.save({**state, "step": self.step}, op["file"])
            return {}
        raise ValueError(f"unknown op {kind!r}")

    def load(self, op: dict) -> dict:
        try:
            if op["op"] == "load":
                info = next(i for i in self.store.list() if i.name == op["name"])
                extra = fsdp.load_sharded(self.store, info, self.model, self.optimizer)
            else:
                found = fsdp.restore_latest(self.store, self.model, self.optimizer)
                assert found is not None, "no checkpoint to restore"
                info, extra = found
        except Exception as exc:
            return {"error": type(exc).__name__, "message": str(exc)}
        self.step = extra.common["step"]
        return {"name": info.name, "step": self.step, "files_read": extra.files_read, "rank_extra": _plain(extra.rank)}


def _plain(rank_extra: dict | None) -> dict | None:
    return None if rank_extra is None else {"rank": rank_extra["rank"]}


def main() -> int:
    with open(sys.argv[1]) as f:
        plan = json.load(f)
    device = torch.device(plan.get("device", "cpu"))
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", timeout=timedelta(seconds=180))
    try:
        me = Rank(plan, device)
        for op in plan["ops"]:
            try:
                mine = me.run(op)
            except Exception:
                mine = {"crash": traceback.format_exc()}
            everyone = [None] * me.world
            dist.all_gather_object(everyone, mine)
            if me.rank == 0:
                with open(plan["result"], "a") as f:
                    f.write(json.dumps({"op": op, "world": me.world, "ranks": everyone}) + "\n")
            if any("crash" in r for r in everyone):
                dist.destroy_process_group()
                return 1
        dist.barrier()  # leave together: a gloo rank torn down while another still talks to it can abort
    except BaseException:
        dist.destroy_process_group()
        raise
    # As the product's ranks do (training/distributed/rank.py): leave without gloo's teardown, which aborted a rank now
    # and then under load ("terminate called without an active exception") after every result was written.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
