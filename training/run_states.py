"""The names of the orchestrator states this product sets and reads, spelled once.

Prefect shows a run's state by type (Scheduled, Cancelled, Crashed, ...) and name; these are the names of our own:
tasks and flows set them, the reconciler (deployments/recovery.py) reads them, and a state's events
are named after them (``prefect.flow-run.<name>``). Plain strings, so this module sits below every user and imports
nothing: training stays Prefect-free, and the reconciler does not pay for ``tasks``' torch import to read a name.
Tests keep their literal strings: they check the contract these names are.
"""

from __future__ import annotations

PREEMPTED = (
    "Preempted"  # a stop by signal: a Cancelled task run; a deployment run's Scheduled state, for the next worker
)
SUPERSEDED = "Superseded"  # a stop because a newer attempt took the run over (a Cancelled task run)
AWAITING_RESTART = "AwaitingRestart"  # Scheduled by the reconciler after a crash (deployments/recovery.py)
ATTEMPT_DIED = "AttemptDied"  # the Crashed state of a run an earlier attempt left unfinished (flows/restarts.py)


def flow_run_event(name: str) -> str:
    """The event Prefect emits when a flow run enters a state of this name."""
    return f"prefect.flow-run.{name}"
