"""Shared fixtures: an isolated Prefect home, one Prefect test harness per session, config factories."""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

# The temporary files of this session's processes (Prefect's, torchrun's, multiprocessing's, a browser's), also those
# of a process a test kills on purpose, which runs no cleanup, go to one folder removed at exit: a suite run leaves
# nothing in /tmp (before, each run left ~80 torchelastic_*, ~30 pymp-* and 4 prefect-home-* folders there). An
# xdist worker inherits its controller's folder and makes its own inside it.
SESSION_TMP = tempfile.mkdtemp(prefix="pytest-session-")
os.chmod(SESSION_TMP, 0o1777)  # as /tmp is: the tests that run as another user make their folders in it too
os.environ["TMPDIR"] = SESSION_TMP
atexit.register(shutil.rmtree, SESSION_TMP, True)  # registered first: runs last

# Nothing a test does may touch the user's Prefect profile or read their TRAIN_* settings.
_PREFECT_HOME = tempfile.mkdtemp(prefix="prefect-home-", dir=SESSION_TMP)
os.environ["PREFECT_HOME"] = _PREFECT_HOME
os.environ["PREFECT_SERVER_ANALYTICS_ENABLED"] = "false"
os.environ["PREFECT_LOGGING_LEVEL"] = os.environ.get("PREFECT_LOGGING_LEVEL", "WARNING")
for _key in [k for k in os.environ if k.startswith("TRAIN_")]:
    del os.environ[_key]

# The tests' own recipes, allowed the way a worker allows recipes: in its environment (see training/recipe/loader.py).
RECORDING = "tests.recipes_for_tests:RecordingRecipe"
SHARD_RECORDING = "tests.recipes_for_tests:ShardRecordingGPT"
TEST_RECIPES = ",".join(
    [
        RECORDING,
        "tests.recipes_for_tests:TrackingRecipe",
        "tests.recipes_for_tests:GatedRecipe",
        "tests.recipes_for_tests:MicroBatchRecipe",
        "tests.recipes_for_tests:ContextRecipe",
        "tests.recipes_for_tests:TwoOptimizerRecipe",
        "tests.recipes_for_tests:SignalledRecipe",
        "tests.recipes_for_tests:PacedRecipe",
        SHARD_RECORDING,
        "tests.recipes_for_tests:StreamRecipe",
        "tests.recipes_for_tests:WorkerPidRecipe",
        "tests.integration.deploy_recipes:PausingRecipe",
        "tests.integration.deploy_recipes:DyingRecipe",
        "tests.own_loop_recipes:FlakyOwnLoopRecipe,tests.own_loop_recipes:ShortLoopRecipe",
        "tests.own_loop_recipes:SignalledLoopRecipe",
        "tests.own_loop_recipes:SlowRayPortRecipe",
        "tests.recipes_for_tests:SteadySyntheticRecipe",
        "tests.recipes_for_tests:SparseBufferRecipe",
    ]
)
os.environ["TRAIN_ALLOWED_RECIPES"] = TEST_RECIPES
# Snapshots that the host-memory tier keeps (checkpointing/host_tier/tier.py) go to this session's own folder, not /dev/shm:
# a killed test run leaves nothing behind on the machine.
HOST_TIER_DIR = tempfile.mkdtemp(prefix="host-tier-", dir=SESSION_TMP)
os.environ["TRAIN_HOST_TIER_DIR"] = HOST_TIER_DIR
atexit.register(shutil.rmtree, HOST_TIER_DIR, True)
_popen_init = subprocess.Popen.__init__


def _popen_with_tier_dir(self, *args, **kwargs):
    """Every child gets the session's tier folder and temporary folder, also one started with an environment of its
    own (``env={...}`` without TRAIN_*: a "fresh user"), so no test run puts snapshots in /dev/shm (one full suite left
    8.2 GB there) or files in /tmp. A test that names its own keeps it."""
    env = kwargs.get("env")
    if isinstance(env, dict):
        given = dict(env)
        for key, value in (("TRAIN_HOST_TIER_DIR", HOST_TIER_DIR), ("TMPDIR", SESSION_TMP)):
            if key not in env and key.encode() not in env:
                as_bytes = bool(env) and all(isinstance(k, bytes) for k in env)
                given[key.encode() if as_bytes else key] = value.encode() if as_bytes else value
        kwargs["env"] = given
    _popen_init(self, *args, **kwargs)


subprocess.Popen.__init__ = _popen_with_tier_dir  # type: ignore[method-assign]


