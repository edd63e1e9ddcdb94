"""The Prefect side of training across machines: the unit task starts the other nodes as flow runs, and stops them.

With ``nnodes = N > 1`` the unit task's process is node 0 (training/distributed/gang.py). It hands the gang a launcher
from here, which creates N-1 runs of the rank-node deployment (flows/node.py) on the deployment's work pool —
a process, Docker or Kubernetes pool: its workers make each run a process, a container or a pod — each with
one signed offer (training/distributed/nodes.py) and the gang's config as parameters. Which deployment is the worker's
setting (``TRAIN_NODE_DEPLOYMENT``, default ``rank-node/default``), never a parameter's.

The node runs are created as children of the unit's task run: the UI shows them under it, and when the train
flow run is cancelled Prefect's server cancels them too. When the gang ends — its unit failed, or the run is
over — ``stop()`` cancels the node runs still going (their worker stops the process; the node flow takes its
torchrun down with it) and waits until each one has reached a final state.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any
from uuid import UUID

from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId
from prefect.client.schemas.objects import FlowRun
from prefect.exceptions import ObjectNotFound
from prefect.runtime import task_run
from prefect.states import Cancelling

from training.config import ConfigError

logger = logging.getLogger(__name__)

DEPLOYMENT_ENV = "TRAIN_NODE_DEPLOYMENT"
DEFAULT_DEPLOYMENT = "rank-node/default"
STOP_TIMEOUT = 60.0  # seconds for cancelled node runs to end (the worker's grace before SIGKILL is 30)


class PrefectNodeLauncher:
    """Node runs of one gang, as flow runs of the rank-node deployment (a ``training.distributed.nodes.NodeLauncher``)."""

    def __init__(self, deployment: str, parent_task_run_id: UUID | None = None):
        self.deployment, self.parent = deployment, parent_task_run_id
        self.runs: list[FlowRun] = []
        with get_client(sync_client=True) as client:
            try:
                self.deployment_id = client.read_deployment_by_name(deployment).id
            except ObjectNotFound:
                raise ConfigError(
                    f"nnodes > 1: the node deployment {deployment!r} ({DEPLOYMENT_ENV}) does not exist on the Prefect "
                    f"server at {client.api_url}; deploy it (make deploy: deployments/prefect.yaml) or set "
                    f"{DEPLOYMENT_ENV} in the worker's environment"
                ) from None

    def start(self, offers: list[dict[str, Any]], config: dict[str, Any]) -> None:
        with get_client(sync_client=True) as client:
            for offer in offers:
                self.runs.append(
                    client.create_flow_run_from_deployment(
                        self.deployment_id,
                        parameters={"offer": offer, "config": config},
                        name=f"{offer['run']}-g{offer['generation']}-node-{offer['node_rank']}-{offer['rdzv_id'][-6:]}",
                        tags=["rank-node"],
                        idempotency_key=f"{offer['rdzv_id']}-{offer['node_rank']}",
                        parent_task_run_id=self.parent,
                    )
                )
        logger.info(
            "started %d node run(s) of %s: %s", len(offers), self.deployment, ", ".join(run.name for run in self.runs)
        )

    def problem(self) -> str | None:
        for run in self._read():
            if run.state is not None and run.state.is_final():
                message = f": {run.state.message}" if run.state.message else ""
                return f"node run {run.name} ended {run.state.name}{message}"
        return None

    def stop(self, grace: float = 0.0) -> None:
        if not self.runs:
            return
        start = time.monotonic()
        cancelled: set[UUID] = set()
        with get_client(sync_client=True) as client:
            while True:
                going = [run for run in self._read(client) if run.state is None or not run.state.is_final()]
                if not going or time.monotonic() > start + grace + STOP_TIMEOUT:
                    break
                for run in going if time.monotonic() >= start + grace else []:
                    if run.id not in cancelled and not (run.state is not None and run.state.is_cancelling()):
                        # Not forced: a run that ended meanwhile keeps its state; a scheduled one becomes Cancelled.
                        client.set_flow_run_state(run.id, Cancelling(message="its gang ended"))
                        cancelled.add(run.id)
                time.sleep(0.5)
        if going:
            logger.warning(
                "node run(s) still not ended %.0f s after cancelling them: %s",
                STOP_TIMEOUT,
                ", ".join(f"{run.name} ({run.state.name if run.state else '?'})" for run in going),
            )
        elif cancelled:
            logger.info("cancelled %d node run(s) of the ended gang", len(cancelled))

    def _read(self, client: Any = None) -> list[FlowRun]:
        ids = FlowRunFilter(id=FlowRunFilterId(any_=[run.id for run in self.runs]))
        if client is not None:
            return client.read_flow_runs(flow_run_filter=ids)
        with get_client(sync_client=True) as own:
            return own.read_flow_runs(flow_run_filter=ids)


def node_launcher() -> PrefectNodeLauncher:
    """The launcher for a gang started by this task run, on the node deployment this worker names."""
    run_id = task_run.id
    return PrefectNodeLauncher(os.environ.get(DEPLOYMENT_ENV) or DEFAULT_DEPLOYMENT, UUID(run_id) if run_id else None)
