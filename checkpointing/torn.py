"""Torn folders: checkpoint folders a writer began and never committed, who removes them, and what verify says.

A commit writes a checkpoint's files, then its ``manifest.json``, then moves ``latest`` (store.py). A writer killed in
between leaves ``checkpoints/<name>/`` with some files and no manifest. Readers never choose it (nothing vouches for
it), but nothing removed it either, and ``python -m checkpointing verify`` failed the healthy run on it.

Who removes them: the next writer, once it holds its claim (fencing.py) and before it writes anything
(``CheckpointStore.claim_generation``). At that moment every folder without a manifest belongs to a writer generation
that can no longer commit: the claim fences every older writer out (its next fence check refuses it), and this one
has written nothing yet. The folders are listed after the claim, and removed only if the claim is still the newest
after the listing (else a newer writer's folder in flight could be in the list: that writer cleans instead); each
one only while it still has no manifest (looked at again just before), never the one ``latest`` names (a manifest
missing there is damage, for verify to report), never one this process is writing. Object stores have no rename:
removal is object by object, and a folder half-removed by a writer killed while cleaning is torn again, for the
next writer. A fenced-out writer still alive (it did not hand over) may write into a folder after it was removed;
its commit is refused, and the next writer removes what it wrote. Removal is best effort: a store error is a
warning, never a failed claim.

What verify says (``leftover``): a folder with no manifest whose name gives its writer's generation (``-g<n>``, the
suffix a retrained checkpoint gets beside an older writer's) older than the newest claim, and that ``latest`` does
not name, is a leftover of a dead writer: reported as such, with how it goes away, and not a failure. A manifest
that fails, or a missing one where the writer's generation is not known to be fenced out, is still a failure.
"""

from __future__ import annotations

import logging
import re
from typing import TYPE_CHECKING

from checkpointing.manifest import MANIFEST

if TYPE_CHECKING:
    from checkpointing.store import CheckpointStore

log = logging.getLogger(__name__)

CHECKPOINTS = "checkpoints"
_GENERATION_IN_NAME = re.compile(r"-g([0-9]{1,19})$")


def generation_in_name(name: str) -> int | None:
    """The writer generation a checkpoint name carries (``ep0-ba3-sa48-g2`` -> 2), None when it carries none."""
    found = _GENERATION_IN_NAME.search(name)
    return int(found.group(1)) if found else None


def torn_folders(store: CheckpointStore) -> list[str]:
    """Folders with a checkpoint name and no ``manifest.json`` at all (one that is there but does not read is damage
    to a committed checkpoint, not this), sorted."""
    names = store.folders()
    if not names:
        return []
    files = store.storage.sizes(CHECKPOINTS)
    committed = {key.split("/", 1)[0] for key in files if key.count("/") == 1 and key.endswith(f"/{MANIFEST}")}
    return sorted(n for n in names if n not in committed)


def remove_fenced_out(store: CheckpointStore, generation: int, in_flight: set[str]) -> list[str]:
    """Removes the torn folders of writers older than ``generation`` (just claimed, nothing written yet); returns
    their names. Nothing when a newer generation was claimed meanwhile."""
    torn = torn_folders(store)
    if not torn or store.fence.newest() > generation:
        return []
    named = (store.read_pointer() or {}).get("name")
    removed = []
    for name in torn:
        key = f"{CHECKPOINTS}/{name}"
        if name == named or name in in_flight or store.storage.exists(f"{key}/{MANIFEST}"):
            continue  # damage for verify to report / being written here / committed since the listing
        store.storage.delete(key, recursive=True)
        removed.append(name)
    if removed:
        log.info(
            "%s: removed %d folder(s) that writers before generation %d began and never committed (no %s): %s",
            store.uri,
            len(removed),
            generation,
            MANIFEST,
            ", ".join(removed[:10]) + (", ..." if len(removed) > 10 else ""),
        )
    return removed


def leftover(store: CheckpointStore, name: str, torn: set[str], newest_claim: int, named: str | None) -> str | None:
    """What verify prints for ``name`` when it is a leftover of a dead writer (see the module's docstring), else
    None. ``torn``: ``torn_folders``; ``newest_claim``: the run's newest claimed generation; ``named``: what
    ``latest`` names."""
    generation = generation_in_name(name)
    if name not in torn or name == named or generation is None or generation >= newest_claim:
        return None
    return (
        f"{name}: leftover of writer generation {generation}, which stopped before committing it (no {MANIFEST}; "
        f"generation {newest_claim} holds the run): never read; the next writer of this run removes it, or delete "
        f"the folder {store.storage.uri(f'{CHECKPOINTS}/{name}')}"
    )
