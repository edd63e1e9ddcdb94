"""Composer's format variables in ``save_folder``: ``{run_name}`` is substituted, the others refused by name.

Composer formats its ``save_folder`` with the run name and the process's place (``{run_name}``, ``{rank}``,
``{local_rank}``, ``{node_rank}``, ``{world_size}``, ``{local_world_size}``) and its file names with the
position too (``{epoch}``, ``{batch}``, ``{sample}``, ...). Taken literally here, ``save_folder='runs/{run_name}'``
made a folder named ``{run_name}``. ``{run_name}`` means the same here, so it is substituted; the others describe
what this product does differently (one checkpoint per run for all ranks; names that already carry the position),
so each is refused with one line saying what to write instead.
"""

from __future__ import annotations

import string

# Composer's format_name_with_dist variables, and format_name_with_dist_and_time's time ones
_RANKS = ("rank", "local_rank", "node_rank", "world_size", "local_world_size")
_TIME = ("epoch", "batch", "batch_in_epoch", "sample", "sample_in_epoch", "token", "token_in_epoch", "total_wct",
         "epoch_wct", "batch_wct")  # fmt: skip


def format_save_folder(value: str, run_name: str) -> str:
    """``value`` with ``{run_name}`` substituted; ValueError naming save_folder, the variable and the fix for any
    other variable, or for braces that would stay in a folder's name."""
    try:
        fields = [field for _, field, _, _ in string.Formatter().parse(value) if field is not None]
    except ValueError:
        raise ValueError(
            f"save_folder={value!r}: unbalanced braces (Composer's format syntax; only {{run_name}} is substituted "
            f"here, and braces may not stay in a folder name)"
        ) from None
    for field in fields:
        if field != "run_name":
            raise ValueError(f"save_folder={value!r}: {_why_not(field)}")
    formatted = value.format(run_name=run_name) if fields else value
    if "{" in formatted or "}" in formatted:
        raise ValueError(f"save_folder={value!r}: braces would stay in a folder name ({formatted!r}); leave them out")
    return formatted


def _why_not(field: str) -> str:
    if field in _RANKS:
        return (
            f"{{{field}}} makes a folder per process in Composer; here every process of a run writes one checkpoint "
            f"together (each rank's RNG state is a file in it, under one manifest): drop '{{{field}}}'"
        )
    if field in _TIME:
        return (
            f"{{{field}}} goes in Composer's file names; here each checkpoint is named by where training stood "
            f"(<save_folder>/<run_name>/checkpoints/ep<epoch>-ba<step>-sa<samples>): drop '{{{field}}}'"
        )
    return f"{{{field}}} is not a format variable; only {{run_name}} is substituted here"
