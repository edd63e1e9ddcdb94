"""What the unit's process reads as a rank's death (training/distributed/deaths.py): torchrun's failure record as it
prints it (torch 2.x's template), and the ranks' own records."""

from __future__ import annotations

import json
from pathlib import Path

from training.distributed.deaths import Death, dead_rank, root_failure, verdict
from training.exceptions import RankDied, RemoteError
from training.preemption import Preempted

SUMMARY = """\
============================================================
training.distributed.rank FAILED
------------------------------------------------------------
Failures:
[1]:
  time      : 2026-12-05_18:50:29
  host      : localhost
  rank      : 0 (local_rank: 0)
  exitcode  : 1 (pid: 18386)
  error_file: <N/A>
  traceback : To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-12-05_18:50:29
  host      : localhost
  rank      : 1 (local_rank: 1)
  exitcode  : -9 (pid: 18387)  (SIGKILL)
  error_file: <N/A>
  traceback : Signal 9 (SIGKILL) received by PID 18387
============================================================"""
PREEMPTED = {"type": "Preempted", "message": "preempted by SIGTERM", "rank": 0, "kind": "signal",
             "reason": "preempted by SIGTERM", "checkpoint": "ep6-ba6-sa0", "step": 6}  # fmt: skip


def prefixed(text: str) -> list[str]:
    return [f"18:50:29.925 | INFO    | training.distributed.gang - {line}" for line in text.splitlines()]


def test_the_root_cause_is_the_rank_torchrun_saw_fail_first_not_the_survivor_it_stopped():
    assert root_failure(prefixed(SUMMARY)) == Death(1, -9)
    assert root_failure(["no summary here"]) is None
    assert Death(1, -9).describe() == "rank 1 died (SIGKILL, exit -9)"


def test_a_survivor_s_preempted_is_part_of_the_crash_unless_this_process_was_stopped_first(tmp_path: Path):
    (tmp_path / "error-rank0.json").write_text(json.dumps(PREEMPTED))
    error = verdict(tmp_path, SUMMARY.splitlines(), 2, True, False, "ended", 1)
    assert isinstance(error, RankDied) and error.signature == (1, -9, 6)
    assert str(error).startswith("rank 1 died (SIGKILL, exit -9) after step 6; torchrun stopped the other ranks")
    assert isinstance(verdict(tmp_path, SUMMARY.splitlines(), 2, True, True, "ended", 1), Preempted)


def test_a_rank_that_raised_is_its_own_error_and_a_silent_rank_is_a_death(tmp_path: Path):
    (tmp_path / "error-rank1.json").write_text(json.dumps({"type": "ValueError", "message": "bad", "rank": 1}))
    raised = SUMMARY.replace("exitcode  : -9 (pid: 18387)  (SIGKILL)", "exitcode  : 1 (pid: 18387)")
    assert isinstance(verdict(tmp_path, raised.splitlines(), 2, True, False, "ended", 1), RemoteError)
    # No summary (torchrun's output lost): rank 0 left no record while rank 1 left one.
    assert dead_rank([], {1: (0.0, {})}, 2, exited=True) == Death(0, None)
    assert dead_rank([], {1: (0.0, {})}, 2, exited=False) is None  # killed by this process: silence proves nothing
