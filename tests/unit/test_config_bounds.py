"""Config files, TRAIN_* JSON and JSON flags are read within bounds: each hostile input is one ConfigError line,
fast and in bounded memory, and nothing is written.

The hostile files are measured in a child process (peak RSS by resource.getrusage, under an address-space
limit so that a regression fails the test instead of the machine): a 457-byte alias bomb once reached 5.9 GB.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from flows.train import main
from tests.conftest import ROOT
from training.config import ConfigError, TrainConfig, load_config

BOMB = "\n".join(
    ['a0: &a0 ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    + [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 9)}]" for i in range(1, 9)]
    + ["recipe_args: {bomb: *a8}"]
)
DEEP = "[" * 100_000 + "]" * 100_000
HUGE = 100 * 1024 * 1024

# name -> (file name, content or a size for a sparse file, the one line after "config_file='<path>': ")
HOSTILE_FILES = {
    "alias bomb": ("bomb.yaml", BOMB, "YAML anchors and aliases (&, *) are not read (line 1, column 5); write the values out"),
    "5000-digit int yaml": ("int.yaml", "seed: " + "9" * 5000, "a number of 5000 characters (line 1, column 7); numbers may have at most 40 (write a longer value as a string)"),
    "5000-digit int toml": ("int.toml", "seed = " + "9" * 5000, "a number of 5000 characters (line 1, column 8); numbers may have at most 40 (write a longer value as a string)"),
    "100k-deep yaml": ("deep.yaml", f"recipe_args: {{x: {DEEP}}}", "nested more than 32 levels deep (line 1, column 48)"),
    "100k-deep toml": ("deep.toml", f"recipe_args = {{ x = {DEEP} }}", "nested more than 32 levels deep (line 1, column 52)"),
    "100k-deep toml dotted keys": ("dotted.toml", "recipe_args." + ".".join(["k"] * 100_000) + " = 1", "nested more than 32 levels deep (line 1, column 74)"),
    "duplicate key yaml": ("dup.yaml", "seed: 1\nmax_duration: 2ep\nseed: 2\n", "key 'seed' is set twice (line 3, column 1)"),
    "duplicate nested key yaml": ("dupn.yaml", "recipe_args:\n  hidden: 8\n  hidden: 64\n", "key 'hidden' is set twice (line 3, column 3)"),
    "duplicate key toml": ("dup.toml", 'seed = 1\nrun_name = "x"\nseed = 2\n', "key 'seed' is set twice (line 3)"),
    "100 MB yaml": ("huge.yaml", HUGE, f"{HUGE} bytes; config files are read up to 262144 bytes"),
    "100 MB toml": ("huge.toml", HUGE, f"{HUGE} bytes; config files are read up to 262144 bytes"),
}  # fmt: skip

MEASURE = """
import json, resource, sys, time
resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))  # a regression fails here, not the machine
from training.config import ConfigError, load_config
before = int(open("/proc/self/status").read().split("VmHWM:")[1].split()[0])  # peak KiB since exec (ru_maxrss keeps the parent's)
start = time.process_time()  # CPU seconds: the parser's own work, not the time other processes held the cores
try:
    load_config(["--config_file", sys.argv[1]])
    outcome = "accepted"
except ConfigError as exc:
    outcome = str(exc)
except BaseException as exc:
    outcome = f"{type(exc).__name__}: {exc}"[:300]
seconds = time.process_time() - start
print(json.dumps({"outcome": outcome, "seconds": seconds,
                  "grown_kib": int(open("/proc/self/status").read().split("VmHWM:")[1].split()[0]) - before}))
