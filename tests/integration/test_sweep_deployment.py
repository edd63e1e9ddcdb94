"""The sweep deployment (deployments/prefect.yaml's `sweep/default`), end to end on a real Prefect server and process
worker (tests/integration/conftest.py): a run of it trains its trials, each a `train` flow run of its own, and leaves
its best trial in the ledger and its table of trials on its flow run. Then the trust boundary, through the same
worker: a sweep's parameters are the door, so a recipe the worker does not allow, storage options, and a load_path
outside the worker's TRAIN_ALLOWED_ROOTS are refused before any trial trains.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path
from uuid import UUID

import pytest
from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterName
from prefect.client.schemas.objects import FlowRun, StateType

from checkpointing import Ledger
from checkpointing.io.storage import Storage
from flows.sweep_report import SweepReport
from tests.integration.stack_client import SYNTHETIC, artifact, client, start_run, wait_for_state
from training.sweep import SweepConfig

pytestmark = [pytest.mark.slow, pytest.mark.system, pytest.mark.timeout(900)]

DEPLOYMENT = "sweep/default"
TRIALS = ["t000", "t001"]


def sweep_config(sweep_name: str, folder: Path, **train) -> dict:
    """Two trials of the synthetic recipe (a grid of two learning rates), one epoch each, both at once; trials
    evaluate after every unit by themselves (SweepConfig.trial_config), so eval_accuracy is there to compare."""
    base = {**SYNTHETIC, "max_duration": "1ep", "save_folder": str(folder)}
    return {
        "sweep_name": sweep_name,
        "space": {"recipe_args.lr": {"grid": [0.01, 0.05]}},
        "max_concurrent_trials": 2,
        "metric": "eval_accuracy",
        "mode": "max",
        "train": {**base, "recipe_args": {"num_samples": 256}, **train},
    }


def train_runs_in(stack, folder: Path) -> list[FlowRun]:
    """The `train` flow runs whose run lives in ``folder`` (a sweep's folder): its trials."""
    with client(stack) as c:
        runs = c.read_flow_runs(flow_run_filter=FlowRunFilter(name=FlowRunFilterName(any_=TRIALS)))
        train_flow = c.read_flow_by_name("train").id
    return [r for r in runs if r.flow_id == train_flow and r.parameters["config"]["save_folder"] == str(folder)]


def ledger_events(folder: Path) -> list:
    return Ledger(Storage(str(folder))).read()


# -- tests ----------------------------------------------------------------------------------------
def test_a_sweep_deployment_run_trains_its_trials_as_train_flow_runs_and_shows_its_table(prefect_stack, tmp_path):
    folder = tmp_path / "runs"
    config = sweep_config("deployed", folder)
    run_id = start_run(prefect_stack, DEPLOYMENT, {"config": config})

    run = wait_for_state(prefect_stack, run_id, StateType.COMPLETED, timeout=420)

    assert run.deployment_id is not None and run.name == "deployed"
    sweep = folder / "deployed"
    events = ledger_events(sweep)
    finished = [e.body for e in events if e.kind == "sweep_finished"]
    assert len(finished) == 1 and finished[0]["best_trial"] in TRIALS  # what SweepResult.best_trial is folded from
    best = finished[0]["best_checkpoint"]
    assert best.startswith(f"{sweep}/{finished[0]['best_trial']}/checkpoints/ep1-"), best
    assert sorted(e.body["trial"] for e in events if e.kind == "trial_completed") == TRIALS
    # each trial is a train flow run of its own (not the sweep's flow run), Completed, training its own run
    trials = train_runs_in(prefect_stack, sweep)
    assert sorted(r.name for r in trials) == TRIALS, trials
    assert all(r.state.type == StateType.COMPLETED and r.id != run_id for r in trials), trials
    assert {r.parameters["config"]["recipe_args"]["lr"] for r in trials} == {0.01, 0.05}
    # the sweep's flow run holds the table of trials and their curves (keys from flows/sweep_report.py)
    cards = SweepReport(SweepConfig(**config), str(sweep))
    assert cards.table.key.startswith("sweep-deployed-"), cards.table.key
    card = artifact(prefect_stack, cards.table.key)
    assert card.flow_run_id == run_id
    table = json.loads(card.data)
    assert [(row["trial"], row["state"], row["run"], row["units"]) for row in table] == [
        ("t000", "completed", "t000", 1),
        ("t001", "completed", "t001", 1),
    ], table
    assert all(isinstance(row["eval_accuracy"], float) for row in table), table
    assert "| t000 |" in artifact(prefect_stack, cards.curves.key).data


def test_a_sweep_run_parameter_cannot_choose_code_storage_options_or_a_load_path_outside_the_roots(
    prefect_stack, tmp_path
):
    """Anyone who may create a flow run of the sweep deployment sets its parameters through the API: the sweep refuses
    what a training run refuses, before it writes its ledger or starts a trial."""
    marker = tmp_path / "evil-marker"
    outside = Path(tempfile.mkdtemp(prefix="other-team-"))  # outside every root of the worker
    try:
        (outside / "weights.pt").write_bytes(b"not read")
        hostile = {
            "recipe": sweep_config("s-recipe", tmp_path / "recipe", recipe="tests.evil_recipe:NotARecipe",
                                   recipe_args={"path": str(marker)}),
            "storage": sweep_config("s-storage", tmp_path / "storage",
                                    storage_options={"client_kwargs": {"endpoint_url": "http://169.254.169.254"}}),
            "load_path": sweep_config("s-load", tmp_path / "load", load_path=str(outside / "weights.pt")),
        }  # fmt: skip
        runs: dict[str, UUID] = {
            name: start_run(prefect_stack, DEPLOYMENT, {"config": config}) for name, config in hostile.items()
        }

        ended = {name: wait_for_state(prefect_stack, run_id, StateType.FAILED) for name, run_id in runs.items()}

        assert "recipe='tests.evil_recipe:NotARecipe' is not allowed on this worker" in ended["recipe"].state.message
        assert not marker.exists()
        assert not (prefect_stack.logs / "evil-module-was-imported").exists()  # not even imported
        assert "storage_options cannot be set through a flow-run parameter" in ended["storage"].state.message
        # load_path: the trials of a deployment run's sweep are opened as untrusted (tasks/trial.py UNTRUSTED_ENV,
        # flows/restarts.parameters_untrusted) and would refuse it in the trial; the sweep refuses it first, for the
        # base run every trial inherits (flows/sweep.py: confine_locations(config.train)), so no trial ever starts.
        roots_line = f"load_path={str(outside / 'weights.pt')!r} is outside the locations this worker allows"
        assert roots_line in ended["load_path"].state.message
        assert all("\n" not in run.state.message for run in ended.values())
        for name in hostile:  # no ledger, no trial run folder, no train flow run: nothing trained
            assert not (tmp_path / name).exists(), name
        for name, config in hostile.items():
            assert not train_runs_in(prefect_stack, tmp_path / name / config["sweep_name"]), name
        assert sorted(p.name for p in outside.iterdir()) == ["weights.pt"]  # nothing written outside the roots
    finally:
        shutil.rmtree(outside)
