#!/usr/bin/env bash
# The GPU checks in one command, for a bare GPU machine (the device tool's nvidia-h100-x1 / nvidia-h200): run from the
# repo root there, with the wheels of the few packages that machine lacks in .whl/ (carried; how to make them:
# below). Nothing is fetched: that machine reaches no registry.
#
#   bash scripts/gpu_check.sh        # logs into $OUT (the device tool's folder that comes back), else /tmp/gpu_check
#
# Steps, each under `timeout`, all together within GPU_CHECK_BUDGET seconds (default 540):
#   1. the wheels into /tmp/site (PYTHONPATH), as the device tool's README says
#   2. the project itself: `pip install --no-deps --no-build-isolation --no-index -e .` (entry points registered);
#      if that fails (an old setuptools there, say), the checkout goes on PYTHONPATH instead: tests/gpu allow their
#      recipe themselves and need no entry point
#   3. nvidia-smi -L, torch and CUDA as python3 sees them
#   4. make test-gpu (tests/gpu; the same pytest line without make if make is missing)  -> $OUT/test-gpu.log
#   5. python3 -m bench gpu_snapshot, if bench/gpu_snapshot.py exists                   -> $OUT/bench-gpu.log
# Exit status: 0 when every step that ran passed, else 1 (the summary at the end says which failed).
#
# The wheels, made on a machine with PyPI, for the device's Python (3.12, x86_64; see the device tool's KINDS.md);
# versions as the project's .venv resolved them (constraints.txt pins only torch, which the device has):
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
#     pydantic==2.14.4 pydantic-core==2.50.5 pydantic-settings==2.16.3 annotated-types==0.8.0 \
#     typing-inspection==0.4.5 typing-extensions==4.16.0 python-dotenv==1.2.4 tenacity==9.2.1 xxhash==4.1.0
# (typing-extensions: pydantic 2.14 needs >= 4.16, newer than the image may hold.) Prefect, s3fs and botocore are not
# needed: nothing that tests/gpu imports imports them.
set -u
cd "$(dirname "$0")/.."

OUT=${OUT:-/tmp/gpu_check}
WHEELS=${WHEELS:-.whl}
SITE=${SITE:-/tmp/site}
BUDGET=${GPU_CHECK_BUDGET:-540}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INPUT=1
start=$SECONDS
failed=()

# timeout for a step: its own cap, or what is left of the budget if that is less (at least 5 s)
cap() {
	local left=$((BUDGET - (SECONDS - start)))
	((left < 5)) && left=5
	echo $((left < $1 ? left : $1))
}

# step NAME CAP CMD...: runs CMD under timeout, says how it ended
step() {
	local name=$1 limit
	limit=$(cap "$2")
	shift 2
	echo "=== $name (timeout ${limit}s, $((SECONDS - start))s elapsed)"
	timeout -s INT -k 20 "$limit" "$@" # SIGINT first: pytest still prints what failed and why
	local rc=$?
	((rc == 124 || rc == 130 || rc == 137)) && echo "=== $name: TIMED OUT after ${limit}s"
	((rc != 0)) && failed+=("$name (rc $rc)")
	echo "=== $name: rc $rc"
	return $rc
}

if ! ls "$WHEELS"/*.whl >/dev/null 2>&1; then
	echo "no wheels in $WHEELS/: carry .whl (see the top of $0)" >&2
	exit 2
fi

# 1. The missing packages, outside the image's site-packages.
step wheels 120 python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
	--target "$SITE" "$WHEELS"/*.whl || exit 1
export PYTHONPATH=$SITE

# 2. The project: editable, offline, with the image's own setuptools (pyproject: setuptools.build_meta).
# Not a failure of the checks if it fails: the checkout on PYTHONPATH serves them.
echo "=== project-install ($((SECONDS - start))s elapsed)"
if timeout -k 10 "$(cap 120)" python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . \
	>"$OUT/project-install.log" 2>&1; then
	echo "=== the project: pip install -e . (entry points registered)"
else
	export PYTHONPATH=$PWD:$SITE
	tail -n 3 "$OUT/project-install.log"
	echo "=== the project: not installed (no entry points); PYTHONPATH=$PYTHONPATH"
fi

# 3. The machine as python3 sees it.
step nvidia-smi 30 nvidia-smi -L
step torch 90 python3 -c '
import sys, torch, pydantic, training, checkpointing
print(sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available(),
      torch.cuda.get_device_name(0) if torch.cuda.is_available() else "-", "pydantic", pydantic.VERSION)
print("training from", training.__file__)'

# 4. tests/gpu.
set -o pipefail
if command -v make >/dev/null; then
	step test-gpu 300 make test-gpu GPU_PY=python3 2>&1 | tee "$OUT/test-gpu.log"
else
	step test-gpu 300 python3 -m pytest -q -rs -p no:cacheprovider -o addopts="" tests/gpu 2>&1 | tee "$OUT/test-gpu.log"
fi
# (step ran in a pipeline's subshell: its verdict comes back through the status only)
(($? != 0)) && failed+=("test-gpu")

# 5. The snapshot benchmark, once it exists.
if [[ -f bench/gpu_snapshot.py ]]; then
	step bench-gpu 300 python3 -m bench gpu_snapshot 2>&1 | tee "$OUT/bench-gpu.log"
	(($? != 0)) && failed+=("bench-gpu")
else
	echo "=== bench-gpu: skipped (no bench/gpu_snapshot.py)"
fi

echo "=== done in $((SECONDS - start))s; logs in $OUT"
if ((${#failed[@]})); then
	printf '=== FAILED: %s\n' "${failed[@]}"
	exit 1
fi
echo "=== all passed"
