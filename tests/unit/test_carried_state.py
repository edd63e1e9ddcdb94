"""What a full checkpoint carries into a run (optimizer state, progress) is typed and checked against the run before
anything is claimed: one ConfigError naming the parameter and the entry or counter, never torch's error at the first
step after the run was claimed (and retried)."""

from __future__ import annotations

import copy
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from checkpointing import CheckpointStore, Writer
from training.config import ConfigError
from training.run import Run
from training.start.optimizer_state import check_entries, check_groups
from training.unit.loop import run_unit

FIX = "set load_weights_only=true to take the weights alone"
ROOT = Path(__file__).resolve().parents[2]


def train_to_end(config) -> None:
    with Run.open(config) as run:
        while not run.complete:
            run.record(run_unit(config, start_checkpoint=run.head, generation=run.generation))


def forged(make_config, change, run_name: str = "forged") -> str:
    """Run 'a' of the synthetic recipe (SGD with momentum) for 2 epochs, then its last checkpoint's state with
    ``change(state, progress)`` applied, committed by the real store as run ``run_name``; returns that run's folder."""
    a = make_config(run_name="a", max_duration="2ep")
    train_to_end(a)
    loaded = CheckpointStore(a.save_folder, "a").load_latest(["state.pt"])
    obj, progress = copy.deepcopy(loaded.objects["state.pt"]), dict(loaded.info.progress)
    change(obj["state"], progress)
    obj["progress"] = progress
    store = CheckpointStore(a.save_folder, run_name)
    store.save(loaded.info.name, {"state.pt": obj}, progress=progress, writer=Writer.current(1))
    return f"{a.save_folder}/{run_name}"


def set_momentum(value):
    def change(state, progress):
        state["optimizer"]["state"][0]["momentum_buffer"] = value

    return change


@pytest.mark.parametrize(
    "value, found",
    [
        (torch.tensor(1.0), "a tensor of shape [], not [32, 16] (the parameter's shape)"),
        ("x" * 50, "a string, not a tensor of shape [32, 16]"),
        ([1.0, 2.0], "a list, not a tensor of shape [32, 16]"),
    ],
    ids=["0-dim", "string", "list"],
)
def test_a_momentum_buffer_that_is_no_tensor_of_its_parameters_shape_is_refused_before_the_run_is_claimed(
    make_config, value, found
):
    load_path = forged(make_config, set_momentum(value))
    b = make_config(run_name="b", max_duration="4ep", load_path=load_path)
    with pytest.raises(ConfigError) as info:
        Run.open(b)
    assert str(info.value) == (
        f"load_path={load_path!r} (ep2-ba16-sa512): its optimizer state does not fit the recipe's SGD: for parameter "
        f"'0.weight', momentum_buffer is {found}; {FIX}"
    )
    assert "x" * 50 not in str(info.value)  # the file's own text is not repeated
    assert not (Path(b.save_folder) / "b").exists()  # nothing claimed, nothing written


def test_a_sample_in_epoch_past_the_samples_seen_is_refused_before_the_run_is_claimed(make_config):
    def change(state, progress):
        progress.update(epoch=0, step=2, samples_seen=64, sample_in_epoch=200)

    load_path = forged(make_config, change)
    b = make_config(run_name="b", max_duration="4ep", load_path=load_path)
    with pytest.raises(ConfigError) as info:
        Run.open(b)
    assert str(info.value) == (
        f"load_path={load_path!r} (ep2-ba16-sa512): its progress does not fit: sample_in_epoch=200 is more than "
        f"samples_seen=64, the samples trained; {FIX} and count from zero"
    )
    assert not (Path(b.save_folder) / "b").exists()


def test_a_resume_whose_position_is_past_the_end_of_the_epoch_is_refused_before_the_run_is_claimed(make_config):
    def change(state, progress):
        progress.update(sample_in_epoch=612, samples_seen=1124)

    forged(make_config, change, run_name="a2")
    a2 = make_config(run_name="a2", max_duration="4ep")
    generations = CheckpointStore(a2.save_folder, "a2").fence.newest()
    with pytest.raises(ConfigError) as info:
        Run.open(a2)
    assert str(info.value).startswith(
        "run 'a2': its newest checkpoint ep2-ba16-sa512: its progress does not fit: sample_in_epoch=612 is past the "
        "end of an epoch of this run's data (256 samples); go back to an earlier checkpoint with resume_from=<name>"
    )
    assert CheckpointStore(a2.save_folder, "a2").fence.newest() == generations  # not claimed


def test_a_resumed_run_whose_momentum_is_0_dim_fails_in_one_config_error_not_at_the_first_step(make_config):
    forged(make_config, set_momentum(torch.tensor(1.0)), run_name="a2")
    a2 = make_config(run_name="a2", max_duration="4ep")
    with Run.open(a2) as run, pytest.raises(ConfigError) as info:
        run_unit(a2, start_checkpoint=run.head, generation=run.generation)
    assert (
        "its optimizer state does not fit the recipe's SGD: for parameter '0.weight', momentum_buffer is a tensor of "
        "shape [], not [32, 16] (the parameter's shape)"
    ) in str(info.value)


