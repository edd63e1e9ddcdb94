"""The persisting agent: when a training process dies without closing its run (SIGKILL, the OOM killer, a segfault),
the newest snapshot it left in this machine's host-memory tier is committed to the store, so that a relaunch on
*another* machine loses at most the step whose snapshot was not yet published, not everything since the last upload.

Inside a unit the upload thread rests between uploads (``UPLOAD_DUTY``: uploading back to back takes the GIL from
training), so the store trails the tier by up to ten upload times; the tier holds every step, but only for this
machine. The agent closes that gap from outside the training process, at no cost to training:

- ``Agent.start`` (the snapshot pipeline of rank 0, for a store another machine can read) starts one small process
  in a session of its own, so that a kill of the training process's group does not reach it. It runs ``BOOT``: it
  reads its orders (one JSON line on stdin) and then waits for the end of stdin, having imported nothing but ``sys``
  and ``json``: ~20 ms of CPU and a few MB while training runs.
- The run ends as it should (``SnapshotPipeline.close``, on every path of ``Run.close``): ``close`` is written and
  the agent leaves without a word.
- stdin ends without ``close``: the process that held it is gone. The agent imports the rest, reads the tier, and
  commits the newest snapshot through the one commit path (``committer.finish``: files, manifest, ``latest``,
  superseded snapshots, retention), when the relaunch rule (``not_resumable``) says the store has not moved past it
  and the writer's generation is still the newest claim. While it commits it holds the writer's lease, so a relaunch
  elsewhere waits for it instead of fencing it out halfway; one here sees the trainer gone and claims at once (the
  agent is then fenced out and writes nothing). Then it exits: it never outlives its one commit.

Everything the agent reads is this user's private tier (checkpointing/host_tier/tier.py checks it) and orders from
the process that started it, over a pipe: no argument, file or environment variable carries the storage options.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
import weakref
from typing import Any

log = logging.getLogger(__name__)

CLOSE = "close"
AGENT_LABEL = "checkpoint agent of pid"  # the writer label of what it commits: "checkpoint agent of pid <trainer>"
CLOSE_TIMEOUT = 10.0  # seconds a closed agent may take to leave before it is killed (it only has to read EOF)
# The waiting agent: its orders, then stdin's end, before any import of the product's (torch takes ~1 s of CPU).
BOOT = (
    "import sys, json\n"
    "orders = json.loads(sys.stdin.readline())\n"
    f"if sys.stdin.readline().strip() != {CLOSE!r}:\n"
    "    sys.path[:0] = orders['path']\n"
    "    from checkpointing.commit.agent import persist\n"
    "    sys.exit(persist(orders))\n"
)
# Local folders that another machine may mount: a relaunch there reads the store, not this machine's tier.
SHARED_FILESYSTEMS = ("nfs", "nfs4", "cifs", "smb3", "lustre", "gpfs", "beegfs", "cephfs", "ceph", "glusterfs")


def reaches_other_machines(storage: Any) -> bool:
    """Whether another machine may relaunch from this store: an object store, or a local folder on a shared file
    system. (An in-memory store is this process's alone; a plain local disk is this machine's, whose relaunch reads the
    tier, which holds every step.)"""
    if storage.protocol == "memory":
        return False
    if not storage.is_local:
        return True
    from checkpointing.host_tier.tier import filesystem_type

    return filesystem_type(storage.root).split(".")[0] in SHARED_FILESYSTEMS


class Agent:
    """The waiting agent of one snapshot pipeline: ``close`` tells it the run ended as it should."""

    def __init__(self, proc: subprocess.Popen[bytes]):
        self.proc = proc
        # A pipeline dropped without close() (not at exit: a process that ends without closing its run is what the
        # agent is for) still ends its agent.
        self._finalizer = weakref.finalize(self, _close, proc)
        self._finalizer.atexit = False
        _WAITING.add(self)

    @classmethod
    def start(cls, orders: dict[str, Any]) -> Agent | None:
        """Starts the agent with ``orders`` (see ``persist``); None, with one warning, when it cannot be started."""
        try:
            proc = subprocess.Popen(
                # -I: nothing from the working folder or PYTHON* variables before the orders' sys.path is in place
                [sys.executable, "-I", "-c", BOOT],
                stdin=subprocess.PIPE,
                start_new_session=True,  # a kill of the trainer's process group leaves it
                close_fds=True,
            )
            assert proc.stdin is not None
            proc.stdin.write(json.dumps({**orders, "path": sys.path, "trainer": os.getpid()}).encode() + b"\n")
            proc.stdin.flush()
        except (OSError, ValueError) as exc:
            log.warning("checkpoint agent not started (%s): a relaunch elsewhere resumes from the last upload", exc)
            return None
        return cls(proc)

    def close(self) -> None:
        self._finalizer()


_WAITING: weakref.WeakSet[Agent] = weakref.WeakSet()


def _forget_in_child() -> None:
    """A process forked from the trainer (a DataLoader worker of the ``fork`` context) holds no end of the agents' pipes:
    otherwise the trainer's death would reach the agent only once that child is gone too. Nor does it close them."""
    for waiting in list(_WAITING):
        waiting._finalizer.detach()
        try:
            assert waiting.proc.stdin is not None
            waiting.proc.stdin.close()
        except (OSError, ValueError):
            pass
    _WAITING.clear()


