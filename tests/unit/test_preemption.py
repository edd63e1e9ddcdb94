"""Preemption through the Prefect-free lifecycle: a real SIGTERM, delivered to this process by the recipe at a chosen
point and caught by the product's own handler, stops training at a step boundary with a checkpoint there; the
relaunch resumes at that exact sample and step, bit-identical to an uninterrupted run, redoing no step.

The same through real processes, a real worker and torchrun ranks is in tests/integration/test_preemption.py.
"""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from checkpointing import CheckpointStore
from checkpointing.store import STATE_FILE
from training import preemption
from training.preemption import STOP, Preempted
from training.run import Run, execute_unit
from training.unit.own_loop import run_own_loop
from training.unit.warm import SessionCache

SIGNALLED = "tests.recipes_for_tests:SignalledRecipe"
SIGNALLED_LOOP = "tests.own_loop_recipes:SignalledLoopRecipe"
STEPS = 24  # 3 epochs of 256 samples in batches of 32


@pytest.fixture(autouse=True)
def _no_stop_request_left():
    STOP.clear()
    yield
    STOP.clear()


def train_to_end(config) -> Run:
    """What the train flow does, without Prefect: open the run, train units until it is complete."""
    with preemption.handling(config.preemption_signals), Run.open(config) as run:
        while not run.complete:
            preemption.raise_if_requested(run.head, run.progress.step)  # a stop between two units
            run.record(execute_unit(config, unit=run.next_unit, start_checkpoint=run.head, generation=run.generation))
        return run


def model_of(config) -> dict[str, torch.Tensor]:
    store = CheckpointStore(config.save_folder, config.run_name)
    return store.load(store.latest(deep=True), files=[STATE_FILE]).objects[STATE_FILE]["state"]["model"]


def steps_recorded(record: Path) -> int:
    return len((record / "ids-rank0.txt").read_text().splitlines())


@pytest.fixture
def signalled(make_config, tmp_path):
    """(config, record folder) of a run of the signalled recipe; ``options`` are TrainConfig fields."""

    def make(name: str, options: dict | None = None, **args):
        record = tmp_path / f"ids-{name}"
        recipe_args = {"num_samples": 256, "record_dir": str(record), **args}
        return make_config(run_name=name, recipe=SIGNALLED, recipe_args=recipe_args, **(options or {})), record

    return make


def test_sigterm_mid_unit_commits_at_that_step_and_the_relaunch_redoes_nothing(signalled):
    reference, _ = signalled("reference")
    train_to_end(reference)
    config, record = signalled("preempted", signal_at_step=13)  # step 13: the 5th step of unit 1

    with pytest.raises(Preempted) as stopped:
        train_to_end(config)

    assert (stopped.value.step, stopped.value.checkpoint) == (13, "ep1-ba13-sa416")
    assert stopped.value.seconds is not None and "preempted by SIGTERM" in str(stopped.value)
    store = CheckpointStore(config.save_folder, config.run_name)
    assert store.latest(deep=True).name == "ep1-ba13-sa416"  # committed through the protocol: latest, verified
    assert steps_recorded(record) == 13
    STOP.clear()  # a new process would start without it

    relaunched = train_to_end(config)

    assert relaunched.units[0].resumed_from == "checkpoint ep1-ba13-sa416"
    assert steps_recorded(record) == STEPS  # no step trained twice
    assert all(torch.equal(a, b) for a, b in zip(model_of(config).values(), model_of(reference).values(), strict=True))


def test_sigterm_during_an_evaluation_cuts_it_short_and_commits_the_step_it_followed(signalled):
    reference, _ = signalled("reference", {"eval_interval": "4ba"})
    config, record = signalled("preempted", {"eval_interval": "4ba"}, signal_in_eval=3)
    train_to_end(reference)

    with pytest.raises(Preempted) as stopped:
        train_to_end(config)

    assert (stopped.value.step, stopped.value.checkpoint) == (12, "ep1-ba12-sa384")  # 3rd evaluation: after step 12
    info = CheckpointStore(config.save_folder, config.run_name).latest()
    assert "eval_step" not in info.metrics or info.metrics["eval_step"] != 12.0  # the cut evaluation reported nothing
    STOP.clear()
    train_to_end(config)
    assert steps_recorded(record) == STEPS
    assert all(torch.equal(a, b) for a, b in zip(model_of(config).values(), model_of(reference).values(), strict=True))


def test_a_stop_during_start_up_leaves_before_claiming_anything(signalled):
    config, _ = signalled("early")
    STOP.request("signal", "preempted by SIGTERM")
    with pytest.raises(Preempted) as stopped:
        train_to_end(config)
    assert stopped.value.checkpoint is None and "no checkpoint yet" in str(stopped.value)
    assert CheckpointStore(config.save_folder, config.run_name).fence.newest() == 0  # nothing claimed or written