def test_a_resumed_run_whose_learning_rate_is_a_string_fails_in_one_config_error(make_config):
    def change(state, progress):
        state["optimizer"]["param_groups"][0]["lr"] = "0.1; rm -rf /"

    forged(make_config, change, run_name="a2")
    a2 = make_config(run_name="a2", max_duration="4ep")
    with Run.open(a2) as run, pytest.raises(ConfigError) as info:
        run_unit(a2, start_checkpoint=run.head, generation=run.generation)
    assert "its optimizer state's param group 0 has a string for lr, the recipe's SGD a number" in str(info.value)
    assert "rm -rf" not in str(info.value)


def adam_state(amsgrad: bool = False) -> tuple[torch.optim.Optimizer, dict]:
    """A real Adam's state after one step: ``step`` is a 0-dim tensor, the moments the parameters' shapes."""
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.Adam(model.parameters(), amsgrad=amsgrad)
    model(torch.ones(2, 4)).sum().backward()
    optimizer.step()
    return optimizer, copy.deepcopy(optimizer.state_dict())


def test_adams_scalar_step_passes_and_a_step_of_another_shape_or_a_missing_moment_does_not():
    optimizer, state = adam_state()
    names = ["weight", "bias"]
    check_entries(optimizer, state, names, "f", "fix")  # as torch wrote it
    state["state"][0]["step"] = 3.0  # an older torch's number: torch makes it a tensor on load
    check_entries(optimizer, state, names, "f", "fix")
    state["state"][0]["step"] = torch.zeros(3)
    with pytest.raises(ConfigError, match=r"for parameter 'weight', step is a tensor of shape \[3\], not a scalar"):
        check_entries(optimizer, state, names, "f", "fix")
    optimizer, state = adam_state(amsgrad=True)
    del state["state"][1]["max_exp_avg_sq"]
    with pytest.raises(ConfigError, match=r"'bias', max_exp_avg_sq is missing \(it keeps step, exp_avg, exp_avg_sq, "):
        check_entries(optimizer, state, names, "f", "fix")


def test_a_group_flag_may_be_none_or_a_bool_and_betas_must_stay_a_pair_of_numbers():
    optimizer, state = adam_state()
    state["param_groups"][0]["foreach"] = True
    check_groups(optimizer, state, "f", "fix")
    state["param_groups"][0]["betas"] = (0.9,)
    with pytest.raises(ConfigError, match="param group 0 has a tuple for betas, the recipe's Adam a tuple"):
        check_groups(optimizer, state, "f", "fix")


def cli(config, env: dict[str, str], *extra: str) -> subprocess.CompletedProcess:
    argv = ["--save_folder", config.save_folder, "--run_name", config.run_name, "--recipe", config.recipe, "--seed",
            "7", "--recipe_args", '{"num_samples": 256}', "--global_batch_size", "32", "--max_duration", "4ep", *extra]  # fmt: skip
    command = [sys.executable, "-m", "flows.train", *argv]
    return subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.slow  # python -m flows.train processes on a Prefect test server
def test_the_cli_refuses_a_carried_state_that_does_not_fit_with_one_error_line_and_exit_2(make_config, prefect_env):
    load_path = forged(make_config, set_momentum("x"))
    b = make_config(run_name="b")
    refused = cli(b, prefect_env, "--load_path", load_path)
    assert refused.returncode == 2, refused.stderr
    assert refused.stderr.splitlines() == [
        f"error: load_path={load_path!r} (ep2-ba16-sa512): its optimizer state does not fit the recipe's SGD: for "
        f"parameter '0.weight', momentum_buffer is a string, not a tensor of shape [32, 16]; {FIX}"
    ]
    assert not (Path(b.save_folder) / "b").exists()

    a = make_config(run_name="a")  # the source run, its newest checkpoint's position moved past the end of the epoch
    store = CheckpointStore(a.save_folder, "a")
    loaded = store.load_latest(["state.pt"])
    progress = {**loaded.info.progress, "sample_in_epoch": 300, "samples_seen": 812}
    store.save("ep2-ba16-sa812", {"state.pt": {**loaded.objects["state.pt"], "progress": progress}},
               progress=progress, writer=Writer.current(store.fence.newest()))  # fmt: skip
    generation = store.fence.newest()
    resumed = cli(a, prefect_env)
    assert resumed.returncode == 2, resumed.stderr
    assert resumed.stderr.splitlines() == [
        "error: run 'a': its newest checkpoint ep2-ba16-sa812: its progress does not fit: sample_in_epoch=300 is past "
        "the end of an epoch of this run's data (256 samples); go back to an earlier checkpoint with "
        f"resume_from=<name> (python -m checkpointing ls {a.save_folder}/a)"
    ]
    assert store.fence.newest() == generation  # not claimed
