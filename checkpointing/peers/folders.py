"""Folders other tools write weights into, told apart from ours by the files they hold, and read file by file.

``load_path`` naming a folder used to mean one of our run or checkpoint folders. Two peers hand over folders too:

- Hugging Face ``save_pretrained``: ``model.safetensors``, or shards named by ``model.safetensors.index.json``
  (``{"weight_map": {key: shard file}}``); transformers 4.x also wrote ``pytorch_model.bin`` (and
  ``pytorch_model.bin.index.json``), plain ``torch.save``'d state_dicts;
- Ray Train: a checkpoint is a folder of the user's own files (``checkpoint_000003/`` in Ray 2.x,
  ``checkpoint_<date>/`` in Ray Train v2), typically one ``torch.save``'d dict: read when it holds exactly one
  weights file (hidden files aside), else refused with the names of the candidates.

Ours win: a folder with ``manifest.json``, a ``latest`` pointer or ``checkpoints/`` is never a peer folder. Every
file goes through ``weights.read_bounded`` (regular files only, size bound); shard names come from the index and
must be plain file names listed in the folder, so an index cannot send the reader elsewhere; the shards' sizes
together stay under the same bound as one file.
"""

from __future__ import annotations

import json
import os
import posixpath
from dataclasses import dataclass, field
from typing import Any

import fsspec

from checkpointing.errors import WeightsError
from checkpointing.io import confine
from checkpointing.io.protocols import is_local_fs, open_url
from checkpointing.manifest import MANIFEST
from checkpointing.peers import mindspore_output
from checkpointing.peers.weights import WEIGHTS_SUFFIXES, read_bounded
from checkpointing.store import CHECKPOINTS, POINTER

HF_SAFETENSORS, HF_SAFETENSORS_INDEX = "model.safetensors", "model.safetensors.index.json"
HF_BIN, HF_BIN_INDEX = "pytorch_model.bin", "pytorch_model.bin.index.json"
_HF_ORDER = (HF_SAFETENSORS_INDEX, HF_SAFETENSORS, HF_BIN_INDEX, HF_BIN)  # transformers' own preference
_INDEX_MAX_BYTES = 64 << 20


def peer_folder_kind(fs: fsspec.AbstractFileSystem, path: str) -> str | None:
    """ "hf" for a save_pretrained folder, "mindspore-checkpoint" / "mindspore-rank" for MindSpore Transformers'
    output (checkpointing/peers/mindspore_output.py), "files" for a folder of weights files (Ray), None otherwise."""
    names = _names(fs, path)
    if names is None or names & {MANIFEST, POINTER, CHECKPOINTS}:
        return None
    mindspore = mindspore_output.folder_kind(names, path)
    if mindspore is not None:
        return f"mindspore-{mindspore}"
    if names & set(_HF_ORDER):
        return "hf"
    return "files" if _weights_files(names) else None


@dataclass
class Folder:
    kind: str  # "hf" or "files"
    what: str  # one phrase for logs, e.g. "a Hugging Face save_pretrained folder (model.safetensors)"
    files: list[tuple[str, bytes]]  # (file name, bytes) of the files that hold the weights
    indexed_keys: set[str] = field(default_factory=set)  # the keys a shard index promises


def read_folder(uri: str, options: dict[str, Any] | None, where: str, max_bytes: int) -> Folder:
    """The files of a peer folder that hold its weights, read with the size bound shared between them."""
    fs, path = open_url(uri, options)
    names = _names(fs, path) or set()
    if names & {MANIFEST, POINTER, CHECKPOINTS} or not names:
        raise WeightsError(f"{where}: not a Hugging Face or Ray weights folder")
    kind = next((name for name in _HF_ORDER if name in names), None)
    if kind in (HF_SAFETENSORS_INDEX, HF_BIN_INDEX):
        index = read_bounded(_join(uri, kind), options, f"{where} ({kind})", _INDEX_MAX_BYTES)
        weight_map = shard_map(index, f"{where} ({kind})")
        shards = _shards(weight_map, names, f"{where} ({kind})")
        what = f"a Hugging Face save_pretrained folder ({len(shards)} shards named by {kind})"
        return Folder("hf", what, _read_all(uri, options, where, shards, max_bytes), set(weight_map))
    if kind is not None:
        return Folder(
            "hf", f"a Hugging Face save_pretrained folder ({kind})", _read_all(uri, options, where, [kind], max_bytes)
        )
    files = _weights_files(names)
    if len(files) != 1:
        shown = ", ".join(repr(n) for n in files[:5]) + (", ..." if len(files) > 5 else "")
        raise WeightsError(
            f"{where}: a folder with {len(files)} weights files ({shown or 'none'}); name the one to load"
        )
    what = f"a folder holding one weights file, as Ray Train's checkpoints do ({files[0]})"
    return Folder("files", what, _read_all(uri, options, where, files, max_bytes))


def shard_map(index: bytes, where: str) -> dict[str, str]:
    """The index's ``weight_map`` ({key: shard file}), checked to be a mapping of strings."""
    try:
        weight_map = json.loads(index).get("weight_map")
    except (ValueError, AttributeError) as exc:
        raise WeightsError(f"{where}: not a JSON index with a 'weight_map'") from exc
    if not isinstance(weight_map, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()
    ):
        raise WeightsError(f"{where}: its 'weight_map' is not a mapping of key to shard file")
    return weight_map


def _shards(weight_map: dict[str, str], names: set[str], where: str) -> list[str]:
    shards = sorted(set(weight_map.values()))
    for shard in shards:
        if shard in ("", ".", "..") or "/" in shard or "\\" in shard:
            raise WeightsError(f"{where}: names a shard outside the folder; shards must be files beside the index")
        if shard not in names:
            raise WeightsError(f"{where}: names the shard {shard!r}, which the folder does not hold")
    if not shards:
        raise WeightsError(f"{where}: names no shard")
    return shards


def _read_all(
    uri: str, options: dict[str, Any] | None, where: str, files: list[str], max_bytes: int
) -> list[tuple[str, bytes]]:
    out, left = [], max_bytes
    for name in files:
        data = read_bounded(_join(uri, name), options, f"{where} ({name})", left)
        left -= len(data)
        out.append((name, data))
    return out


def _weights_files(names: set[str]) -> list[str]:
    return sorted(n for n in names if not n.startswith(".") and n.lower().endswith(WEIGHTS_SUFFIXES))


def _names(fs: fsspec.AbstractFileSystem, path: str) -> set[str] | None:
    """The names in folder ``path``, or None when it is not a folder (or cannot be listed)."""
    try:
        if is_local_fs(fs) and confine.local_roots() is not None:  # a deployment run's folder: no link on the way
            return confine.names(path, f"load_path folder {path!r}")
        if is_local_fs(fs):
            return set(os.listdir(path)) if os.path.isdir(path) else None
        if not fs.isdir(path):
            return None
        return {posixpath.basename(p.rstrip("/")) for p in fs.ls(path, detail=False)}
    except (FileNotFoundError, NotADirectoryError, PermissionError):
        return None


def _join(uri: str, name: str) -> str:
    return f"{uri.rstrip('/')}/{name}"
