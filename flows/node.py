"""The rank-node flow: one machine's share of a unit that trains across machines (``nnodes > 1``).

Nobody starts it by hand: the unit task of a train flow run (node 0) creates one run of the ``rank-node``
deployment per other node (tasks/nodes.py), on the same work pool, so that the pool's workers put each node on a
machine of their own. Its parameters — an offer and the gang's config — come through the API, where anyone who
may create runs can write them; so the first thing it does is verify that node 0 of this pool signed the offer
for this very config (training/distributed/nodes.py, with this worker's ``TRAIN_NODE_SECRET``). A forged, expired or unsigned
offer ends the run Failed with one line, before anything is started or connected to.
"""

import os
import sys
from typing import Any

from prefect import flow
from prefect.logging import get_run_logger
from prefect.states import Failed, State
from pydantic import ValidationError

from flows import ship_module_logs
from training.config import ConfigError, TrainConfig, describe_error
from training.distributed.node_run import run_node
from training.distributed.nodes import SECRET_ENV, verify_offer
from training.exceptions import OfferRefused


@flow(name="rank-node", validate_parameters=True)
def rank_node(offer: dict[str, Any], config: dict[str, Any]) -> str | State:
    """Joins node 0's rendezvous as the offer's node rank and runs its ranks until the gang ends."""
    logger = get_run_logger()
    ship_module_logs()  # torchrun's lines, relayed by training.distributed.node_run, are this run's logs
    try:
        accepted = verify_offer(offer, config, os.environ.get(SECRET_ENV))  # before anything else
        train_config = TrainConfig(**config)
    except (OfferRefused, ConfigError, ValidationError) as refused:
        line = describe_error(refused) if isinstance(refused, ValidationError) else str(refused)
        logger.error("%s", line)
        return Failed(message=line)
    return run_node(accepted, train_config)


if __name__ == "__main__":
    sys.exit("flows/node.py is started by the train flow's unit task as a deployment run, not by hand")
