"""Starting torchrun for a gang's ranks on this machine: one way, whether it is node 0 (training/distributed/gang.py)
or another node of a gang across machines (training/distributed/node_run.py).

Each torchrun gets the run's config as a file only its user reads, an environment that carries this machine's
decisions and nothing more — the recipe this worker allowed, the local roots its ranks stay under, never the pool's
secret — and runs ``training.distributed.rank`` in a process group of its own that dies with this process
(``PR_SET_PDEATHSIG``), so that stopping it takes every rank with it.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from checkpointing.io import confine
from training.config import ConfigError, TrainConfig
from training.distributed.nodes import node_environment, torchrun_command
from training.lifetimes import die_with_parent
from training.recipe.loader import ALLOWED_ENV

FOLDER_ENV = "TRAIN_GANG_FOLDER"  # where a rank that fails writes what it raised (error-rank<r>.json)
_RANK = ["-m", "training.distributed.rank"]  # every rank's entry point, on every node


@dataclass(frozen=True)
class NodeSeat:
    """Where one torchrun sits in a gang across machines: node ``node_rank`` of ``nnodes``, meeting the others at
    node 0's store (``endpoint``, ``rdzv_id``), reached at ``address``."""

    nnodes: int
    node_rank: int
    endpoint: str
    rdzv_id: str
    address: str


@dataclass(frozen=True)
class Torchrun:
    """One torchrun of a gang on this machine: its ranks, what this worker lets them do, and where it meets the
    other machines (``seat``; None: this machine alone, ``--standalone``)."""

    nproc_per_node: int
    recipe: str  # resolved and allowed here: the ranks inherit that decision, nothing more
    roots: list[str] | None  # the roots its ranks stay under (local and object-store; a deployment run's); None: free
    seat: NodeSeat | None = None

    def start(self, config: TrainConfig, folder: Path, env: Mapping[str, str]) -> subprocess.Popen:
        """Starts torchrun with ``config`` written to ``folder`` and ``env`` as the base of its environment; its
        output (ranks' included) is the process's ``stdout``, as text."""
        environment = self.environment(env, folder)
        check_ranks_import(self.recipe, environment)
        config_file = folder / "config.json"
        config_file.write_text(config.model_dump_json())  # storage_options excluded: passed by environment
        config_file.chmod(0o600)
        return subprocess.Popen(
            self.command(folder),
            env=environment,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,  # its own group: stopping it takes every rank with it
            preexec_fn=die_with_parent,  # torchrun (and, through theirs, its ranks) die with this process
        )

    def command(self, folder: Path) -> list[str]:
        """torchrun for ``folder``'s config, its own log folder inside ``folder``: left to itself, torchrun makes a
        ``/tmp/torchelastic_*`` folder per launch and never removes it (one per attempt, on every machine)."""
        config_file, logs = str(folder / "config.json"), str(folder / "torchrun")
        if self.seat is None:  # this machine alone
            standalone = [f"--nproc-per-node={self.nproc_per_node}", "--max-restarts=0", "--standalone"]
            launch = [*standalone, f"--log-dir={logs}"]
            return [sys.executable, "-m", "torch.distributed.run", *launch, *_RANK, "--config", config_file]
        s = self.seat
        return torchrun_command(self.nproc_per_node, s.nnodes, s.node_rank, s.endpoint, s.rdzv_id, config_file, logs)

    def environment(self, env: Mapping[str, str], folder: Path) -> dict[str, str]:
        """``env`` with the recipe allowed, the roots confined and the gang's folder; across machines, without the
        pool's secret and with gloo and NCCL bound where this node is reached (``node_environment``)."""
        result = dict(env) if self.seat is None else node_environment(env, self.seat.address)
        result[ALLOWED_ENV] = ",".join(filter(None, [result.get(ALLOWED_ENV, ""), self.recipe]))
        if self.roots is not None:
            result[confine.ROOTS_ENV] = json.dumps(self.roots)
        result[FOLDER_ENV] = str(folder)
        return result


# Run by the ranks' interpreter, in their environment and folder: where would they import the recipe's module from?
_FIND_MODULE = (
    "import importlib.util, sys\n"
    "try:\n"
    "    spec = importlib.util.find_spec(sys.argv[1])\n"
    "except Exception as exc:\n"
    "    print(f'{type(exc).__name__}: {exc}'[:300]); sys.exit(3)\n"
    "print(spec.origin if spec and spec.origin else '', end=''); sys.exit(0 if spec else 4)\n"
)


def check_ranks_import(recipe: str, env: Mapping[str, str]) -> None:
    """Refuses, before torchrun starts, a recipe whose module the ranks would not import, or would import from another
    file than this process did: a module this process found through a folder added to its own ``sys.path`` (a script's
    folder, a notebook's ``sys.path.insert``) is not on the ranks' path, and every rank would fail after its start."""
    module = recipe.partition(":")[0]
    probe = subprocess.run(
        [sys.executable, "-c", _FIND_MODULE, module],
        env=dict(env),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    found = probe.stdout.strip()
    here = getattr(sys.modules.get(module), "__file__", None)
    if probe.returncode == 0 and (here is None or _same_file(found, here)):
        return
    where = f" (this process imported it from {here})" if here else ""
    if probe.returncode == 0:
        why = f"they would import it from {found}{where}, another file"
    else:
        why = f"they cannot import it{where}: {found or 'no such module on their path'}"
    folder = _search_folder(module, here)
    fix = f"PYTHONPATH={folder}" if folder else "its folder on PYTHONPATH"
    raise ConfigError(
        f"recipe={recipe!r}: the rank processes run with this process's environment, and {why}; start with {fix} "
        f"(or install the recipe's package) so that every rank imports the same module"
    )


def _same_file(a: str, b: str) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def _search_folder(module: str, file: str | None) -> str | None:
    """The folder that ``sys.path`` must hold for ``module`` to be found at ``file``."""
    if not file:
        return None
    path = Path(file).resolve().parent
    levels = module.count(".") + (1 if Path(file).name == "__init__.py" else 0)
    for _ in range(levels):
        path = path.parent
    return str(path)


def relay_output(proc: subprocess.Popen, log: logging.Logger, keep: deque[str] | None = None) -> None:
    """Passes torchrun's lines (its ranks' included) to ``log`` until it closes its output; the last ones also to
    ``keep`` (its failure record: training/distributed/deaths.py)."""
    assert proc.stdout is not None
    for line in proc.stdout:
        log.info("%s", line.rstrip())
        if keep is not None:
            keep.append(line.rstrip())