def tier_folders_of(session_tmp: str, root: str = "/dev/shm") -> list[str]:
    """This user's tier folders under ``root`` whose records name a store inside ``session_tmp`` (this session's
    runs: another session's, or a live user's, are never counted, so the check cannot fail for them)."""
    user = Path(root) / f"resumable-train-{os.getuid()}"
    found = []
    with contextlib.suppress(OSError):
        for folder in user.iterdir():
            for record in folder.glob("r*-s*.json"):
                with contextlib.suppress(OSError, ValueError, AttributeError):
                    uri = json.loads(record.read_bytes()[: 64 << 20]).get("store_uri", "")
                    if isinstance(uri, str) and uri.removeprefix("file://").startswith(session_tmp):
                        found.append(str(folder))
                        break
    return found


@pytest.fixture(scope="session", autouse=True)
def _no_snapshots_left_in_shared_memory(tmp_path_factory):
    """Fails the session, loudly, when a test's run put snapshots in /dev/shm (they are removed first)."""
    yield
    left = tier_folders_of(str(tmp_path_factory.getbasetemp()))
    for folder in left:
        shutil.rmtree(folder, ignore_errors=True)
    if left:
        pytest.fail(
            f"runs of this session left snapshots in /dev/shm (removed now): {left}; a process ran without "
            f"TRAIN_HOST_TIER_DIR, or a test opened the tier on /dev/shm itself and did not remove it"
        )


# Streaming shards read from a bucket are cached (training/data/shards.py) in this session's folder, not ~/.cache.
DATA_CACHE_DIR = tempfile.mkdtemp(prefix="data-cache-", dir=SESSION_TMP)
os.environ["TRAIN_DATA_CACHE_DIR"] = DATA_CACHE_DIR
atexit.register(shutil.rmtree, DATA_CACHE_DIR, True)


@pytest.fixture(scope="session")
def prefect_harness():
    """One Prefect test server for the whole session (it takes 10-12 s to start)."""
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120):
        yield


@pytest.fixture(scope="session")
def prefect_env(prefect_harness) -> dict[str, str]:
    """Environment for a child process that should use this session's Prefect server (no startup cost)."""
    from prefect.settings import PREFECT_API_URL

    # not the test that first asked for it (PYTEST_CURRENT_TEST), which every later child would carry: a CPU account of
    # the suite by test reads it from the children's environments
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRAIN_") and k != "PYTEST_CURRENT_TEST"}
    env.update(
        TRAIN_ALLOWED_RECIPES=TEST_RECIPES,
        TRAIN_HOST_TIER_DIR=HOST_TIER_DIR,
        TRAIN_DATA_CACHE_DIR=DATA_CACHE_DIR,
        PREFECT_API_URL=PREFECT_API_URL.value(),
        PREFECT_HOME=_PREFECT_HOME,
        PYTHONPATH=str(ROOT),
        PREFECT_LOGGING_LEVEL="INFO",
    )
    return env


@pytest.fixture(autouse=True)
def _fresh_process_state():
    """Each test starts as in a fresh process, and leaves nothing behind: no warm session or gang, stop request,
    recipe a command line allowed for itself... (everything training/process_state.py lists)."""
    from training import process_state

    process_state.reset()
    yield
    process_state.reset()


@pytest.fixture
def train_run():
    """``train_run(config)``: the run driven to its end through training.run.Run as the train flow drives it, without
    Prefect (no server, task runs or retries), returning the flow's TrainResult (tests/lifecycle.py). For tests of
    what a run does; a test of what Prefect adds (retries, states, artifacts, parameters) calls the flow."""
    from tests.lifecycle import train_to_end

    return train_to_end


@pytest.fixture
def make_config(tmp_path):
    """TrainConfig for the small synthetic recipe, in a fresh local save folder."""
    from training.config import TrainConfig

    def make(**overrides):
        values = dict(
            run_name="r",
            save_folder=str(tmp_path / "runs"),
            recipe="recipes.synthetic:SyntheticRecipe",
            recipe_args={"num_samples": 256},
            max_duration="3ep",
            save_interval="1ep",
            global_batch_size=32,
            seed=7,
            unit_retries=2,
            retry_delay_seconds=0,
        )
        values.update(overrides)
        return TrainConfig(**values)

    return make


# --- S3 over HTTP (moto server, started by deployments/local_s3.py as `make s3` and the benchmarks do) -------
MOTO_SECRET_KEY = "testing-secret-key"  # fake, but distinct enough to search files and logs for


