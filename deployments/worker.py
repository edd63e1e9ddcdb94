"""A process worker whose stop preempts its flow runs instead of killing them: ``python -m deployments.worker --pool
local-process`` (what ``make worker`` and the stack start).

``prefect worker start`` turns a SIGTERM into a SIGINT to itself; the supervision of its flow runs is cancelled, and
anyio SIGKILLs each flow-run process within a second. A machine shutting down signals the worker and the flow-run
process at once: the run's preemption never finished (no checkpoint at its step, no state set) and the run stayed
Running with no process until the heartbeat window passed (7+ minutes seen). A worker that is the container's
main process (``docker stop``, a Kubernetes eviction) is the only one signalled, and its runs died the same way.

This is Prefect's process worker with another stop. On SIGTERM or Ctrl-C it takes no new run, sends SIGTERM to each of
its flow-run processes (a preemption, training/preemption.py: a checkpoint at the next step, then the run reschedules
itself, Scheduled "Preempted", for the next worker), waits until they have left, and stops. A second SIGTERM is
logged and ignored; a second Ctrl-C (a person at the terminal) stops the runs at once, as Prefect's worker does. A run
still there after ``--stop-seconds`` is stopped that way too.

Two more differences. It reports a flow-run process's non-zero exit as Crashed only while the run is still in the
attempt that process ran (``should_report_exit``): Prefect's worker reports the exit again 20-40 s after the runner in
the process did, by which time the run was restarted, and that second Crashed landed on the restart (or on the next
attempt, alive). And it runs the reconciler (deployments/recovery.py), the one component that restarts a crashed run,
every few seconds beside the worker (``--no-reconciler`` to leave that to another process): two reconcilers at once
still make one restart.

And it outlives an API outage. Prefect's worker gives up after about a minute of failed polls (its
``critical_service_loop``: "Service exceeded error threshold"), and its exit takes its flow-run processes with it: a
PostgreSQL outage of 2 minutes (every request a 500) ended the worker at +47 s and SIGKILLed a run that was training
fine, which then stayed Running with no process while no reconciler ran (bench/fault_matrix.py, 2026-12-06). Here the
loop starts again each time it gives up (``outliving_service_loop``), polling at most every 8 intervals meanwhile.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import signal
import sys
import threading
from typing import Any
from uuid import UUID

import anyio
import anyio.abc
import prefect.workers.base
from prefect.client.schemas.objects import StateType
from prefect.utilities.services import critical_service_loop
from prefect.workers.process import ProcessWorker

from deployments import recovery

STOP_SECONDS = 60.0  # more than a run's preemption_grace_seconds (25 by default): its checkpoint, then its exit
DESCRIPTION = "Prefect's process worker, whose stop (SIGTERM, Ctrl-C) preempts its flow runs instead of killing them."
say = functools.partial(print, flush=True)  # the worker's own lines, beside Prefect's (which `prefect worker` prints)


class PreemptingProcessWorker(ProcessWorker):
    """Prefect's process worker that knows its flow-run processes and takes no new run once it is stopping."""

    @classmethod
    def __dispatch_key__(cls) -> str:
        return "process-preempting"  # its own entry in Prefect's registry of worker types; it serves "process" pools

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.stopping = False
        self.runs: dict[UUID, int | None] = {}  # flow run -> its process, while this worker runs it
        self.attempts: dict[UUID, int] = {}  # flow run -> the attempt (run_count) its process runs

    async def get_and_submit_flow_runs(self) -> list[Any]:
        return [] if self.stopping else await super().get_and_submit_flow_runs()

    async def run(self, flow_run: Any, configuration: Any, task_status: Any = None) -> Any:
        self.runs[flow_run.id] = None
        self.attempts[flow_run.id] = (flow_run.run_count or 0) + 1  # the engine counts the run as it starts
        started = _Started(self.runs, flow_run.id, task_status or anyio.TASK_STATUS_IGNORED)
        try:
            return await super().run(flow_run, configuration, started)
        finally:
            self.runs.pop(flow_run.id, None)

    async def _propose_crashed_state(self, flow_run: Any, message: str, client: Any = None) -> None:
        """Prefect's report of a process's non-zero exit, made only while the run is still in that attempt."""
        attempt = self.attempts.pop(flow_run.id, (flow_run.run_count or 0) + 1)
        try:
            current = await (client or self.client).read_flow_run(flow_run.id)
        except Exception as exc:  # the API is down: Prefect's own report would fail the same way
            say(f"flow run {flow_run.id}: could not read its state before reporting its exit ({exc})")
            current = None
        if current is not None and not should_report_exit(attempt, current.run_count, current.state_type):
            say(f"flow run {flow_run.id}: {message.split('.')[0]}: already recorded ({current.state_name}, run "
                f"{current.run_count}); not reported again")  # fmt: skip
            return
        await super()._propose_crashed_state(flow_run, message, client=client)


