"""The training deployments' liveness window, and why they install no automation (DESIGN.md section 6).

One component decides a run's fate: the reconciler (deployments/recovery.py). It reads each run's current state,
marks Crashed a Running deployment run whose heartbeats stopped (its machine died and nothing is left to report it),
and restarts a Crashed run once. Prefect's automations act on events as they were, never on the run as it is, so
none of the three this module used to install is left:

- ``training: crashed -> restart`` and ``training: crash not restarted -> restart`` rescheduled a run that had
  Completed in the meantime (a Crashed event held ~15 minutes after a server restart, or re-read after a
  ``database is locked`` bucket insert), and the worker's late second Crashed report of one death opened a second
  restart window;
- ``training: heartbeat lost -> crashed`` marked live runs Crashed: its window ran while the server could store no
  event (a database outage, a SQLite write lock held by another process), and when the database took writes again it
  found the run silent, while it trained. In the fault matrix (bench/fault_matrix.py, 2026-12-06) 3 of 4 database
  outages and 1 of 2 ``database is locked`` runs ended Running, Crashed, Completed that way. The reconciler counts
  silence only from when the server stores events again (its ``Vigil``), which an automation cannot see.

Installing deletes those automations where an older install left them, and stores the heartbeat window the
reconciler uses (``--within``; default 3x the deployments' heartbeat frequency) as the Prefect variable
``training_heartbeat_window_seconds``, read by every reconciler of the server (the product's worker's, the stack's,
``python -m deployments.recovery``). Idempotent:

    python -m deployments.automations --within 90
"""

from __future__ import annotations

import argparse
import logging
import math
import sys

from prefect.client.orchestration import SyncPrefectClient, get_client
from prefect.client.schemas.actions import VariableCreate, VariableUpdate
from prefect.client.schemas.responses import DeploymentResponse
from prefect.settings import get_current_settings

HEARTBEAT_LOST = "training: heartbeat lost -> crashed"  # removed: the reconciler marks silent runs (see above)
RESTART_CRASHED = "training: crashed -> restart"  # removed: deployments/recovery.py restarts (see above)
RESTART_MISSED = "training: crash not restarted -> restart"  # removed, as RESTART_CRASHED
OBSOLETE = (HEARTBEAT_LOST, RESTART_CRASHED, RESTART_MISSED)
DEFAULT_DEPLOYMENTS = ("train/default", "retrain/nightly", "sweep/default")
HEARTBEAT_SETTING = "PREFECT_FLOWS_HEARTBEAT_FREQUENCY"
MIN_HEARTBEAT_SECONDS = 30  # Prefect's own floor for the heartbeat frequency
WINDOW_VARIABLE = "training_heartbeat_window_seconds"
MAX_WINDOW_SECONDS = 7 * 24 * 3600.0  # a window longer than a week is a typo: no dead machine would ever be found

logger = logging.getLogger("deployments.automations")
_SAID: set[tuple[object, str]] = set()  # bad heartbeat values already said: a reconciler reads them every pass


def heartbeat_seconds(deployments: list[DeploymentResponse]) -> int:
    """The heartbeat frequency the deployments' runs use: their job variables' env, else this process's setting."""
    values = [value for d in deployments if (value := deployment_heartbeat(d)) is not None]
    setting = get_current_settings().flows.heartbeat_frequency or 180
    return max(max(values, default=setting), MIN_HEARTBEAT_SECONDS)


def deployment_heartbeat(deployment: DeploymentResponse) -> int | None:
    """Every how many seconds the deployment's runs send a heartbeat, if its job variables' env sets it
    (deployments/prefect.yaml does, for every deployment of the product). Anyone with the API can write job
    variables: a value that is not a positive whole number is said, and counts as no heartbeat."""
    env = (deployment.job_variables or {}).get("env")
    value = env.get(HEARTBEAT_SETTING) if isinstance(env, dict) else None
    if value is None or value == "":
        return None
    text = str(value).strip()
    if not text.isdigit() or int(text) == 0:
        if (deployment.id, text) in _SAID:
            return None
        _SAID.add((deployment.id, text))
        logger.warning(
            "deployment %s: job variable env.%s=%r is not a positive whole number of seconds; its runs are "
            "judged as runs without heartbeats", deployment.name, HEARTBEAT_SETTING, value,
        )  # fmt: skip
        return None
    return int(text)


