"""A loader worker's random generators, seeded from where the run is in its data instead of how long the worker lived.

A dataset that draws random numbers while it loads (augmentation: ``torch.rand``, ``random.random``,
``np.random.rand``) draws them in its loader worker, from the worker's own generators. torch seeds those once, when
the worker starts (``base_seed + worker_id``), and nothing saves how far a worker has drawn since: a resumed run's new
workers would draw an uninterrupted run's first numbers again, and train on other samples than it.

So before each batch (a map-style dataset, ``training/unit/loop.py``) or each sample (a stateful stream's worker,
``training/position/stream_workers.py``) the worker's three generators are seeded from the run's seed and that batch's
or sample's place in the data, which the saved position already holds: a resumed run's workers draw exactly what an
uninterrupted run's would, whatever each worker loaded before. Saving each worker's generator states instead was the
other way: they are ~10 KB (torch's 5 056 bytes, NumPy's and Python's 624 words each) that a stream's worker would
send with every sample (its state crosses with each, to be exact after any sample), checked and restored at resume;
the seeds cost ~9 us a sample (measured on the 2-core test machine at load 7) and one integer of state. torch's
generator seeded is the CPU one (``torch.default_generator``): draws on a GPU inside a loader worker are outside this.
"""

from __future__ import annotations

import hashlib
import random

import torch


def seed_generators(*place: int) -> None:
    """Seeds this process's torch (CPU), Python ``random`` and NumPy global generators from ``place`` (the run's seed,
    then the numbers that say where in the data the next draws are made). ~9 us."""
    digest = hashlib.blake2b(":".join(map(str, place)).encode(), digest_size=8).digest()
    value = int.from_bytes(digest, "little")
    torch.default_generator.manual_seed(value)  # the CPU one: torch.manual_seed's other devices cost 180 us more
    random.seed(value)
    try:
        import numpy as np
    except ImportError:  # pragma: no cover - torch's loader workers seed NumPy only where it is installed too
        return
    np.random.seed(value % 2**32)
