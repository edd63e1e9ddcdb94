"""The product's errors live in two leaf modules (checkpointing/errors.py, training/exceptions.py), and what reads them
(the unit's retry policy, the torchrun boundary) reads those modules and the ``Permanent`` marker, not lists."""

from __future__ import annotations

import ast
import builtins
import importlib
from types import SimpleNamespace

import pytest

from checkpointing import errors as checkpoint_errors
from tasks.train_unit import retry_unless_permanent
from tests.conftest import ROOT
from training import exceptions
from training.distributed.errors import REBUILT, RemoteError, error_from_record, error_record
from training.exceptions import Permanent

ERROR_MODULES = ("checkpointing/errors.py", "training/exceptions.py")
# Where each error is raised: its old home still names it, for callers and for code that imports it from there.
RAISED_FROM = {
    "checkpointing": [
        "AccessDeniedError",
        "CheckpointError",
        "CorruptCheckpointError",
        "FencedError",
        "NotACheckpointError",
        "PermanentStorageError",
        "StorageError",
        "UnsafeCheckpointError",
    ],
    "checkpointing.serialization": ["CheckpointError", "CorruptCheckpointError", "UnsafeCheckpointError"],
    "checkpointing.store": [
        "CheckpointError",
        "CorruptCheckpointError",
        "FencedError",
        "NotACheckpointError",
        "UnsafeCheckpointError",
    ],
    "checkpointing.fencing": ["FencedError"],
    "checkpointing.manifest": ["ManifestError"],
    "checkpointing.release": ["ReleaseError"],
    "checkpointing.io.storage": ["AccessDeniedError", "PermanentStorageError", "StorageError"],
    "checkpointing.io.localfs": ["LinkedLocationError", "UnsafePathError"],
    "checkpointing.io.untrusted": ["DamagedFileError"],
    "checkpointing.peers.weights": ["WeightsError"],
    "checkpointing.peers.mindspore": ["MindSporeFormatError"],
    "training.config": ["ConfigError"],
    "training.config.text": ["ConfigError"],
    "training.unit.loop": ["InjectedFault"],
    "training.unit.own_loop": ["LoopEndedEarlyError", "ReportError"],
    "training.unit.reported_state": ["ReportError"],
    "training.distributed.errors": ["RemoteError"],
    "training.distributed.gang": ["DistributedUnitError"],
    "training.distributed.node_run": ["NodeFailed"],
    "training.distributed.nodes": ["OfferRefused"],
    "flows.train": ["RestartLimitError"],
}
# What crossed the torchrun boundary typed before the registry was derived from the modules: the same types still do.
REBUILT_BEFORE = [
    "AccessDeniedError",
    "CheckpointError",
    "ConfigError",
    "CorruptCheckpointError",
    "FencedError",
    "InjectedFault",
    "LinkedLocationError",
    "LoopEndedEarlyError",
    "NotACheckpointError",
    "PermanentStorageError",
    "ReportError",
    "StorageError",
    "UnsafeCheckpointError",
    "WeightsError",
]
# What the retry policy never retried when it read a tuple of classes: exactly these carry the marker.
NOT_RETRIED_BEFORE = [
    "AccessDeniedError",
    "ConfigError",
    "DataError",  # added with streaming shards (issue 34): data that does not match its index fails the same way again
    "FencedError",
    "LedgerError",  # added with sweeps (issue 35): a damaged ledger event reads the same way again
    "LedgerFencedError",  # ... and another sweep process writing the ledger stays there
    "LinkedLocationError",
    "LoopEndedEarlyError",
    "NotACheckpointError",
    "OfferRefused",
    "PermanentStorageError",
    "ReportError",
    "TrialFailed",  # added with sweeps: a trial whose run failed is recorded, not started again
    "TrialStopped",  # ... nor one stopped on request (the sweep's relaunch resumes it)
    "UnsafeCheckpointError",
    "UsageError",  # the base of the mistakes (issue 47): ConfigError, ReportError, LoopEndedEarlyError
]
# Exceptions that stay beside the code that raises them: a stop that carries its Stop, not an error (a BaseException
# like KeyboardInterrupt, rebuilt field by field at the boundary), and the deployment stack's own tooling, never part
# of a run. Private classes (a leading underscore) are control flow or an unpickler's refusal inside one module.
STAY = {
    "training/preemption.py": {"Preempted"},
    "deployments/postgres.py": {"PostgresError"},
    "deployments/private_paths.py": {"UntrustedPath"},
}


def product_errors() -> list[type[BaseException]]:
    return list(REBUILT.values())


def exception_classes_defined_in(path) -> set[str]:
    """Public classes of ``path`` whose bases look like exceptions: a builtin exception, or a name ending in Error,
    Exception, Fault, Refused or Failed (an error class of ours, or a library's such as UnpicklingError)."""
    builtin = {
        name for name, value in vars(builtins).items() if isinstance(value, type) and issubclass(value, BaseException)
    }
    found = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
            bases = {ast.unparse(base).rpartition(".")[2] for base in node.bases}
            if bases & builtin or any(b.endswith(("Error", "Exception", "Fault", "Refused", "Failed")) for b in bases):
                found.add(node.name)
    return found


def test_every_error_class_of_the_product_is_defined_in_one_of_the_two_error_modules():
    misplaced = {}
    for package in ("checkpointing", "training", "tasks", "flows", "deployments", "recipes"):
        for path in sorted((ROOT / package).rglob("*.py")):
            where = str(path.relative_to(ROOT))
            if where not in ERROR_MODULES:
                classes = exception_classes_defined_in(path) - STAY.get(where, set())
                if classes:
                    misplaced[where] = sorted(classes)
    assert misplaced == {}, "define these in checkpointing/errors.py or training/exceptions.py and import them back"


