"""Checkpoint names: ``ep<epoch>-ba<step>-sa<samples seen>[-g<generation>]``, made from a checkpoint's progress and
read back only as a hint of it (the manifest is what counts). ``CheckpointStore.name_for`` is the one place a name
is given to a checkpoint."""

from __future__ import annotations

import re

_SAMPLES_IN_NAME = re.compile(r"-sa(\d+)(?:-g\d+)?$")


def checkpoint_name(progress: dict[str, int]) -> str:
    """``ep<epoch>-ba<step>-sa<samples seen>``: where training stood, readable in a listing."""
    return (
        f"ep{int(progress.get('epoch', 0))}-ba{int(progress.get('step', 0))}-sa{int(progress.get('samples_seen', 0))}"
    )


def may_be_past(name: str, head: str, head_samples: int) -> bool:
    """Whether checkpoint ``name`` may be newer than ``head``: its name says it saw more samples (or says
    nothing). Reading only those keeps resolving cheap in a run with thousands of checkpoints."""
    if name == head:
        return False
    m = _SAMPLES_IN_NAME.search(name)
    return m is None or int(m.group(1)) > head_samples
