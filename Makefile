# Two commands do all set-up on a fresh machine: `make demo` and `make test`.
# `make install` creates .venv and installs everything (the runtime, the test and lint extras); the test, lint and
# stack targets depend on it. `make demo` depends on `install-runtime` alone: the runtime dependencies (the digits
# recipe needs nothing more), without the test and lint extras (mlflow, optuna, moto, ruff, mypy, ...: 8 min 48 s of
# pip on a loaded machine, issue 46). Each half has its own stamp, so `make demo` then `make test` installs only the
# extras, and `make test` then `make demo` installs nothing.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
RUNTIME_STAMP := $(VENV)/.installed-runtime
STAMP  := $(VENV)/.installed

.PHONY: install install-runtime demo test test-fast test-slow test-system test-all-seeds test-gpu lint format bench s3 clean

install: $(STAMP)

install-runtime: $(RUNTIME_STAMP)

# Reinstall only when the dependency files change.
$(RUNTIME_STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q -c constraints.txt -e .
	touch $(RUNTIME_STAMP)

$(STAMP): $(RUNTIME_STAMP)
	$(PIP) install -q -c constraints.txt -e '.[test,lint]'
	touch $(STAMP)

# Trains the digits recipe into ./runs/demo with one injected fault, which Prefect
# retries and which resumes from the last checkpoint. runs/demo is the demo's own
# folder: it is cleared so that each `make demo` shows a whole run.
demo: install-runtime
	rm -rf runs/demo
	PREFECT_SERVER_ANALYTICS_ENABLED=false $(PY) -m flows.train --run_name demo --inject_fault_at_step 30

# The suite in three tiers, by pytest marker (pyproject.toml); `make test` runs all three:
#   make test-fast    neither `slow` nor `system`: unit tests, and runs trained in the test's own process through
#                     training.run.Run (the `train_run` fixture of tests/conftest.py), with no Prefect server;
#                     meant to take under 3 minutes on 2 cores (what it took: bench/RESULTS.md, "Issue 32: test tiers")
#   make test-slow    `slow` but not `system`: real processes, signals and torchrun, the longest trainings, and the
#                     train flow on a Prefect test server where Prefect is what is tested (retries, artifacts, logs)
#   make test-system  `system`: the Prefect stack (server, worker, deployments, reconciler), PostgreSQL, the UI in
#                     headless Chromium, every shell block of README.md and docs/, several hosts
#   make test-gpu     tests/gpu alone, on a machine with a CUDA device (they skip without one): with the python3 there
#                     (GPU_PY), no .venv and no `make install`; scripts/gpu_check.sh prepares a bare GPU machine and runs it
#   make test-all-seeds  the seeded scenarios (marker `all_seeds`: a SIGKILL at a random moment, relaunch, bit-identical)
#                     with every seed of their fixed sets; the other tiers run ONE seed per scenario, TEST_SEED or one
#                     drawn per run and printed with the test (its id `[seed=N]`): `TEST_SEED=N` replays a failure.
#                     Waits in the end-to-end tests scale with the load (TEST_TIME_SCALE sets it; tests/deadlines.py)
# tests/integration/test_ui.py (make test-ui) needs headless Chromium: it runs `apt-get install -y chromium` itself
# when it is missing (root, ~60 s) or skips saying why.
# JOBS pytest processes (pytest-xdist), each taking whole files (a module's reference runs once; each process starts
# one SQLite Prefect stack that its system modules share, tests/integration/conftest.py): most
# end-to-end tests wait on servers, heartbeats and signals rather than the CPU, so 3 on 2 cores took 13 minutes
# where one took 27 (bench/RESULTS.md, "Test suite"). JOBS=1 runs it in one process.
# The files go out longest first (tests/file_seconds.json; xdist's own reorder, by test count, is turned off).
JOBS ?= 3
XDIST = $(if $(filter 1,$(JOBS)),,-n $(JOBS) --dist loadfile --no-loadscope-reorder)
test: install
	$(PY) -m pytest -q $(XDIST) --durations=15

test-fast: install
	$(PY) -m pytest -q $(XDIST) -m "not slow and not system"

test-slow: install
	$(PY) -m pytest -q $(XDIST) --durations=15 -m "slow and not system"

test-system: install
	$(PY) -m pytest -q $(XDIST) --durations=15 -m system

test-all-seeds: install
	TEST_ALL_SEEDS=1 $(PY) -m pytest -q $(XDIST) --durations=15 -m all_seeds

# The GPU tests with whatever Python has torch and the project's few dependencies (pip-installed or on PYTHONPATH):
# no venv and no pytest plugin needed (addopts emptied: one added for the other tiers asks nothing of this machine).
GPU_PY ?= python3
test-gpu:
	$(GPU_PY) -m pytest -q -rs -p no:cacheprovider -o addopts="" tests/gpu

# Lint, format check and types (CI runs it before the tests). `make format` rewrites files in place.
lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

format: install
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

# A local S3 endpoint (moto) on 127.0.0.1:5555 with a bucket 'runs'; prints how to train against it.
s3: install
	$(PY) -m deployments.local_s3

# Benchmarks (bench/README.md): each prints its figures and appends them to bench/RESULTS.md.
# One of them: make bench BENCH=overhead; with its flags: make bench BENCH=overhead BENCH_ARGS="--reps 3"
BENCH ?= all
BENCH_ARGS ?=
bench: install
	$(PIP) install -q -c constraints.txt -e '.[test,bench]'
	PREFECT_SERVER_ANALYTICS_ENABLED=false $(PY) -m bench $(BENCH) $(BENCH_ARGS)

clean:
	rm -rf $(VENV) runs .pytest_cache

# -- A local Prefect stack: server, work pool, deployments, reconciler, worker (deployments/stack.py) ----------
# `make stack` brings up all of it in one terminal and prints where the UI is (http://127.0.0.1:4200; Ctrl-C
# stops it all). Or one terminal each: `make server`, then `make deploy` and `make worker`.
# DB=sqlite (default: $PREFECT_HOME/prefect.db, no set-up) or DB=postgres (a PostgreSQL server the stack creates
# in ./.prefect/postgres, starts and stops itself; STACK_POSTGRES_PORT, STACK_POSTGRES_DIR, STACK_POSTGRES_BIN).
# A PostgreSQL of yours: PREFECT_SERVER_DATABASE_CONNECTION_URL=postgresql+asyncpg://user:pass@host:5432/db make stack
# PREFECT_PORT picks another port. See docs/deployments-postgres.md.
# From another shell:  export PREFECT_HOME=$PWD/.prefect PREFECT_API_URL=http://127.0.0.1:4200/api
.PHONY: stack server deploy worker test-deployments test-ui
PREFECT_PORT ?= 4200
DB ?=
STACK := PREFECT_PORT=$(PREFECT_PORT) $(PY) -m deployments.stack $(if $(DB),--database $(DB))

stack: install
	$(STACK) up

server: install
	$(STACK) server

deploy: install
	$(STACK) deploy

worker: install
	$(STACK) worker

# The end-to-end deployment tests alone (real server, worker and signals; about 3-4 minutes), on SQLite, or on
# PostgreSQL with DB=postgres. `make test` runs the whole module on one and its crash-restart test on the other
# (tests/integration/test_deployments_postgres.py).
test-deployments: install
	TEST_STACK_DATABASE=$(or $(DB),sqlite) $(PY) -m pytest -q --durations=0 tests/integration/test_deployments.py

# The Prefect UI read by headless Chromium: a crash-restarted run's artifacts and hostile names (~2 minutes).
# UPDATE_UI_SCREENSHOTS=1 make test-ui also refreshes the screenshots in docs/ that docs/deployments.md shows.
test-ui: install
	$(PY) -m pytest -q tests/integration/test_ui.py
