"""bench/fault_matrix.py's verdict on a run's state history (issue 44): what makes a row of the matrix fail."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from bench.fault_matrix import twin_verdict, verdict

T0 = datetime(2026, 12, 6, tzinfo=UTC)
TYPES = {"Scheduled": "SCHEDULED", "Pending": "PENDING", "Running": "RUNNING", "Crashed": "CRASHED",
         "AwaitingRestart": "SCHEDULED", "Preempted": "SCHEDULED", "Completed": "COMPLETED", "Failed": "FAILED",
         "Cancelled": "CANCELLED", "Superseded": "CANCELLED"}  # fmt: skip


def history(*names: str) -> list:
    return [(T0 + timedelta(seconds=i), TYPES[name], name) for i, name in enumerate(names)]


ONE_RESTART = ("Scheduled", "Pending", "Running", "Crashed", "AwaitingRestart", "Pending", "Running", "Completed")


def test_one_death_one_restart_and_equal_weights_pass():
    assert verdict(history(*ONE_RESTART), run_count=2, equal=True) == []
    assert verdict(history("Scheduled", "Pending", "Running", "Completed"), run_count=1, equal=True) == []
    preempted = ("Scheduled", "Pending", "Running", "Preempted", "Pending", "Running", "Completed")
    assert verdict(history(*preempted), run_count=2, equal=True) == []


def test_a_completed_run_restarted_fails_twice_over():
    again = (*ONE_RESTART, "AwaitingRestart", "Pending", "Running", "Completed")
    wrong = verdict(history(*again), run_count=3, equal=True)
    assert "Completed 2 times" in wrong
    assert any(w.startswith("states after Completed: AwaitingRestart") for w in wrong)


def test_two_crashed_for_one_death_a_miscount_a_stranded_run_and_other_weights_fail():
    late = ("Scheduled", "Pending", "Running", "Crashed", "AwaitingRestart", "Crashed", "AwaitingRestart", "Pending",
            "Running", "Completed")  # fmt: skip
    assert "two Crashed for one attempt" in verdict(history(*late), run_count=2, equal=True)
    assert any("restarts" in w for w in verdict(history(*late), run_count=2, equal=True))  # 2 restarts for one run
    assert verdict(history("Scheduled", "Pending", "Running"), run_count=1, equal=None) == [
        "ended Running",
        "no weights",
    ]
    assert verdict(history(*ONE_RESTART), run_count=2, equal=False) == ["weights differ"]


def test_a_healthy_run_marked_crashed_fails():
    alive = ("Scheduled", "Pending", "Running", "Crashed", "Completed")  # the attempt lived on under the Crashed
    assert verdict(history(*alive), run_count=1, equal=True) == ["Crashed without a restart (Completed next)"]


def test_the_twin_that_lost_passes_only_ending_once_never_crashed_or_restarted():
    assert twin_verdict(history("Scheduled", "Pending", "Running", "Superseded"), run_count=1) == []
    assert twin_verdict(history("Scheduled", "Pending", "Running", "Failed"), run_count=1) == []
    ping_pong = ("Scheduled", "Pending", "Running", "Crashed", "AwaitingRestart", "Pending", "Running", "Superseded")
    assert any("Crashed or restarted" in w for w in twin_verdict(history(*ping_pong), run_count=2))
    assert twin_verdict(history("Scheduled", "Pending", "Running", "Completed"), run_count=1) == [
        "the other run ended Completed"
    ]
    again = twin_verdict(history("Scheduled", "Pending", "Running", "Superseded", "AwaitingRestart"), run_count=1)
    assert "the other run's states after its end: AwaitingRestart" in again
