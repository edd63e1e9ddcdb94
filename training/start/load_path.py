"""The one reader of ``load_path``: a weights file or a peer's folder from anywhere, or a checkpoint or run folder of ours.

A new run's warm start and its check before anything is written (training/start/warm_start.py), a unit's start
(training/unit/session.py) and a loop's own ``ctx.get_checkpoint()`` (training/unit/own_loop.py) read it here, and
each decides what it takes from what is there: ``read_weights`` gives the weights a new run takes (and what else a
peer's file carries), ``read_checkpoint`` a checkpoint of ours whole.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from checkpointing import LoadedCheckpoint, open_checkpoint_uri
from checkpointing.peers.formats import PeerCheckpoint, is_weights_file, read_peer_checkpoint
from checkpointing.peers.weights import Weights, WeightsError, unwrap
from checkpointing.store import STATE_FILE
from training.config import ConfigError, TrainConfig


@dataclass(frozen=True)
class LoadPathWeights:
    """The weights ``load_path`` gives a new run (``peer.weights``), and what else a peer's file carries."""

    peer: PeerCheckpoint
    origin: str  # for people: "weights of <uri> (load_path: ...)"
    from_file: bool  # a weights file or a peer's folder; False: the model of a checkpoint of ours (load_weights_only)


def read_weights(config: TrainConfig) -> LoadPathWeights | None:
    """``load_path`` read as weights: a weights file or a peer's folder, or, with ``load_weights_only``, the model of a
    checkpoint or run folder of ours. None, with nothing read, for a folder of ours whose full state is wanted
    (``read_checkpoint``)."""
    uri, options = str(config.load_path), config.storage_options
    if is_weights_file(uri, options):
        peer = read_peer_checkpoint(uri, options)
        return LoadPathWeights(peer, f"weights of {uri} (load_path: {peer.weights.description})", from_file=True)
    if not config.load_weights_only:
        return None
    loaded = read_checkpoint(config)
    try:  # the train loop's ["model"], an own loop's ["model_weights"], ...: as export looks for them
        found = unwrap(loaded.objects[STATE_FILE]["state"], f"load_path={config.load_path!r} ({loaded.info.name})")
    except WeightsError as exc:
        raise ConfigError(str(exc)) from exc
    weights = Weights(found.state_dict, f"checkpoint {loaded.info.name}")
    peer = PeerCheckpoint(weights, description=weights.description)
    return LoadPathWeights(peer, f"weights of {loaded.info.uri} (load_path)", from_file=False)


def read_checkpoint(config: TrainConfig, files: Iterable[str] = (STATE_FILE,)) -> LoadedCheckpoint:
    """The checkpoint of ours that ``load_path`` names (a run folder: its newest good one), with its ``files``."""
    return open_checkpoint_uri(str(config.load_path), storage_options=config.storage_options, files=files)
