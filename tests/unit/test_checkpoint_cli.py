"""python -m checkpointing ls|verify|export, run as a real subprocess on a real run folder."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from checkpointing import CheckpointStore, Writer
from tests.conftest import ROOT


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "checkpointing", *args], cwd=ROOT, capture_output=True, text=True, timeout=120
    )


@pytest.fixture
def run(tmp_path):
    store = CheckpointStore(str(tmp_path / "runs"), "exp")
    for i in range(3):
        store.save(
            f"ep{i + 1}-ba{8 * (i + 1)}-sa{256 * (i + 1)}",
            {"state.pt": {"state": {"model": {"w": torch.full((4,), float(i))}}}},
            progress={"epoch": i + 1, "step": 8 * (i + 1), "samples_seen": 256 * (i + 1)},
            metadata={"recipe": "recipes.synthetic:SyntheticRecipe"},
            writer=Writer.current(1),
        )
    return store


def test_ls_shows_each_checkpoint_with_progress_and_which_one_latest_names(run):
    out = cli("ls", run.uri)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].split() == ["name", "epoch", "step", "samples", "size", "MB", "verified", "latest"]
    assert lines[3].split()[:4] == ["ep3-ba24-sa768", "3", "24", "768"] and lines[3].split()[-2:] == ["yes", "*"]
    assert len(lines) == 4


def test_verify_passes_a_good_run_and_fails_naming_a_flipped_byte(run):
    assert cli("verify", run.uri).returncode == 0
    key = "checkpoints/ep2-ba16-sa512/state.pt"
    data = bytearray(run.storage.get(key))
    data[len(data) // 2] ^= 1
    run.storage.put(key, bytes(data))
    out = cli("verify", run.uri)
    assert out.returncode == 1
    assert "ep2-ba16-sa512: BAD: ep2-ba16-sa512/state.pt: sha256 mismatch" in out.stdout
    assert "ep3-ba24-sa768: ok" in out.stdout


def test_verify_fails_a_run_with_a_checkpoint_whose_manifest_is_unreadable(run):
    run.storage.put("checkpoints/ep2-ba16-sa512/manifest.json", b"{not json")
    out = cli("verify", run.uri)
    assert out.returncode == 1, out.stdout
    assert out.stdout.splitlines() == [
        "ep1-ba8-sa256: ok",
        "ep3-ba24-sa768: ok",
        "ep2-ba16-sa512: BAD: ep2-ba16-sa512: no readable manifest.json",
    ]


def test_export_writes_weights_that_load_safely(run, tmp_path):
    out_file = tmp_path / "model.pt"
    out = cli("export", f"{run.uri}/checkpoints/ep2-ba16-sa512", str(out_file))
    assert out.returncode == 0, out.stderr
    exported = torch.load(out_file, weights_only=True)
    assert torch.equal(exported["model"]["w"], torch.full((4,), 1.0))
    assert exported["metadata"]["progress"]["step"] == 16


def test_a_uri_that_is_no_run_fails_with_one_clear_line(tmp_path):
    out = cli("export", str(tmp_path / "nothing"), str(tmp_path / "m.pt"))
    assert out.returncode == 1
    assert out.stderr.startswith("error: uri=") and "Traceback" not in out.stderr
    assert not (tmp_path / "m.pt").exists()


def test_verify_with_name_checks_only_that_checkpoint(run):
    key = "checkpoints/ep2-ba16-sa512/state.pt"
    run.storage.put(key, run.storage.get(key)[:-1])
    good = cli("verify", run.uri, "--name", "ep3-ba24-sa768")
    assert (good.returncode, good.stdout) == (0, "ep3-ba24-sa768: ok\n")
    bad = cli("verify", run.uri, "--name", "ep2-ba16-sa512")
    assert bad.returncode == 1 and bad.stdout.startswith("ep2-ba16-sa512: BAD: ep2-ba16-sa512/state.pt: size")
    escape = cli("verify", run.uri, "--name", "../other")
    assert escape.returncode == 1 and escape.stderr.startswith("error: --name='../other'")


@pytest.mark.slow  # three python -m checkpointing processes
def test_on_s3_the_storage_options_are_used_and_never_printed(s3, tmp_path):
    folder, options = s3
    store = CheckpointStore(folder, "exp", storage_options=options)
    store.save(
        "ep1-ba8-sa256",
        {"state.pt": {"state": {"model": {"w": torch.full((4,), 7.0)}}}},
        progress={"epoch": 1, "step": 8, "samples_seen": 256},
    )
    secret = "S3CR3T-in-the-options"
    given = json.dumps({**options, "secret": "testing", "key": "testing", "token": secret})  # moto ignores the token

    listed = cli("ls", store.uri, "--storage-options", given)  # after the command ...
    assert listed.returncode == 0, listed.stderr
    assert listed.stdout.splitlines()[1].split()[:4] == ["ep1-ba8-sa256", "1", "8", "256"]
    exported = cli("--storage-options", given, "export", store.uri, str(tmp_path / "m.pt"))  # ... or before it
    assert exported.returncode == 0, exported.stderr
    assert torch.equal(torch.load(tmp_path / "m.pt", weights_only=True)["model"]["w"], torch.full((4,), 7.0))

    missing = cli("verify", "s3://no-such-bucket-here/exp", "--storage_options", given)  # the training flag's spelling
    assert missing.returncode == 1 and "no such bucket" in missing.stderr
    assert len(missing.stderr.splitlines()) == 1 and "Traceback" not in missing.stderr
    for out in (listed, exported, missing):
        assert secret not in out.stdout + out.stderr


def imported_modules(*args: str) -> set[str]:
    """Top-level packages a ``python -m checkpointing`` command imported (its ``-X importtime`` record)."""
    out = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "checkpointing", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    names = [line.rsplit("|", 1)[1].strip() for line in out.stderr.splitlines() if line.startswith("import time:")]
    assert "checkpointing.store" in names  # the record is really there
    return {name.split(".")[0] for name in names}


@pytest.mark.parametrize("command", ["ls", "verify"])
def test_ls_and_verify_import_neither_torch_nor_prefect(run, command):
    # torch costs ~1.4 s and Prefect more here; listing and verifying read JSON manifests and hash bytes
    packages = imported_modules(command, run.uri)
    assert "fsspec" in packages
    assert not packages & {"torch", "prefect", "numpy", "flows", "tasks", "training"}


@pytest.fixture
def scored(tmp_path):
    """A run whose checkpoints report a loss that does not fall steadily (best-first is not newest-first)."""
    store = CheckpointStore(str(tmp_path / "runs"), "scored")
    for i, loss in enumerate([0.9, 0.25, 0.5]):
        store.save(
            f"ep{i + 1}-ba{8 * (i + 1)}-sa{256 * (i + 1)}",
            {"state.pt": {"state": {"model": {"w": torch.full((4,), float(i))}}}},
            progress={"epoch": i + 1, "step": 8 * (i + 1), "samples_seen": 256 * (i + 1)},
            metadata={"metrics": {"loss": loss, "samples_per_second": 100.0 * (i + 1)}},
            writer=Writer.current(1),
        )
    return store


def test_ls_best_lists_the_checkpoints_reporting_the_metric_best_first_with_its_value(scored):
    lowest = cli("ls", scored.uri, "--best", "loss", "--order", "min")
    assert lowest.returncode == 0, lowest.stderr
    rows = [line.split() for line in lowest.stdout.splitlines()]
    assert rows[0] == ["name", "loss", "epoch", "step", "samples", "size", "MB", "verified", "latest"]
    assert [r[:2] for r in rows[1:]] == [
        ["ep2-ba16-sa512", "0.25"],
        ["ep3-ba24-sa768", "0.5"],
        ["ep1-ba8-sa256", "0.9"],
    ]
    assert rows[2][-1] == "*"  # the one latest names is still marked

    highest = cli("ls", scored.uri, "--best", "loss")  # max is the default, as for checkpoint_score_order
    assert highest.returncode == 0, highest.stderr
    assert [line.split()[0] for line in highest.stdout.splitlines()[1:]] == [
        "ep1-ba8-sa256",
        "ep3-ba24-sa768",
        "ep2-ba16-sa512",
    ]


def test_ls_best_with_a_metric_no_checkpoint_reports_fails_with_one_line_and_exit_2(scored, tmp_path):
    out = cli("ls", scored.uri, "--best", "accuracy")
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr == (
        f"error: no checkpoint in {scored.uri} reports metric 'accuracy' (they report: loss, samples_per_second)\n"
    )
    empty = cli("ls", str(tmp_path / "runs" / "nothing"), "--best", "loss")
    assert empty.returncode == 2 and len(empty.stderr.splitlines()) == 1


def test_ls_marks_checkpoints_a_roll_back_set_aside_and_best_leaves_them_out(scored):
    scored.roll_back("ep1-ba8-sa256", Writer.current(2))
    listed = cli("ls", scored.uri)
    assert listed.returncode == 0, listed.stderr
    assert listed.stdout.splitlines()[-1] == (
        "(set aside by a roll-back: kept, never resumed from: ep2-ba16-sa512, ep3-ba24-sa768)"
    )
    best = cli("ls", scored.uri, "--best", "loss", "--order", "min")
    assert [line.split()[0] for line in best.stdout.splitlines()[1:]] == ["ep1-ba8-sa256"]


def test_ls_best_imports_neither_torch_nor_prefect(scored):
    packages = imported_modules("ls", scored.uri, "--best", "loss")
    assert not packages & {"torch", "prefect", "numpy", "flows", "tasks", "training"}