def sends_heartbeats(deployment: DeploymentResponse) -> bool:
    return deployment_heartbeat(deployment) is not None


def window_problem(value: object, frequency: float) -> str | None:
    """Why ``value`` cannot be the heartbeat window for runs that beat every ``frequency`` seconds, or None."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        return f"{value!r} is not a number of seconds"
    if value <= frequency:
        return f"{value}s does not exceed the heartbeat frequency ({frequency:.0f}s): every healthy run would be marked Crashed"
    if value > MAX_WINDOW_SECONDS:
        return f"{value}s is longer than a week: a dead machine would never be found"
    return None


def window_seconds(client: SyncPrefectClient, deployments: list[DeploymentResponse]) -> float:
    """The heartbeat window: the server's ``training_heartbeat_window_seconds`` where it holds a valid one (anyone
    with the API can write it: checked, and a bad one is said and not used), else 3x the heartbeat frequency."""
    frequency = heartbeat_seconds(deployments)
    variable = client.read_variable_by_name(WINDOW_VARIABLE)
    if variable is not None:
        problem = window_problem(variable.value, frequency)
        if problem is None:
            return float(variable.value)  # type: ignore[arg-type]  # a number: window_problem checked it
        logger.warning(
            "Prefect variable %s: %s; using 3x the heartbeat frequency (%ds) instead. Fix: "
            "python -m deployments.automations --within SECONDS",
            WINDOW_VARIABLE, problem, 3 * frequency,
        )  # fmt: skip
    return 3.0 * frequency


def install(deployment_names: list[str], within_seconds: float | None = None) -> float:
    """Stores the heartbeat window for these deployments (``flow/deployment`` names; default 3x their heartbeat
    frequency) and deletes the automations an older install left; returns the window."""
    with get_client(sync_client=True) as client:
        frequency = heartbeat_seconds([client.read_deployment_by_name(name) for name in deployment_names])
        within = within_seconds if within_seconds is not None else 3.0 * frequency
        problem = window_problem(within, frequency)
        if problem is not None:
            raise ValueError(f"--within {within}: {problem}; use about 3x the frequency ({3 * frequency}s)")
        if client.read_variable_by_name(WINDOW_VARIABLE) is None:
            client.create_variable(VariableCreate(name=WINDOW_VARIABLE, value=within))
        else:
            client.update_variable(VariableUpdate(name=WINDOW_VARIABLE, value=within))
        for name in OBSOLETE:
            for automation in client.read_automations_by_name(name=name):
                client.delete_automation(automation.id)
    return within


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m deployments.automations", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--deployment",
        action="append",
        dest="deployments",
        help=f"flow/deployment whose heartbeat frequency sizes the default window (repeatable; default: {DEFAULT_DEPLOYMENTS})",
    )
    parser.add_argument(
        "--within",
        type=float,
        default=None,
        help="seconds without a heartbeat before the reconciler marks a deployment run Crashed (default: 3x heartbeat)",
    )
    args = parser.parse_args(argv)
    try:
        within = install(args.deployments or list(DEFAULT_DEPLOYMENTS), args.within)
    except ValueError as bad:
        print(f"python -m deployments.automations: {bad}", file=sys.stderr)
        return 2
    print(
        f"heartbeat window {within:.0f}s (Prefect variable {WINDOW_VARIABLE}): the reconciler marks a deployment run "
        f"silent that long Crashed and restarts it once (deployments/recovery.py); no automation installed"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