os.register_at_fork(after_in_child=_forget_in_child)


def _close(proc: subprocess.Popen[bytes]) -> None:
    try:
        assert proc.stdin is not None
        proc.stdin.write(CLOSE.encode() + b"\n")
        proc.stdin.close()
    except (OSError, ValueError):  # it is gone already
        pass
    try:
        proc.wait(timeout=CLOSE_TIMEOUT)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def orders(
    save_folder: str,
    run_name: str,
    storage_options: dict[str, Any] | None,
    retry: Any,
    rank: int,
    retention: Any,
    network_weights: bool,
) -> dict[str, Any]:
    """What ``persist`` needs to commit as the pipeline's upload thread would have: the store (its folder, run name,
    storage options and retry policy), the roots a deployment run is confined to, the retention, the weights file."""
    from dataclasses import asdict

    from checkpointing.io import confine

    return {
        "save_folder": save_folder,
        "run_name": run_name,
        "storage_options": storage_options,
        "retry": asdict(retry),
        "roots": confine.roots(),
        "rank": rank,
        "retention": asdict(retention),
        "network_weights": network_weights,
    }


def persist(orders: dict[str, Any]) -> int:
    """The trainer died: commits its newest snapshot in the tier when the store has not moved past it (see above)."""
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s checkpoint agent: %(message)s", stream=sys.stderr)
    log.setLevel(logging.INFO)
    try:
        outcome = _persist(orders)
    except Exception as exc:
        log.warning(
            "the training process (pid %s) ended without closing its run, and its newest snapshot could not be "
            "committed: %s: %s; a relaunch resumes from the store's latest checkpoint (or, on this machine, from the "
            "host-memory tier)",
            orders.get("trainer"),
            type(exc).__name__,
            exc,
        )
        return 1
    log.info("the training process (pid %s) ended without closing its run: %s", orders.get("trainer"), outcome)
    return 0


def _persist(orders: dict[str, Any]) -> str:
    from checkpointing.commit.committer import CommitTerms, Retention, finish, snapshot_request
    from checkpointing.errors import FencedError, TierUnavailable
    from checkpointing.fencing import Lease
    from checkpointing.host_tier.gc import not_resumable
    from checkpointing.host_tier.tier import HostTier, verified
    from checkpointing.io import confine
    from checkpointing.io.storage import RetrySettings
    from checkpointing.manifest import Writer
    from checkpointing.store import CheckpointStore

    if orders["roots"] is not None:
        confine.enter(orders["roots"])
    store = CheckpointStore(
        orders["save_folder"],
        orders["run_name"],
        storage_options=orders["storage_options"],
        retry=RetrySettings(**orders["retry"]),
    )
    rank = orders["rank"]
    try:
        tier = HostTier(store.uri, rank)
    except TierUnavailable as exc:
        return f"nothing to commit: the host-memory tier cannot be read ({exc})"
    try:
        records = sorted(tier.records(rank), key=lambda r: r[1].seq, reverse=True)
        if not records:
            return "nothing to commit: no snapshot in the host-memory tier"
        index, record = records[0]
        newest = store.fence.newest()
        if newest != record.generation:
            return f"nothing to commit: writer generation {newest} has claimed the run since snapshot {record.name}"
        why = not_resumable(store, record, store.latest())
        if why:
            return f"nothing to commit: {why} as snapshot {record.name}"
        lease = Lease(store.fence, record.generation, on_stop=lambda _request: None).start()
        try:
            objects = verified(tier, index, record, rank)
            if objects is None:
                return f"nothing to commit: snapshot {record.name} does not verify"
            if store.fence.newest() != record.generation:  # a relaunch here claimed while the lease began: it commits
                return f"nothing to commit: a relaunch claimed the run while snapshot {record.name} was read"
            metadata = {k: v for k, v in record.metadata.items() if k != "claim"}
            writer = Writer.current(record.generation, f"{AGENT_LABEL} {orders.get('trainer')}")
            terms = CommitTerms(store, dict(record.progress), writer, metadata, Retention(**orders["retention"]))
            request = snapshot_request(terms, record.name, objects, network_weights=orders["network_weights"])
            t0 = time.perf_counter()
            info = finish(request, drop_superseded=True)
        except FencedError:
            return f"nothing committed: a newer writer claimed the run while snapshot {record.name} was being committed"
        finally:
            lease.release()
        return f"committed its newest snapshot {info.name} ({info.size_bytes / 1e6:.1f} MB in {time.perf_counter() - t0:.2f}s)"
    finally:
        tier.close()
