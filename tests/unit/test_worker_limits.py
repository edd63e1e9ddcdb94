"""What one deployment run may start is the worker's to say: processes per machine and machines are capped by the
worker's environment, checked before the run is claimed; a person's own command line is not capped."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from training.config import ConfigError
from training.distributed.node_run import run_node
from training.distributed.nodes import NodeOffer
from training.run import Run


@pytest.fixture
def worker(tmp_path, monkeypatch):
    """A worker whose allowed root holds the test's save folder."""
    monkeypatch.setenv("TRAIN_ALLOWED_ROOTS", str(tmp_path))
    return monkeypatch


def test_a_deployment_run_asking_more_processes_per_machine_than_the_worker_allows_is_refused_unclaimed(
    make_config, worker
):
    worker.setenv("TRAIN_MAX_NPROC_PER_NODE", "2")
    config = make_config(nproc_per_node=3)
    with pytest.raises(ConfigError) as info:
        Run.open(config, untrusted=True)
    assert str(info.value) == (
        "nproc_per_node=3 is more than this worker allows for one run (2, TRAIN_MAX_NPROC_PER_NODE in the worker's "
        "environment); ask for at most 2, or ask the worker's operator to raise TRAIN_MAX_NPROC_PER_NODE"
    )
    assert not Path(config.save_folder).exists()  # nothing claimed, nothing written


def test_a_deployment_run_asking_more_machines_than_the_worker_allows_is_refused(make_config, worker):
    worker.setenv("TRAIN_MAX_NNODES", "3")
    with pytest.raises(
        ConfigError, match=r"^nnodes=4 is more than this worker allows for one run \(3, TRAIN_MAX_NNODES"
    ):
        Run.open(make_config(nnodes=4), untrusted=True)
    worker.delenv("TRAIN_MAX_NNODES")
    with pytest.raises(ConfigError, match=r"^nnodes=100000 .* \(8, TRAIN_MAX_NNODES in the worker's environment, by "):
        Run.open(make_config(nnodes=100_000), untrusted=True)


def test_unset_the_processes_per_machine_are_capped_at_the_machines_cpus(make_config, worker):
    cpus = len(os.sched_getaffinity(0))  # this machine has no GPU (FACTS.md)
    with pytest.raises(ConfigError) as info:
        Run.open(make_config(nproc_per_node=1024), untrusted=True)
    assert str(info.value).startswith(
        f"nproc_per_node=1024 is more than this worker allows for one run ({cpus}, TRAIN_MAX_NPROC_PER_NODE in the "
        f"worker's environment, by default)"
    )


def test_a_cap_that_is_no_number_is_one_line_naming_the_variable(make_config, worker):
    worker.setenv("TRAIN_MAX_NNODES", "lots")
    with pytest.raises(
        ConfigError, match=r"^TRAIN_MAX_NNODES='lots' in the worker's environment is not a whole number"
    ):
        Run.open(make_config(), untrusted=True)


def test_a_persons_own_run_is_not_capped(make_config, worker):
    worker.setenv("TRAIN_MAX_NPROC_PER_NODE", "1")
    with Run.open(make_config(nproc_per_node=2)) as run:
        assert run.generation == 1


def test_a_node_run_refuses_more_processes_than_its_own_worker_allows_before_starting_any(make_config, worker):
    worker.setenv("TRAIN_MAX_NPROC_PER_NODE", "1")
    config = make_config(nnodes=2, nproc_per_node=2)
    offer = NodeOffer(endpoint="127.0.0.1:1", rdzv_id="r" * 16, nnodes=2, node_rank=1, nproc_per_node=2, run="r",
                      generation=1, config_sha256="0" * 64, expires=0)  # fmt: skip
    with pytest.raises(ConfigError, match=r"^nproc_per_node=2 is more than this worker allows for one run \(1, "):
        run_node(offer, config)