"""


def write_hostile(tmp_path, name: str) -> tuple[str, str]:
    filename, content, expected = HOSTILE_FILES[name]
    path = tmp_path / filename
    if isinstance(content, int):
        with open(path, "wb") as f:
            f.truncate(content)  # sparse: 100 MB that take no disk
    else:
        path.write_text(content)
    return str(path), f"config_file={str(path)!r}: {expected}"


@pytest.mark.parametrize("name", list(HOSTILE_FILES))
def test_a_hostile_config_file_is_one_line_fast_and_in_bounded_memory(name, tmp_path):
    path, expected = write_hostile(tmp_path, name)
    proc = subprocess.run([sys.executable, "-c", MEASURE, path], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    measured = json.loads(proc.stdout.splitlines()[-1])

    assert measured["outcome"].startswith(expected), measured["outcome"]
    assert "\n" not in measured["outcome"] and len(measured["outcome"]) < 400
    assert measured["seconds"] < 0.5, measured
    assert measured["grown_kib"] < 4 * 1024, measured  # peak RSS: a few MB at most


@pytest.mark.parametrize("name", ["5000-digit int toml", "100k-deep yaml", "duplicate key yaml", "100 MB yaml"])
def test_the_cli_refuses_a_hostile_config_file_in_one_line_exit_2_writing_nothing(name, tmp_path, capsys):
    path, expected = write_hostile(tmp_path, name)
    folder = tmp_path / "runs"

    code = main(["--save_folder", str(folder), "--config_file", path])

    err = capsys.readouterr().err
    assert (code, err) == (2, f"error: {expected}\n")
    assert not folder.exists()


@pytest.mark.parametrize("kind", ["fifo", "directory", "control characters"])
def test_a_config_path_that_is_no_text_file_is_one_line_and_never_waits(kind, tmp_path):
    path = tmp_path / "run.yaml"
    if kind == "fifo":
        os.mkfifo(path)  # opening it for reading without O_NONBLOCK would wait for a writer forever
    elif kind == "directory":
        path.mkdir()
    else:
        path.write_bytes(b"seed: 1\n\x00\x1b]0;title\x07\n")
    expected = "not valid YAML: unacceptable character #x0000" if kind == "control characters" else "not a regular file"
    with pytest.raises(ConfigError) as info:
        load_config(["--config_file", str(path)])
    assert str(info.value).startswith(f"config_file={str(path)!r}: {expected}")


def test_yaml_and_toml_within_bounds_still_load(tmp_path):
    nested = {"widths": [8, 16], "opts": {"a": {"b": {"c": 1}}}, "big": 2**62}
    yaml_file, toml_file = tmp_path / "run.yaml", tmp_path / "run.toml"
    yaml_file.write_text(f"seed: {2**63 - 1}\nrecipe_args: {json.dumps(nested)}\nmax_duration: 3ep\n")
    toml_file.write_text(
        f'seed = {2**63 - 1}\nmax_duration = "3ep"  # a comment with "quotes" and [brackets\n[recipe_args]\n'
        f'note = "}}}} \\" [[ #"\nwidths = [8, 16]\nbig = {2**62}\n[recipe_args.opts.a.b]\nc = 1\n'
    )
    from_yaml = load_config(["--config_file", str(yaml_file)])
    from_toml = load_config(["--config_file", str(toml_file)])
    assert from_yaml.recipe_args == nested and from_yaml.seed == 2**63 - 1
    assert from_toml.recipe_args == {**nested, "note": '}} " [[ #'} and from_toml.seed == 2**63 - 1


@pytest.mark.parametrize(
    "content, expected",
    [
        ("Seed: 3\n", "key 'Seed' is not a field: field names are matched exactly, write 'seed'"),
        ("_env_file: /etc/passwd\n", "key '_env_file' is not a field: keys starting with '_' are pydantic-settings'"),
        ("bogus: 1\nother: 2\n", "key 'bogus' is not a field (python -m flows.train --help lists them) (and 1 more"),
    ],
)
def test_config_file_keys_are_field_names_exactly(content, expected, tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text(content)
    with pytest.raises(ConfigError) as info:
        load_config(["--config_file", str(path)])
    assert str(info.value).startswith(f"config_file={str(path)!r}: {expected}")


SECRET = "wJalrXUtnFEMI-never-echo"
HOSTILE_JSON = {
    "deep": ("[" * 30_000 + "]" * 30_000, "nested more than 32 levels deep (line 1, column 33)"),
    "5000-digit int": ('{"a": ' + "9" * 5000 + "}", "a number of 5000 characters (line 1, column 7)"),
    "70000 characters": (json.dumps({"a": "x" * 70_000}), "70009 characters of JSON; keep it under 65536"),
    "duplicate key": (f'{{"secret": "{SECRET}", "secret": "{SECRET}"}}', "key 'secret' is set twice"),
}


@pytest.mark.parametrize("variable", ["TRAIN_RECIPE_ARGS", "TRAIN_STORAGE_OPTIONS"])
@pytest.mark.parametrize("case", list(HOSTILE_JSON))
def test_hostile_json_in_a_train_variable_is_one_line_naming_the_variable(variable, case, monkeypatch):
    text, expected = HOSTILE_JSON[case]
    monkeypatch.setenv(variable, text)
    with pytest.raises(ConfigError) as info:
        TrainConfig()  # the same on a worker, where a flow run's TrainConfig reads the worker's environment
    assert str(info.value).startswith(f"{variable}: {expected}")
    assert SECRET not in str(info.value) and len(str(info.value)) < 200


@pytest.mark.parametrize("case", list(HOSTILE_JSON))
def test_hostile_json_in_a_flag_is_one_line_exit_2_writing_nothing(case, tmp_path, capsys):
    text, expected = HOSTILE_JSON[case]
    folder = tmp_path / "runs"

    code = main(["--save_folder", str(folder), "--recipe_args", text])

    err = capsys.readouterr().err
    assert code == 2 and err.startswith(f"error: --recipe_args: {expected}") and err.count("\n") == 1, err[:500]
    assert SECRET not in err and len(err) < 200
    assert not folder.exists()


def test_json_within_bounds_still_arrives_through_variables_and_flags(monkeypatch):
    options = {"client_kwargs": {"endpoint_url": "http://127.0.0.1:9"}, "config_kwargs": {"retries": {"max": 2}}}
    monkeypatch.setenv("TRAIN_STORAGE_OPTIONS", json.dumps(options))
    monkeypatch.setenv("TRAIN_LOAD_IGNORE_KEYS", '["fc.*"]')
    config = load_config(["--recipe_args", '{"hidden": 64, "sizes": [1, 2]}', "--load_path", "w.pt"])
    assert config.storage_options == options and config.load_ignore_keys == ["fc.*"]
    assert config.recipe_args == {"hidden": 64, "sizes": [1, 2]}
