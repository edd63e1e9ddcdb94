# Two commands do all set-up on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.installed

.PHONY: install demo test test-fast bench s3 clean

install: $(STAMP)

# Reinstall only when the dependency files change.
$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q -c constraints.txt -e '.[test]'
	touch $(STAMP)

# Trains the digits recipe into ./runs/demo with one injected fault, which Prefect
# retries and which resumes from the last checkpoint. runs/demo is the demo's own
# folder: it is cleared so that each `make demo` shows a whole run.
demo: install
	rm -rf runs/demo
	PREFECT_SERVER_ANALYTICS_ENABLED=false $(PY) -m flows.train --run_name demo --inject_fault_at_step 30

test: install
	$(PY) -m pytest -q

test-fast: install
	$(PY) -m pytest -q -m "not slow"

# A local S3 endpoint (moto) on 127.0.0.1:5555 with a bucket 'runs'; prints how to train against it.
s3: install
	$(PY) -m deployments.local_s3

clean:
	rm -rf $(VENV) runs .pytest_cache
