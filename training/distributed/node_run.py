"""One node's share of a unit that trains across machines: its torchrun, watched until it ends.

The rank-node flow (flows/node.py) calls ``run_node`` once it has verified the offer (training/distributed/nodes.py). This
worker checks for itself what it lets the run do (the recipe against its allow-list, the locations against its
roots), then starts torchrun as node ``node_rank`` of node 0's rendezvous with the same rank entry point as node 0
(``training.distributed.rank``): its ranks take every command from global rank 0 through the process group.

A node must not outlive its gang, however the gang ends:
- this process dies: torchrun dies with it (``PR_SET_PDEATHSIG``), and each rank with torchrun;
- its flow run is cancelled: Prefect's SIGTERM ends the wait here and takes torchrun's process group down;
- node 0's processes die: the kernel closes their connections and this node's ranks fail within a second;
- node 0's machine vanishes without closing anything (its store stops answering): after ``LOST_AFTER`` seconds
  this process stops its torchrun itself. Its ranks would otherwise wait for the next command for ever.
"""

from __future__ import annotations

import contextvars
import json
import logging
import os
import socket
import subprocess
import tempfile
import threading
import time
from pathlib import Path

from training.config import TrainConfig
from training.config.limits import check_limits
from training.config.machines import node_address
from training.config.trust import check_locations, confined_root_forms
from training.distributed.launcher import NodeSeat, Torchrun, relay_output
from training.distributed.nodes import NodeOffer
from training.exceptions import NodeFailed
from training.lifetimes import kill_group, remove_stale_folders
from training.recipe.loader import resolve_recipe

logger = logging.getLogger(__name__)

FOLDER_PREFIX = "resumable-train-node-"  # <tmp>/<prefix><pid>-<random>: this node's torchrun's config and logs
LOST_AFTER = 30.0  # seconds without an answer from node 0's store before this node stops
PROBE_EVERY = 3.0  # seconds between looks at node 0's store


def run_node(offer: NodeOffer, config: TrainConfig) -> str:
    """Runs this node's ranks until the gang ends; returns a line saying how it went, or raises NodeFailed."""
    check_locations(config)  # this worker's roots, whatever node 0's worker allowed
    check_limits(config)  # ... and this worker's caps on what one run may start (training/config/limits.py)
    recipe = resolve_recipe(config.recipe)  # ... and this worker's recipes
    seat = NodeSeat(offer.nnodes, offer.node_rank, offer.endpoint, offer.rdzv_id, node_address())
    torchrun = Torchrun(offer.nproc_per_node, recipe, confined_root_forms(), seat)  # ranks' files and data: under these
    remove_stale_folders(FOLDER_PREFIX)  # a SIGKILLed node process's: it ran no cleanup
    with tempfile.TemporaryDirectory(prefix=f"{FOLDER_PREFIX}{os.getpid()}-") as folder:
        logger.info(
            "node %d of %d: starting %d rank process(es), rendezvous %s (%s)",
            offer.node_rank,
            offer.nnodes,
            offer.nproc_per_node,
            offer.endpoint,
            offer.rdzv_id,
        )
        proc = torchrun.start(config, Path(folder), os.environ)
        # In this run's context: torchrun's lines reach the node run's logs in the UI, not only the worker's output.
        relay = threading.Thread(
            target=contextvars.copy_context().run, args=(relay_output, proc, logger), name="node-output", daemon=True
        )
        relay.start()
        try:
            code = supervise(proc, offer.endpoint)
        finally:
            kill_group(proc.pid)  # cancelled, lost, or done: nothing of this node stays
            proc.wait()
            relay.join(timeout=5)
        if code != 0:
            raise NodeFailed(f"node {offer.node_rank}: torchrun exited {code}{_rank_error(Path(folder))}")
    return f"node {offer.node_rank} of {offer.nnodes} done (rendezvous {offer.rdzv_id})"


def supervise(proc: subprocess.Popen, endpoint: str, lost_after: float = LOST_AFTER, every: float = PROBE_EVERY) -> int:
    """Waits for ``proc``; stops its process group and raises NodeFailed once ``endpoint`` (node 0's store) has not
    answered for ``lost_after`` seconds."""
    host, port = endpoint.rsplit(":", 1)
    answered = time.monotonic()
    while True:
        try:
            return proc.wait(timeout=every)
        except subprocess.TimeoutExpired:
            pass
        if _answers(host, int(port), timeout=every):
            answered = time.monotonic()
        elif time.monotonic() - answered > lost_after:
            kill_group(proc.pid)
            proc.wait()
            raise NodeFailed(
                f"node 0's rendezvous at {endpoint} has not answered for {lost_after:.0f} s: stopped this node's "
                f"ranks (the unit's retry starts a fresh gang)"
            )


def _answers(host: str, port: int, timeout: float) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def _rank_error(folder: Path) -> str:
    """What a rank of this node recorded before it died, as one line."""
    for path in sorted(folder.glob("error-rank*.json")):
        try:
            record = json.loads(path.read_text()[:10000])
        except (OSError, ValueError):
            continue
        if isinstance(record, dict):
            first = str(record.get("message", "")).splitlines()[:1]
            return f"; rank {record.get('rank')}: {record.get('type')}: {first[0] if first else ''}"[:500]
    return ""
