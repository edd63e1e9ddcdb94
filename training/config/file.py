"""Config files: read within bounds, and written for other trainers' nested sections refused with their flat
equivalent.

The file is read once, bounded (training/config/text.py), and the checked mapping is what pydantic-settings gets:
its own YAML/TOML sources would read the file again, unbounded. Keys are field names exactly.

MindSpore Transformers' YAML nests its settings (``runner_config: {epochs: 3, batch_size: 32}``,
``CheckpointMonitor`` under ``callbacks``, ``trainer: {ignore_data_skip: ...}``). TrainConfig is flat, and
pydantic would reject each section as "extra inputs are not permitted", which says nothing about what to
write instead. When the file nests, this names the flat key for each nested key it recognises, in one line; so it
does for MindSpore's key names written at the top level (``epochs: 3``, ``save_checkpoint_steps: 500``).
"""

from __future__ import annotations

import json
import os
import typing
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from training.config.text import ConfigError, check_keys, parse_toml, parse_yaml, read_bounded, short

# MindSpore Transformers' names -> (our field, how its value converts). Their batch_size is per device.
_FOREIGN: dict[str, tuple[str, Callable[[Any], Any]]] = {
    "epochs": ("max_duration", lambda v: f"{v}ep"),
    "batch_size": ("global_batch_size", int),
    "save_checkpoint_steps": ("save_interval", lambda v: f"{v}ba"),
    "keep_checkpoint_max": ("num_checkpoints_to_keep", int),
    "load_checkpoint": ("load_path", str),
    "resume_training": ("autoresume", bool),
    "output_dir": ("save_folder", str),
}
_MAX_LISTED = 8


def read_config_file(path: str, fields: Mapping[str, Any]) -> dict[str, Any]:
    """The values of a flat TOML or YAML config file, read within bounds; one ConfigError line otherwise."""
    option = f"config_file={short(path)}"
    if not os.path.exists(path):
        raise ConfigError(f"{option}: no such file")
    if not path.endswith((".toml", ".yaml", ".yml")):
        raise ConfigError(f"{option}: use a .toml, .yaml or .yml file")
    text = read_bounded(path, option)
    raw = parse_toml(text, option) if path.endswith(".toml") else parse_yaml(text, option)
    if raw is None:
        return {}  # an empty file sets nothing
    if not isinstance(raw, Mapping):
        raise ConfigError(
            f"{option}: expected a mapping of TrainConfig fields at the top level, got {type(raw).__name__}"
        )
    if problem := nested_sections_problem(raw, option, fields) or foreign_keys_problem(raw, option, fields):
        raise ConfigError(problem)
    check_keys(raw, fields, f"{option}:")
    return dict(raw)


def nested_sections_problem(raw: Mapping[Any, Any], option: str, fields: Mapping[str, Any]) -> str | None:
    """One line naming the flat equivalent of a nested file's keys; None when the file is flat."""
    dict_fields = {name for name, f in fields.items() if dict in (f.annotation, typing.get_origin(f.annotation))}
    nested = [k for k, v in raw.items() if k not in dict_fields and _has_mapping(v)]
    if not nested:
        return None
    recognised, unknown = [], []
    for dotted, value in _leaves(raw, dict_fields):
        leaf = dotted.rsplit(".", 1)[-1]
        if leaf in fields and "." not in dotted:
            continue  # already flat and ours: nothing to say
        mapped = _flat_equivalent(leaf, value, fields)
        if mapped is None:
            unknown.append(dotted)
        else:
            recognised.append(f"{dotted} -> {mapped[0]}: {_scalar(mapped[1])}")
    return (
        f"{option}: nested sections are not read; TrainConfig is flat. "
        f"Recognised: {_listing(recognised) or 'none'}; unknown: {_listing(unknown) or 'none'}. "
        f"Write the recognised keys at the top level (python -m flows.train --help lists every field)"
    )


def foreign_keys_problem(raw: Mapping[Any, Any], option: str, fields: Mapping[str, Any]) -> str | None:
    """One line naming the TrainConfig field (and value) for each MindSpore Transformers key written at the top level
    (``epochs: 3``); None when there is none. Keys that are neither ours nor MindSpore's are listed as unknown."""
    theirs = [k for k in raw if k not in fields and k in _FOREIGN]
    if not theirs:
        return None
    written = []
    for key in theirs:
        mapped = _flat_equivalent(key, raw[key], fields)
        written.append(f"{key} -> {mapped[0]}: {_scalar(mapped[1])}" if mapped else f"{key} -> {_FOREIGN[key][0]}")
    unknown = [str(k) for k in raw if k not in fields and k not in _FOREIGN]
    per_device = " (MindSpore's batch_size is per device: multiply it by the number of devices)"
    return (
        f"{option}: MindSpore Transformers' key(s) are not TrainConfig fields; write "
        f"{_listing(written)}{per_device if 'batch_size' in theirs else ''} instead"
        f"{f'; unknown: {_listing(unknown)}' if unknown else ''}"
    )


def _has_mapping(value: Any) -> bool:
    return isinstance(value, Mapping) or (isinstance(value, list) and any(isinstance(v, Mapping) for v in value))


def _leaves(node: Any, dict_fields: set[str], prefix: str = "") -> Iterator[tuple[str, Any]]:
    """(dotted key, value) of every scalar; a list item that is a mapping is named by its ``type``."""
    if isinstance(node, Mapping):
        for key, value in node.items():
            if not prefix and key in dict_fields:
                continue
            yield from _leaves(value, dict_fields, f"{prefix}{key}.")
    elif isinstance(node, list) and any(isinstance(v, Mapping) for v in node):
        for i, item in enumerate(node):
            label = item.get("type", i) if isinstance(item, Mapping) else i
            body = {k: v for k, v in item.items() if k != "type"} if isinstance(item, Mapping) else item
            yield from _leaves(body, dict_fields, f"{prefix}{label}.")
    else:
        yield prefix.rstrip("."), node


def _flat_equivalent(leaf: str, value: Any, fields: Mapping[str, Any]) -> tuple[str, Any] | None:
    if leaf in fields:
        return leaf, value
    if leaf == "resume_training" and isinstance(value, str) and "resume_from" in fields:
        return "resume_from", value  # MindSpore names the checkpoint to resume from here
    if leaf in _FOREIGN:
        name, convert = _FOREIGN[leaf]
        try:
            return name, convert(value)
        except (TypeError, ValueError):
            return None
    return None


def _scalar(value: Any) -> str:
    if isinstance(value, str):
        return repr(value)
    return json.dumps(value)


def _listing(items: list[str]) -> str:
    shown = ", ".join(item if len(item) <= 100 else f"{item[:100]}..." for item in items[:_MAX_LISTED])
    return shown + (f" (+{len(items) - _MAX_LISTED} more)" if len(items) > _MAX_LISTED else "")
