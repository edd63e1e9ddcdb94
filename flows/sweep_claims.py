"""A sweep's ledger is a claim to verify, not a fact: each unit it reports counts only when its checkpoint is there.

The ledger (checkpointing/ledger.py) is a file in the store, checksummed but not signed: whoever can write the store
can append an event with a correct sha256 that says a trial trained units it never trained, at checkpoints anywhere.
So when a sweep opens its ledger, every unit a ``segment_finished`` reported is checked against the store: its
checkpoint must be ``<sweep folder>/<one of the trial's own runs>/checkpoints/<name>`` (compared after
normalisation), readable through that run's ``CheckpointStore`` (which never follows a link below the sweep
folder), verify (manifest and every file's size), be a unit's checkpoint (not a snapshot inside one) at the unit,
step and samples the event says; and the unit's metrics the schedulers and the best trial read are the manifest's.

A unit that fails is not counted, and the sweep says so in one warning per trial naming the event file and why. A
trial whose state rests on units it does not have (``completed`` without the budget's units, ``paused`` short of its
segment's target) is pending again: its run resumes from its newest verified checkpoint, so real work is kept and
nothing unverified is reported. Refusing the whole sweep instead would strand every genuine trial behind one bad
event (events cannot be removed from the middle of a ledger), and skipping the check would report what never trained.
"""

from __future__ import annotations

from typing import Any

from checkpointing import CheckpointStore
from checkpointing.commit.committer import INTERMEDIATE
from checkpointing.io.storage import Storage
from checkpointing.io.untrusted import printable
from checkpointing.ledger import event_key
from flows.artifacts import unit_of
from training.start.store import store_retry
from training.sweep import Study, SweepConfig, Trial, checkpoint_key

LEDGER = "sweep"  # the ledger's prefix in the sweep folder (flows/sweep.py's Ledger)


def verify_claims(study: Study, config: SweepConfig, storage: Storage) -> list[str]:
    """Keeps in ``study`` only the units whose checkpoints verify in their trial's own runs, with the manifests'
    metrics, reopening trials that lack the units their state claims; the warnings to show, one per trial."""
    stores: dict[str, CheckpointStore] = {}
    warnings = []
    for trial in study.by_index():
        kept, refused = [], []
        for unit in trial.units:
            checked = _verified_unit(unit, trial, config, stores)
            if isinstance(checked, str):
                refused.append((unit, checked))
            else:
                kept.append(checked)
        was = trial.state
        trial.keep_units(kept, config.units_total())
        if refused or trial.state != was:
            warnings.append(_warning(trial, refused, was, storage))
    best = study.best(config.metric, config.mode)
    if study.finished is not None and study.finished.get("best_checkpoint") != (
        best[1]["checkpoint"] if best else None
    ):
        study.finished = None  # its best is not a verified unit: the sweep records its end again
    return warnings


def _verified_unit(
    unit: dict[str, Any], trial: Trial, config: SweepConfig, stores: dict[str, CheckpointStore]
) -> dict[str, Any] | str:
    """The unit as the store vouches for it, or why it does not count."""
    location = unit.get("checkpoint")
    key = checkpoint_key(location, config.sweep_folder, trial.runs())
    if key is None or unit.get("run_name") != key.split("/", 1)[0]:
        return f"that is not a checkpoint of its own run in {config.sweep_folder}/{trial.name}"
    run, name = key.split("/", 1)[0], key.rsplit("/", 1)[-1]
    if run not in stores:
        stores[run] = CheckpointStore(
            config.sweep_folder, run, storage_options=config.train.storage_options, retry=store_retry(config.train)
        )
    info = stores[run].info(name)
    if info is None:
        return "no checkpoint is there (no readable manifest.json)"
    problems = stores[run].check(info)
    if problems:
        return f"it does not verify ({problems[0]})"
    if info.manifest.metadata.get(INTERMEDIATE):
        return "it is a snapshot inside a unit, not a unit's checkpoint"
    progress = info.progress
    at = {
        "unit": unit_of(progress, config.train) + 1,
        "step": progress.get("step"),
        "samples_seen": progress.get("samples_seen"),
    }
    if any(unit.get(k) != v for k, v in at.items()):
        return f"its manifest is at unit {at['unit']}, step {at['step']}, {at['samples_seen']} samples"
    return {**unit, **at, "metrics": info.metrics, "checkpoint": info.uri}


def _warning(trial: Trial, refused: list[tuple[dict[str, Any], str]], was: str, storage: Storage) -> str:
    """One line: the event file, what it claims and why that does not hold, and what the sweep does instead."""
    if refused:
        unit, why = refused[0]
        seq = trial.claimed_in.get(int(unit["unit"]), -1)
        text = (
            f"says {trial.name} trained unit {unit['unit']} at {printable(str(unit.get('checkpoint')))[:300]!r}, but "
            f"{why}; {len(refused)} unit(s) of {trial.name} in the ledger have no verified checkpoint in its own run "
            f"folder and are not counted"
        )
    else:
        seq = trial.last_seq
        text = f"says {trial.name} is {was}, but it has {len(trial.units)} verified unit(s)"
    where = storage.uri(event_key(LEDGER, seq)) if seq >= 0 else f"the ledger {storage.uri(LEDGER)}"
    if trial.state != was:
        text += f"; it was {was}: it trains again from its newest verified checkpoint"
    return f"{where}: {text}"
