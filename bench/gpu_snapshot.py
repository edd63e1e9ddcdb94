"""``python -m bench gpu_snapshot``: parts A and B of ``bench/snapshots.py`` on one CUDA GPU, sized to finish in under
~3 minutes on an H100 (issue 33).

A. The stall of ``Checkpointer.snapshot`` against a pinned, ``non_blocking`` device-to-host copy of the same tensors
   (synchronized), for GPT states of ~1 GB and ~2 GB (params + AdamW buffers, fp32), 10 alternating reps after 3
   warm-ups (reported apart: each of the first three snapshots allocates and pins a slot); also the time from
   ``snapshot()``'s return to its copy's CUDA event (the copy runs on a side stream and the next
   ``optimizer.step()`` waits for it on the GPU), and the old ways once each (serialization, a synchronous commit).
B. Throughput: a unit of 100 steps (after a 10-step warm-up unit) of a GPT-2-small-sized model (12 layers, 12 heads, 768 wide, blocks of 256, char
   vocabulary: ~1 GB of state) with a snapshot every 1, 10, 100 steps and none, 2 alternating reps.

Flags after the name go to ``python -m bench snapshots`` (they override the ones above). Needs only torch and the
project's core dependencies (no Prefect); exits with a message where CUDA is unavailable.
"""

from __future__ import annotations

import os
import sys

from bench import snapshots

DEFAULTS = [
    "--parts", "AB", "--device", "cuda", "--threads", "4", "--sizes", "1GB", "2GB", "--reps", "10",
    "--old_reps", "1", "--b_model", "gpt2", "--steps", "110", "--reps_b", "2", "--batch", "16",
]  # fmt: skip


def main(argv: list[str]) -> None:
    import torch

    if not torch.cuda.is_available():
        sys.exit("python -m bench gpu_snapshot: CUDA is not available on this machine (torch "
                 f"{torch.__version__}); run it on a GPU machine, or `python -m bench snapshots` for the CPU figures")  # fmt: skip
    allowed = os.environ.get("TRAIN_ALLOWED_RECIPES", "")
    if "gpt=" not in allowed:  # a bare GPU machine: the project is not installed, its entry points are not registered
        os.environ["TRAIN_ALLOWED_RECIPES"] = ",".join(filter(None, [allowed, "gpt=recipes.gpt:GPTRecipe"]))
    snapshots.main([*DEFAULTS, *argv])