def should_report_exit(attempt: int, run_count: int, state_type: StateType | None) -> bool:
    """Whether the exit of the process that ran ``attempt`` is news: the run is still Running that attempt, or still
    Pending with it (the process died before its engine started). Anything else (Crashed, Scheduled for a restart, a
    newer attempt, an end state) means the exit was recorded, or no longer matters."""
    if state_type == StateType.RUNNING:
        return run_count == attempt
    if state_type == StateType.PENDING:
        return run_count == attempt - 1
    return False


class _Started:
    """The task status a run reports its process id to: kept here, then passed on to Prefect."""

    def __init__(self, runs: dict[UUID, int | None], flow_run_id: UUID, inner: anyio.abc.TaskStatus[Any]):
        self.runs, self.flow_run_id, self.inner = runs, flow_run_id, inner

    def started(self, value: Any = None) -> None:
        if isinstance(value, int):
            self.runs[self.flow_run_id] = value
        self.inner.started(value)


async def outliving_service_loop(workload: Any, interval: float, *args: Any, **kwargs: Any) -> None:
    """Prefect's ``critical_service_loop``, started again whenever it exceeds its error threshold (the API or its
    database is down): the worker keeps its flow runs through an outage and polls again once the API answers."""
    while True:
        try:
            return await critical_service_loop(workload, interval, *args, **kwargs)
        except RuntimeError as exc:
            if "error threshold" not in str(exc):
                raise
            say(f"the Prefect API keeps failing ({getattr(workload, '__name__', workload)}): the worker and its flow "
                "runs stay; trying again")  # fmt: skip


def outlive_api_outages() -> None:
    """The worker's polling and sync loops (prefect.workers.base) outlive an API outage (``outliving_service_loop``)."""
    prefect.workers.base.critical_service_loop = outliving_service_loop


async def preempt_runs(worker: PreemptingProcessWorker, seconds: float) -> None:
    """SIGTERM to each flow-run process (also to one that starts meanwhile); returns once none is left, or after
    ``seconds``."""
    signalled: set[int] = set()
    with anyio.move_on_after(seconds):
        while worker.runs:
            for pid in {p for p in worker.runs.values() if p is not None} - signalled:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGTERM)
                signalled.add(pid)
            await anyio.sleep(0.2)
    if worker.runs:
        say(f"{len(worker.runs)} flow run(s) still running after {seconds:g} s: stopping them now")


async def serve(worker: PreemptingProcessWorker, stop_seconds: float = STOP_SECONDS) -> None:
    """Runs ``worker`` until a signal, then stops it as the module docstring says."""

    async def stop() -> None:
        await preempt_runs(worker, stop_seconds)
        group.cancel_scope.cancel()

    with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async with anyio.create_task_group() as group:
            group.start_soon(functools.partial(worker.start, printer=say))
            async for signum in signals:
                name = signal.Signals(signum).name
                if not worker.stopping:
                    worker.stopping = True
                    running = len(worker.runs)
                    say(
                        f"{name}: taking no new flow run; asking the {running} running to stop (SIGTERM: a checkpoint, "
                        "then each reschedules itself), then stopping"
                    )
                    group.start_soon(stop)
                elif signum == signal.SIGINT:
                    say("Ctrl-C again: stopping the flow runs now, without their checkpoints")
                    break
                else:
                    say(f"{name} ignored: the worker is already stopping, once its flow runs have left")
            group.cancel_scope.cancel()  # a second Ctrl-C: Prefect's own stop kills what is left
    say(f"Worker {worker.name!r} stopped!")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m deployments.worker", description=DESCRIPTION)
    parser.add_argument("--pool", required=True, help="the work pool (of type process) to take flow runs from")
    parser.add_argument("--name", default=None, help="the worker's name (default: Prefect's)")
    parser.add_argument("--limit", type=int, default=None, help="the most flow runs at once")
    wait = f"how long a stop waits for the flow runs to leave (default {STOP_SECONDS:g})"
    parser.add_argument("--stop-seconds", type=float, default=STOP_SECONDS, help=wait)
    parser.add_argument(
        "--no-reconciler", action="store_true", help="do not restart crashed runs here (deployments/recovery.py)"
    )
    args = parser.parse_args(argv)
    worker = PreemptingProcessWorker(work_pool_name=args.pool, name=args.name, limit=args.limit)
    outlive_api_outages()
    stop = threading.Event()
    if not args.no_reconciler:
        names = list(recovery.DEFAULT_DEPLOYMENTS)
        thread = threading.Thread(target=recovery.reconcile_forever, args=(names,), kwargs={"stop": stop}, daemon=True)
        thread.start()
    try:
        anyio.run(serve, worker, args.stop_seconds)
    finally:
        stop.set()
    return 0


if __name__ == "__main__":
    sys.exit(main())
