"""Every bad configuration gets one line naming the option, exit 2, and nothing written.

Run through ``flows.train.main`` in this process (the real command line minus the interpreter start):
configuration errors are decided before any Prefect server is needed, so none is started.
"""

from __future__ import annotations

import pytest

from flows.train import main

CASES = {
    # option, value(s) -> the start of the one line
    "save_interval 3x": (["--save_interval", "3x"], "save_interval='3x': use '<n>ep'"),
    "max_duration 0ep": (["--max_duration", "0ep"], "max_duration='0ep'"),
    "max_duration huge": (["--max_duration", "10000000000000ba"], "max_duration='10000000000000ba'"),
    "run_name escape": (["--run_name", "../escape"], "run_name='../escape'"),
    "run_name empty": (["--run_name", ""], "run_name=''"),
    "save_folder empty": (["--save_folder", ""], "save_folder='': empty"),
    "save_folder blank": (["--save_folder", "   "], "save_folder='   ': empty"),
    "save_folder http": (["--save_folder", "http://169.254.169.254/x"], "save_folder='http://169.254.169.254/x'"),
    "save_folder chained": (["--save_folder", "simplecache::s3://b/r"], "save_folder='simplecache::s3://b/r'"),
    "save_folder newline": (["--save_folder", "runs\nx"], "save_folder='runs\\nx': use a printable path"),
    "load_path ssh": (["--load_path", "ssh://host/x"], "load_path='ssh://host/x': protocol 'ssh'"),
    "recipe os.system": (["--recipe", "os:system"], "recipe='os:system': os:system is a builtin_function"),
    "recipe Popen": (["--recipe", "subprocess:Popen"], "recipe='subprocess:Popen': subprocess:Popen is not a recipe"),
    "recipe no module": (["--recipe", "no.such.module:Recipe"], "recipe='no.such.module:Recipe': cannot import"),
    "recipe unknown name": (["--recipe", "nosuchrecipe"], "recipe='nosuchrecipe' is not allowed on this worker"),
    "recipe bad path": (["--recipe", "a b:c"], "recipe='a b:c': use a registered recipe name"),
    "recipe_args unknown": (["--recipe_args", '{"bogus": 1}'], "recipe_args={'bogus': 1}: DigitsRecipe rejected"),
    "recipe_args list": (["--recipe_args", "[1, 2]"], "recipe_args='[1, 2]': use a JSON object"),
    "recipe_args negative width": (
        ["--recipe_args", '{"hidden": -1}'],
        "recipe 'recipes.digits:DigitsRecipe' with recipe_args={'hidden': -1}: build_model() failed",
    ),
    "recipe_args huge dataset": (
        ["--recipe", "synthetic", "--recipe_args", '{"num_samples": 10000000000000}'],
        "recipe 'synthetic' with recipe_args={'num_samples': 10000000000000}: train_dataset() failed",
    ),
    "global_batch_size 0": (["--global_batch_size", "0"], "global_batch_size='0'"),
    "global_batch_size 2**63": (["--global_batch_size", str(2**63)], f"global_batch_size='{2**63}'"),
    "seed -1": (["--seed", "-1"], "seed='-1'"),
    "seed 2**64": (["--seed", str(2**64)], f"seed='{2**64}'"),
    "keep 0": (["--num_checkpoints_to_keep", "0"], "num_checkpoints_to_keep=0: use -1 (keep all)"),
    "keep -5": (["--num_checkpoints_to_keep", "-5"], "num_checkpoints_to_keep=-5"),
    "retry delay inf": (["--retry_delay_seconds", "inf"], "retry_delay_seconds=inf: use a number of seconds"),
    "retry delay nan": (["--retry_delay_seconds", "nan"], "retry_delay_seconds=nan: use a number of seconds"),
    "retry delay negative": (["--retry_delay_seconds", "-1"], "retry_delay_seconds=-1.0: use a number of seconds"),
    "store max seconds 0": (["--store_retry_max_seconds", "0"], "store_retry_max_seconds=0.0"),
    "store attempts 0": (["--store_retry_attempts", "0"], "store_retry_attempts='0'"),
    "nproc 0": (["--nproc_per_node", "0"], "nproc_per_node='0'"),
    "rdzv endpoint": (  # where nodes meet is never a run's choice (the product's, or the worker's)
        ["--nnodes", "2", "--rdzv_endpoint", "evil:29400"],
        "error parsing CLI: unrecognized arguments: --rdzv_endpoint",
    ),
    "preemption grace": (["--preemption_grace_seconds", "-1"], "preemption_grace_seconds=-1.0"),
    "preemption signal": (["--preemption_signals", '["SIGKILL"]'], "preemption_signals=['SIGKILL']: 'SIGKILL' is not"),
    "device tpu": (["--device", "tpu"], "device='tpu'"),
    "weights only alone": (["--load_weights_only", "true"], "load_weights_only=True needs load_path"),
    "data skip -1": (["--data_skip_steps", "-1"], "data_skip_steps='-1'"),
    "score attribute": (["--checkpoint_score_attribute", "a b!"], "checkpoint_score_attribute='a b!'"),
    "score order": (["--checkpoint_score_order", "sideways"], "checkpoint_score_order='sideways'"),
    "config file missing": (["--config_file", "/nonexistent/run.toml"], "config_file='/nonexistent/run.toml': no such"),
    "config file kind": (["--config_file", __file__], f"config_file={__file__!r}: use a .toml, .yaml or .yml file"),
    "log every 0": (["--log_every_n_steps", "0"], "log_every_n_steps='0'"),
    "retries -1": (["--unit_retries", "-1"], "unit_retries='-1'"),
    "restarts -1": (["--max_restarts", "-1"], "max_restarts='-1'"),
    "workers -1": (["--num_workers", "-1"], "num_workers='-1'"),
    "fault step 0": (["--inject_fault_at_step", "0"], "inject_fault_at_step='0'"),
    "async maybe": (["--async_upload", "maybe"], "async_upload='maybe'"),
    # Composer's and MindSpore's habits that mean something else here: refused, naming what to write instead
    "save_folder {rank}": (["--save_folder", "runs/{rank}"], "save_folder='runs/{rank}': {rank} makes a folder per"),
    "save_folder {epoch}": (["--save_folder", "r/{epoch}"], "save_folder='r/{epoch}': {epoch} goes in Composer's file"),
    "save_folder {x}": (["--save_folder", "r/{x}"], "save_folder='r/{x}': {x} is not a format variable"),
    "save_interval dur": (["--save_interval", "0.5dur"], "save_interval='0.5dur': a fraction of the run ('dur'"),
    "max_duration tok": (["--max_duration", "9tok"], "max_duration='9tok': tokens ('tok', Composer's) are not"),
    "network weights fsdp": (
        ["--save_network_weights", "true", "--parallelism", "fsdp"],
        "save_network_weights=True with parallelism='fsdp': the weights are shards",
    ),
    "shuffle maybe": (["--shuffle", "maybe"], "shuffle='maybe'"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_each_bad_configuration_is_one_line_naming_the_option_exit_2_and_nothing_written(
    case, tmp_path, capsys, monkeypatch
):
    monkeypatch.chdir(tmp_path)  # a relative save_folder would land here
    folder = tmp_path / "runs"
    args, message = CASES[case]
    argv = args if "--save_folder" in args else ["--save_folder", str(folder), *args]

    code = main(argv)

    err = capsys.readouterr().err
    assert code == 2, err
    assert err.startswith(f"error: {message}"), err
    assert err.count("\n") == 1, err  # one line
    assert "Traceback" not in err
    assert list(tmp_path.iterdir()) == [], "a bad configuration wrote something"


def test_an_unknown_flag_is_one_clear_line(tmp_path, capsys):
    assert main(["--save_folder", str(tmp_path / "runs"), "--max_durration", "3ep"]) == 2
    err = capsys.readouterr().err
    assert "max_durration" in err and err.count("\n") == 1, err