def test_the_two_error_modules_define_every_error_once_and_import_nothing_but_the_marker():
    checkpoint_names = set(vars(checkpoint_errors)) & set(REBUILT)
    training_names = set(vars(exceptions)) & set(REBUILT)
    assert checkpoint_names & training_names == set()
    assert set(REBUILT) == {
        *exception_classes_defined_in(ROOT / "checkpointing/errors.py"),
        *exception_classes_defined_in(ROOT / "training/exceptions.py"),
    }
    imports = [
        n for n in ast.parse((ROOT / "training/exceptions.py").read_text()).body if isinstance(n, ast.ImportFrom)
    ]
    assert [(n.module, [a.name for a in n.names]) for n in imports] == [
        ("__future__", ["annotations"]),
        ("checkpointing.errors", ["Permanent"]),
    ]
    tree = ast.parse((ROOT / "checkpointing/errors.py").read_text())
    assert [n.module for n in tree.body if isinstance(n, ast.ImportFrom | ast.Import)] == ["__future__"]


@pytest.mark.parametrize("module", sorted(RAISED_FROM))
def test_each_error_is_still_importable_from_where_it_is_raised(module):
    for name in RAISED_FROM[module]:
        assert getattr(importlib.import_module(module), name) is REBUILT[name], f"{module}.{name}"


def test_the_marker_sits_on_exactly_the_errors_that_were_never_retried():
    assert sorted(name for name, cls in REBUILT.items() if issubclass(cls, Permanent)) == NOT_RETRIED_BEFORE
    assert exceptions.Permanent is checkpoint_errors.Permanent


def test_the_bases_that_callers_catch_are_kept():
    assert issubclass(exceptions.ConfigError, ValueError)
    # a bad report and a loop that ended early are the recipe's mistakes, not configuration values (issue 47), and a
    # refused node offer is no mistake of the run's: each carries the marker without being dressed as a ConfigError
    for name in ("ReportError", "LoopEndedEarlyError"):
        assert issubclass(REBUILT[name], exceptions.UsageError) and not issubclass(
            REBUILT[name], exceptions.ConfigError
        )
    assert issubclass(exceptions.ConfigError, exceptions.UsageError)
    assert issubclass(exceptions.OfferRefused, ValueError) and not issubclass(
        exceptions.OfferRefused, exceptions.UsageError
    )
    for name in ("NotACheckpointError", "WeightsError", "MindSporeFormatError"):
        assert issubclass(REBUILT[name], checkpoint_errors.CheckpointError) and issubclass(REBUILT[name], ValueError)
    assert issubclass(checkpoint_errors.UnsafePathError, FileNotFoundError)
    assert issubclass(checkpoint_errors.AccessDeniedError, checkpoint_errors.PermanentStorageError)


@pytest.mark.parametrize("cls", product_errors(), ids=lambda cls: cls.__name__)
def test_the_retry_policy_retries_an_error_unless_it_is_permanent(cls):
    retried = retry_unless_permanent(None, None, SimpleNamespace(data=cls("a message")))
    assert retried is not issubclass(cls, Permanent)


@pytest.mark.parametrize("cls", product_errors(), ids=lambda cls: cls.__name__)
def test_every_error_crosses_the_process_boundary_as_its_own_type(cls):
    rebuilt = error_from_record(error_record(cls("the file a.pt is unsafe"), rank=3))
    assert type(rebuilt) is cls
    assert str(rebuilt) == "the file a.pt is unsafe" and rebuilt.__notes__ == ["(on rank 3)"]
    assert retry_unless_permanent(None, None, SimpleNamespace(data=rebuilt)) is not issubclass(cls, Permanent)


def test_the_names_rebuilt_before_are_rebuilt_as_the_same_types():
    from checkpointing.io.localfs import LinkedLocationError
    from checkpointing.peers.weights import WeightsError
    from training.unit.loop import InjectedFault
    from training.unit.own_loop import LoopEndedEarlyError

    assert set(REBUILT_BEFORE) <= set(REBUILT)
    assert REBUILT["LinkedLocationError"] is LinkedLocationError and REBUILT["WeightsError"] is WeightsError
    assert REBUILT["InjectedFault"] is InjectedFault and REBUILT["LoopEndedEarlyError"] is LoopEndedEarlyError


def test_an_error_of_another_type_comes_back_as_a_retried_remote_error():
    rebuilt = error_from_record(error_record(KeyError("x"), rank=0))
    assert type(rebuilt) is RemoteError and str(rebuilt) == "KeyError: 'x' (on rank 0)"
    assert retry_unless_permanent(None, None, SimpleNamespace(data=rebuilt)) is True


@pytest.mark.parametrize(
    "error,code", [("ConfigError", 2), ("ReportError", 2), ("LoopEndedEarlyError", 2), ("DataError", 1)]
)
def test_the_command_line_exits_2_for_every_mistake_and_1_for_a_failure(error, code, monkeypatch, capsys, tmp_path):
    import contextlib

    from flows import cli
    from training.config import TrainConfig

    def flow(config):
        raise REBUILT[error]("what went wrong")

    monkeypatch.setattr(cli, "prefect_api", lambda: contextlib.nullcontext("http://unused"))
    config = TrainConfig(save_folder=str(tmp_path / "runs"), run_name="m")
    assert cli.run_checked(flow, config, {}, str, verbose=True) == code
    assert "what went wrong" in capsys.readouterr().err
