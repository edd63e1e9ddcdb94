"""Wait for a training flow run's real outcome: python -m deployments.outcome FLOW_RUN_ID [--timeout S].

Or start one and wait for it, where ``prefect deployment run NAME --params JSON --watch`` would stop at a crash:
python -m deployments.outcome --deployment NAME --params JSON [--timeout S].

``prefect deployment run --watch`` and ``run_deployment()`` stop at the first terminal state, and two of the states a
training run passes through on its way to Completed look terminal to them without being its outcome:

* **Crashed** — its machine died (SIGKILL, OOM, a lost node). The reconciler (deployments/recovery.py) reschedules it
  15-18 s later (a dead machine: once the heartbeat window marked it Crashed): the same flow run then resumes from
  its latest checkpoint. Crashed is the outcome only if it stays.
* A preempted run (SIGTERM) is rescheduled by itself as **Scheduled "Preempted"**, which ``--watch`` already waits
  through (it is not terminal).

So this waits until the flow run is Completed, Failed or Cancelled, or Crashed for longer than the restart would
take (``--crashed-for``), prints each state the run enters (one line each, on stderr; stdout is the outcome), and
exits 0 only for Completed. From Python::

    from prefect.deployments import run_deployment
    from deployments.outcome import wait_for_outcome

    run = run_deployment("train/default", parameters={"config": {...}}, timeout=0)  # returns at once
    state = wait_for_outcome(run.id)  # Completed, Failed, Cancelled, or a Crashed that was not restarted
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any
from uuid import UUID

if TYPE_CHECKING:
    from prefect.client.schemas.objects import State

FINAL = ("COMPLETED", "FAILED", "CANCELLED")
CRASHED_FOR_SECONDS = 600.0  # > the reconciler's grace and the default heartbeat window (3 x 180 s)


def wait_for_outcome(
    flow_run_id: UUID | str,
    *,
    timeout: float | None = None,
    crashed_for: float = CRASHED_FOR_SECONDS,
    poll_seconds: float = 2.0,
    on_state: Callable[[State], None] | None = None,
) -> State:
    """The flow run's outcome: its state once Completed, Failed or Cancelled, or Crashed for ``crashed_for`` seconds
    in a row (no restart came). TimeoutError after ``timeout`` seconds (None: no limit). ``on_state`` is called with
    each state the run is seen in (its first, then each change)."""
    from prefect.client.orchestration import get_client

    run_id = UUID(str(flow_run_id))
    deadline = None if timeout is None else time.monotonic() + timeout
    crashed_since: float | None = None
    seen: Any = None
    with get_client(sync_client=True) as client:
        while True:
            state = client.read_flow_run(run_id).state
            if on_state is not None and state is not None and state.id != seen:
                seen = state.id
                on_state(state)
            kind = state.type.value if state is not None else "PENDING"
            if state is not None and kind in FINAL:
                return state
            if kind == "CRASHED":
                crashed_since = crashed_since or time.monotonic()
                if state is not None and time.monotonic() - crashed_since >= crashed_for:
                    return state
            else:
                crashed_since = None
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"flow run {run_id} is still {state.name if state else kind} after {timeout:g} s")
            time.sleep(poll_seconds)


def start(deployment: str, parameters: dict[str, Any]) -> UUID:
    """Creates a flow run of ``deployment`` (``flow/deployment``) with ``parameters``; returns its id at once."""
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        found = client.read_deployment_by_name(deployment)
        run = client.create_flow_run_from_deployment(found.id, parameters=parameters)
    print(f"flow run {run.id} ({run.name}) of {deployment} created; waiting for its outcome, through any restart")
    return run.id


def say(state: State) -> None:
    note = " (the reconciler reschedules it; waiting)" if state.type.value == "CRASHED" else ""
    print(f"  {state.timestamp:%H:%M:%S} {state.name}{note}", file=sys.stderr, flush=True)  # stdout: the outcome


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m deployments.outcome", description=__doc__.splitlines()[0])
    parser.add_argument("flow_run_id", type=UUID, nargs="?", help="the id `prefect deployment run` printed")
    parser.add_argument("--deployment", help="start a run of this deployment (flow/deployment) first, and wait for it")
    parser.add_argument("--params", default="{}", help="with --deployment: the run's parameters, a JSON object")
    parser.add_argument("--timeout", type=float, default=None, help="give up after this many seconds (exit 3)")
    parser.add_argument(
        "--crashed-for",
        type=float,
        default=CRASHED_FOR_SECONDS,
        help="a Crashed state that lasts this long is the outcome (no restart came)",
    )
    args = parser.parse_args(argv)
    from prefect.exceptions import ObjectNotFound

    if (args.flow_run_id is None) == (args.deployment is None):
        parser.error("give a FLOW_RUN_ID to wait for, or --deployment NAME [--params JSON] to start one")
    run_id = args.flow_run_id
    if args.deployment is not None:
        try:
            parameters = json.loads(args.params)
        except json.JSONDecodeError as exc:
            parser.error(f'--params {args.params!r}: not JSON ({exc}); use e.g. \'{{"config": {{"run_name": "x"}}}}\'')
        if not isinstance(parameters, dict):
            parser.error(f"--params {args.params!r}: use a JSON object of the run's parameters")
        try:
            run_id = start(args.deployment, parameters)
        except ObjectNotFound:
            print(f"error: no deployment {args.deployment!r} on this server (prefect deployment ls)", file=sys.stderr)
            return 2
    try:
        state = wait_for_outcome(run_id, timeout=args.timeout, crashed_for=args.crashed_for, on_state=say)
    except TimeoutError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 3
    print(f"flow run {run_id}: {state.name}" + (f" ({state.message})" if state.message else ""))
    return 0 if state.type.value == "COMPLETED" else 1


if __name__ == "__main__":
    sys.exit(main())