@pytest.fixture(scope="session")
def moto_server():
    """A real S3 endpoint over HTTP on a free loopback port, for the whole session (as s3fs's tests do),
    with fake credentials in the environment until the session ends; yields its port."""
    from deployments.local_s3 import AWS_UNSET, fake_aws_env, serving

    with pytest.MonkeyPatch.context() as env, serving() as server:
        for key, value in fake_aws_env(secret=MOTO_SECRET_KEY).items():
            env.setenv(key, value)
        for key in AWS_UNSET:
            env.delenv(key, raising=False)
        yield server.port


@pytest.fixture
def s3(moto_server):
    """An empty moto and a fresh bucket; yields (save_folder, storage_options) pointing s3fs at the server."""
    import uuid

    import s3fs

    from deployments.local_s3 import LocalS3

    server = LocalS3(moto_server)
    bucket = server.fresh_bucket(f"b-{uuid.uuid4().hex[:12]}")
    yield f"{bucket}/runs", server.storage_options
    s3fs.S3FileSystem.clear_instance_cache()


@pytest.fixture(params=["local", "memory", "s3"])
def backend(request, tmp_path):
    """(save_folder, storage_options) on each store in turn: a local folder, memory:// and S3 over HTTP."""
    if request.param == "local":
        return str(tmp_path / "runs"), None
    if request.param == "memory":
        return f"memory://{uuid.uuid4().hex}/runs", None
    return request.getfixturevalue("s3")


# --- Seeds and deadlines of the end-to-end tests ----------------------------------------------------------------------
# A seeded scenario ("SIGKILL at a random moment, relaunch, bit-identical") runs ONE seed per run: TEST_SEED, or one
# drawn for the run (the same in every xdist worker, which must collect the same tests), shown in the test's id, its
# output and its failure, so that `TEST_SEED=<n>` replays a failure. TEST_ALL_SEEDS=1 runs each scenario's whole fixed
# set instead (`make test-all-seeds`); `-m all_seeds` selects the seeded tests.
def _run_seed() -> int:
    given = os.environ.get("TEST_SEED", "")
    if given:
        if not given.isdigit():
            raise pytest.UsageError(f"TEST_SEED={given!r} is not a seed: give a whole number, e.g. TEST_SEED=1")
        return int(given)
    run = os.environ.get("PYTEST_XDIST_TESTRUNUID")  # one id per run, shared by its workers
    if run:
        return int(hashlib.sha256(run.encode()).hexdigest(), 16) % 1_000_000
    return random.SystemRandom().randrange(1_000_000)


RUN_SEED = _run_seed()
ALL_SEEDS = os.environ.get("TEST_ALL_SEEDS", "") == "1"


def seeds(*fixed: int) -> list:
    """``@pytest.mark.parametrize("seed", seeds(1, 2, 3))``: this run's one seed, or every seed of ``fixed`` with
    TEST_ALL_SEEDS=1; each marked ``all_seeds``."""
    chosen = fixed if ALL_SEEDS else (RUN_SEED,)
    return [pytest.param(s, id=f"seed={s}", marks=pytest.mark.all_seeds) for s in chosen]


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A seeded test's report carries its seed and how to replay it (shown with its failure)."""
    outcome = yield
    seed = getattr(item, "callspec", None) and item.callspec.params.get("seed")
    if seed is not None and item.get_closest_marker("all_seeds"):
        report = outcome.get_result()
        report.sections.append(("seed", f"seed {seed}: replay with TEST_SEED={seed} pytest '{item.nodeid}'"))


@pytest.fixture(autouse=True)
def _print_the_seed(request):
    seed = getattr(request.node, "callspec", None) and request.node.callspec.params.get("seed")
    if seed is not None and request.node.get_closest_marker("all_seeds"):
        print(f"seed {seed} (replay: TEST_SEED={seed})")


# The waits of the end-to-end tests scale with the machine's load: tests/deadlines.py.
from tests.deadlines import deadline, time_scale, wait_until  # noqa: E402, F401


# --- The order the files run in: the longest first ---------------------------------------------------------------
# `make test` gives whole files to its xdist workers (--dist loadfile, a module's stack and reference runs once), in
# collection order (--no-loadscope-reorder: xdist's own order puts the files with the most tests first, so the few
# long end-to-end files came last and one worker ran on alone for minutes). Collected longest file first (the seconds
# each took in a full run: tests/file_seconds.json), the workers' last files are short ones and they end together.
# Refresh the table from a run's junit xml: `.venv/bin/python -m tests.file_seconds junit.xml`.
def pytest_collection_modifyitems(session, config, items):
    from tests.file_seconds import expected_seconds

    seconds = expected_seconds(items)
    items.sort(key=lambda item: -seconds[item.nodeid.split("::", 1)[0]])  # stable: a file's own order is kept