def test_a_checkpoint_that_would_not_fit_the_grace_period_is_not_started(signalled):
    """With no grace left, the unit leaves at once and says why; the relaunch redoes the steps since the last
    checkpoint (that is the cost the grace budget chose, and it is said)."""
    config, record = signalled("tight", {"preemption_grace_seconds": 0.0}, signal_at_step=13)
    with pytest.raises(Preempted) as stopped:
        train_to_end(config)
    assert stopped.value.checkpoint == "ep1-ba8-sa256"  # the unit boundary before: nothing new was committed
    assert "no checkpoint was started: one takes about" in str(stopped.value)
    assert [i.name for i in CheckpointStore(config.save_folder, config.run_name).list()] == ["ep1-ba8-sa256"]
    STOP.clear()
    train_to_end(config)
    assert steps_recorded(record) == STEPS + 5  # steps 9-13 again


def test_a_loop_of_its_own_reports_on_should_checkpoint_and_resumes_there(make_config, tmp_path):
    args = {"num_samples": 64, "report_every": 100, "marker_dir": str(tmp_path / "m")}
    reference = make_config(run_name="ref", recipe=SIGNALLED_LOOP, recipe_args=args, max_duration="3ep")
    config = make_config(run_name="loop", recipe=SIGNALLED_LOOP, recipe_args={**args, "signal_after_update": 3},
                         max_duration="3ep")  # fmt: skip
    run_own_loop(reference, cache=SessionCache())

    with preemption.handling(["SIGTERM"]), pytest.raises(Preempted) as stopped:
        run_own_loop(config, cache=SessionCache())

    # report_every=100: only ctx.should_checkpoint made the loop report at step 3
    assert (stopped.value.step, stopped.value.checkpoint) == (3, "ep1-ba3-sa96")
    STOP.clear()
    done = run_own_loop(config, cache=SessionCache())
    assert done.resumed_from == "checkpoint ep1-ba3-sa96"
    assert all(torch.equal(a, b) for a, b in zip(model_of(config).values(), model_of(reference).values(), strict=True))


@pytest.fixture
def usr2_seen():
    """A SIGUSR2 handler of the test's own, standing for what was installed before (Prefect's, or the default that
    would end the process): the signals it sees are the ones the product let through."""
    seen: list[int] = []
    previous = signal.signal(signal.SIGUSR2, lambda signum, _frame: seen.append(signum))
    yield seen
    signal.signal(signal.SIGUSR2, previous)


def test_signals_after_the_first_are_ignored_and_stay_ignored_until_the_process_exits(usr2_seen):
    with preemption.handling(["SIGUSR2"], hold=True):
        signal.raise_signal(signal.SIGUSR2)  # the first: a stop
        signal.raise_signal(signal.SIGUSR2)  # a second `kill` while the checkpoint is written

    signal.raise_signal(signal.SIGUSR2)  # one during the exit, after the block: still ours, still ignored

    assert STOP.current is not None and STOP.current.reason == "preempted by SIGUSR2"
    assert STOP.ignored == ["SIGUSR2", "SIGUSR2"] and usr2_seen == []


def test_a_signal_during_the_interpreters_own_exit_after_a_stop_is_no_death_by_signal(tmp_path):
    """Python's finalisation puts SIG_DFL back in place of every Python handler: without SIG_IGN at exit, a SIGTERM
    there ends a clean exit with 143, which a worker reports as a crash."""
    script = tmp_path / "stops.py"
    script.write_text(
        "import os, signal, sys, time\n"
        "from training import preemption\n"
        "class SlowToFinalise:\n"
        "    def __del__(self):\n"
        "        os.write(1, b'exiting\\n'); time.sleep(3)\n"
        "held = SlowToFinalise()\n"
        "with preemption.handling(['SIGTERM'], hold=True):\n"
        "    signal.raise_signal(signal.SIGTERM)\n"
    )
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, cwd=Path(__file__).parents[2])
    assert proc.stdout is not None and proc.stdout.readline() == b"exiting\n"  # in the interpreter's finalisation
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 0


def test_a_block_that_ends_without_a_stop_gives_the_signals_back(usr2_seen):
    with preemption.handling(["SIGUSR2", "USR2"], hold=True):  # named twice (the CLI adds SIGINT to the config's)
        pass

    signal.raise_signal(signal.SIGUSR2)

    assert STOP.current is None and usr2_seen == [signal.SIGUSR2]


def test_ctrl_c_at_a_terminal_stops_then_a_second_aborts():
    with pytest.raises(KeyboardInterrupt), preemption.handling(["SIGINT"], interactive=True):
        signal.raise_signal(signal.SIGINT)
        assert STOP.current is not None and STOP.current.reason == "interrupted by Ctrl-C (SIGINT)"
        assert preemption.exit_code(STOP.current) == preemption.INTERRUPTED
        signal.raise_signal(signal.SIGINT)
        pytest.fail("the second Ctrl-C did not abort")
