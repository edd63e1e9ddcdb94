"""Wait for a training flow run's real outcome: python -m deployments.outcome FLOW_RUN_ID [--timeout S].

``prefect deployment run --watch`` and ``run_deployment()`` stop at the first terminal state, and two of the states a
training run passes through on its way to Completed look terminal to them without being its outcome:

* **Crashed** — its machine died (SIGKILL, OOM, a lost node). The restart automation (deployments/automations.py)
  reschedules it within ``RESTART_DEBOUNCE_SECONDS`` (or, if that report was swallowed, within the heartbeat
  window): the same flow run then resumes from its latest checkpoint. Crashed is the outcome only if it stays.
* A preempted run (SIGTERM) is rescheduled by itself as **Scheduled "Preempted"**, which ``--watch`` already waits
  through (it is not terminal).

So this waits until the flow run is Completed, Failed or Cancelled, or Crashed for longer than the restart would
take (``--crashed-for``), and exits 0 only for Completed. From Python::

    from prefect.deployments import run_deployment
    from deployments.outcome import wait_for_outcome

    run = run_deployment("train/default", parameters={"config": {...}}, timeout=0)  # returns at once
    state = wait_for_outcome(run.id)  # Completed, Failed, Cancelled, or a Crashed that was not restarted
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import TYPE_CHECKING
from uuid import UUID

if TYPE_CHECKING:
    from prefect.client.schemas.objects import State

FINAL = ("COMPLETED", "FAILED", "CANCELLED")
CRASHED_FOR_SECONDS = 600.0  # > RESTART_DEBOUNCE_SECONDS and the default heartbeat window (3 x 180 s)


def wait_for_outcome(
    flow_run_id: UUID | str,
    *,
    timeout: float | None = None,
    crashed_for: float = CRASHED_FOR_SECONDS,
    poll_seconds: float = 2.0,
) -> State:
    """The flow run's outcome: its state once Completed, Failed or Cancelled, or Crashed for ``crashed_for`` seconds
    in a row (no restart came). TimeoutError after ``timeout`` seconds (None: no limit)."""
    from prefect.client.orchestration import get_client

    run_id = UUID(str(flow_run_id))
    deadline = None if timeout is None else time.monotonic() + timeout
    crashed_since: float | None = None
    with get_client(sync_client=True) as client:
        while True:
            state = client.read_flow_run(run_id).state
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m deployments.outcome", description=__doc__.splitlines()[0])
    parser.add_argument("flow_run_id", type=UUID, help="the id `prefect deployment run` printed")
    parser.add_argument("--timeout", type=float, default=None, help="give up after this many seconds (exit 3)")
    parser.add_argument(
        "--crashed-for",
        type=float,
        default=CRASHED_FOR_SECONDS,
        help="a Crashed state that lasts this long is the outcome (no restart came)",
    )
    args = parser.parse_args(argv)
    try:
        state = wait_for_outcome(args.flow_run_id, timeout=args.timeout, crashed_for=args.crashed_for)
    except TimeoutError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 3
    print(f"flow run {args.flow_run_id}: {state.name}" + (f" ({state.message})" if state.message else ""))
    return 0 if state.type.value == "COMPLETED" else 1


if __name__ == "__main__":
    sys.exit(main())
