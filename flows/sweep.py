"""The sweep flow: many trials of one recipe, each an ordinary run, scheduled from a ledger kept in the store.

python -m flows.sweep --recipe digits --max_duration 4ep --space '{"recipe_args.lr": {"loguniform": [1e-3, 1e-1]}}' \
    --num_samples 8 --scheduler asha --metric eval_accuracy --mode max
from flows.sweep import sweep, SweepConfig; sweep(SweepConfig(train=TrainConfig(...), space={...}))

Every trial is a run under ``<save_folder>/<sweep_name>`` (``t000``, ``t001``, ...) trained by the training flow in a
process of its own (tasks/trial.py), at most ``max_concurrent_trials`` at once (Prefect's thread-pool task runner).
What the sweep knows is in its ledger (checkpointing/ledger.py): each decision and each trial segment's result is an
event committed to the store before the sweep acts on it, and the schedulers (training/sweep/) decide from the
ledger alone, the same way whatever order trials finished in. So a sweep killed at any moment and launched again
with the same command continues: finished segments are not run again, a segment that was running is run again and
its run resumes from its newest checkpoint, and ASHA's pauses and PBT's exploits are not decided twice.
"""

# No `from __future__ import annotations`: Prefect validates the `config` parameter from this module's annotations
# (flows/train.py says why).
import os
import socket
import sys
from concurrent.futures import FIRST_COMPLETED
from concurrent.futures import wait as wait_any
from typing import Any

from prefect.context import FlowRunContext
from prefect.futures import PrefectConcurrentFuture
from prefect.runtime import flow_run
from prefect.task_runners import ThreadPoolTaskRunner

from checkpointing import Ledger, copy_checkpoint
from checkpointing.io.storage import Storage
from flows import cli, ship_module_logs
from flows.restarts import AttemptAlive, end_dead_attempts, is_deployment_run, leave
from flows.sweep_claims import verify_claims
from flows.sweep_report import SweepReport, SweepResult, done_line
from flows.train import TrainFlow, check_restart_cap
from tasks.trial import CHILDREN, SegmentOutcome, run_trial, trial_error
from tasks.trial_runner import RUNNERS
from training import preemption
from training.config import ConfigError, TrainConfig
from training.config.trust import confine_locations, release_locations
from training.exceptions import TrialStopped
from training.preemption import Preempted
from training.recipe.loader import allow_recipe, resolve_recipe
from training.start.store import store_retry
from training.sweep import Job, Study, SweepConfig, checkpoint_key, plan, spec_differences, unfinished_segments

__all__ = ["SweepConfig", "SweepResult", "TrainConfig", "main", "sweep"]

_POLL_SECONDS = 1.0  # how often the sweep looks for a stop request while trials run
_MAX_DECISIONS = 100_000  # a scheduler that keeps deciding without a trial running is a bug: stop, do not spin


class SweepStopped(Preempted):
    """The sweep stopped on request: its running trials committed where they stood and the ledger holds the rest."""

    def describe(self) -> str:
        return f"{self.stop.reason}: stopped; {self.note}"


def sweep_flow(config: SweepConfig) -> SweepResult:
    """Run ``config``'s trials, at most ``max_concurrent_trials`` at once, as its scheduler decides."""
    ship_module_logs()
    end_dead_attempts()
    check_restart_cap(config.train.max_restarts)
    untrusted = is_deployment_run()
    if untrusted:
        refuse_storage_options_in_parameters()
        confine_locations(config.train)  # the ledger and the copies too: under the worker's roots, through no link
    try:
        # AttemptAlive: a deployment run's sign of life every 5 s, which the reconciler reads (deployments/recovery.py)
        with preemption.handling(config.train.preemption_signals, hold=True), AttemptAlive():
            return Sweep(config, untrusted).run()
    except Preempted as stop:
        raise leave(stop) from None
    finally:
        if untrusted:
            release_locations()


sweep = TrainFlow(sweep_flow, name="sweep", flow_run_name="{config.sweep_name}", validate_parameters=True)


class Sweep:
    """One attempt at a sweep: its ledger, the study folded from it, and the trials running now."""

    def __init__(self, config: SweepConfig, untrusted: bool):
        self.config, self.untrusted = config, untrusted
        self.recipe_path = resolve_recipe(config.train.recipe)  # a recipe this worker does not allow: refused here
        self.folder = config.sweep_folder
        self.storage = Storage(self.folder, config.train.storage_options, store_retry(config.train))
        self.ledger = Ledger(self.storage, writer=f"{socket.gethostname()}:{os.getpid()}:{flow_run.id or 'local'}")
        self.events = self.ledger.read()
        self.report = SweepReport(config, self.folder)
        self.study = Study.fold(self.events)
        for warning in verify_claims(self.study, config, self.storage):  # the ledger is a claim, not a fact
            self.report.warn(warning)
        self.running: dict[Any, Job] = {}
        self._begin()

    def _begin(self) -> None:
        spec = self.config.spec()
        if not self.events:
            self.record("sweep_started", {"sweep_name": self.config.sweep_name, "spec": spec})
            return
        differ = spec_differences(self.events[0].body.get("spec") or {}, spec)
        if differ:
            raise ConfigError(
                f"sweep_name={self.config.sweep_name!r} was started with another search ({'; '.join(differ)}); "
                f"relaunch it with the same options to continue it, or choose a new sweep_name"
            )

    def record(self, kind: str, body: dict[str, Any]) -> None:
        event = self.ledger.append(kind, body)
        self.events.append(event)
        self.study.apply(event.kind, event.body, event.seq)

    # -- the loop --------------------------------------------------------------------------------
    def run(self) -> SweepResult:
        runner: ThreadPoolTaskRunner[Any]
        size = self.config.max_concurrent_trials
        # The warm runners close before the task runner's threads end: a runner dies with the thread that forked it.
        with ThreadPoolTaskRunner(max_workers=size) as runner, RUNNERS.opened(size):
            for job in unfinished_segments(self.study):  # started by an attempt that died: its run resumes
                self._submit(runner, job, started=True)
            while True:
                self._stop_if_requested()
                jobs, done = self._decide()
                for job in jobs[: self.config.max_concurrent_trials - len(self.running)]:
                    self._submit(runner, job, started=False)
                if not self.running:
                    if done:
                        break
                    raise RuntimeError(f"sweep {self.config.sweep_name}: nothing runs and nothing can start")
                self._wait_for_one()
        return self._finish()

    def _decide(self) -> tuple[list[Job], bool]:
        """The scheduler's decisions, recorded (an exploit after its copy landed), until it has none left."""
        for _ in range(_MAX_DECISIONS):
            planned = plan(self.study, self.config)
            for warning in planned.warnings:
                self.report.warn(warning)
            if not planned.decisions:
                return planned.jobs, planned.done
            for kind, body in planned.decisions:
                if kind == "exploit":
                    body = {**body, "copy": self._copy(body)}
                self.record(kind, body)
        raise RuntimeError(f"sweep {self.config.sweep_name}: the scheduler kept deciding without training")

    def _copy(self, exploit: dict[str, Any]) -> str:
        """PBT's exploit: the donor's committed checkpoint copied inside the store (server-side on S3) to where the
        exploiting trial's next run starts from; a copy an attempt left half done is simply made again."""
        donor = self.study.trials[exploit["donor"]]
        source = checkpoint_key(exploit["donor_checkpoint"], self.storage.uri(), donor.runs())
        if source is None:
            raise ConfigError(
                f"sweep {self.config.sweep_name}: the donor checkpoint {str(exploit['donor_checkpoint'])[:300]!r} is "
                f"not one of {donor.name}'s own checkpoints in the sweep folder"
            )
        target = f"sweep/exploits/{exploit['run_name']}/checkpoints/{source.rsplit('/', 1)[-1]}"
        return copy_checkpoint(self.storage, source, target)

    def _submit(self, runner: ThreadPoolTaskRunner, job: Job, started: bool) -> None:
        if not started:
            self.record(
                "segment_started",
                {
                    "trial": job.trial,
                    "run_name": job.run_name,
                    "target_units": job.target_units,
                    "load_path": job.load_path,
                    "params": job.params,
                },
            )
        config = self.config.trial_config(job.params, job.run_name, job.target_units, job.load_path)
        task = run_trial.with_options(retries=self.config.trial_retries, retry_delay_seconds=1)
        future = runner.submit(
            task, parameters={"config": config, "recipe_path": self.recipe_path, "untrusted": self.untrusted}
        )
        self.running[future] = job

    def _wait_for_one(self) -> None:
        futures: dict[Any, PrefectConcurrentFuture[Any]] = {f.wrapped_future: f for f in self.running}
        finished, _ = wait_any(list(futures), timeout=_POLL_SECONDS, return_when=FIRST_COMPLETED)
        for wrapped in finished:
            future = futures[wrapped]
            job = self.running.pop(future)
            self._segment_finished(job, future)

    def _segment_finished(self, job: Job, future: PrefectConcurrentFuture[Any]) -> None:
        body: dict[str, Any] = {"trial": job.trial, "run_name": job.run_name, "target_units": job.target_units}
        try:
            outcome: SegmentOutcome = future.result()
        except TrialStopped:
            return  # the sweep is stopping: the segment stays unfinished in the ledger, and the relaunch resumes it
        except Exception as exc:
            self.record("segment_finished", {**body, "status": "failed", **trial_error(exc), "units": []})
            self.report.trial_failed(job.trial, exc)
            return
        trial_config = self.config.trial_config(job.params, job.run_name, job.target_units, job.load_path)
        units = self.report.units_of(outcome, trial_config, job.target_units)
        self.record(
            "segment_finished",
            {
                **body,
                "status": "ok",
                "error": "",
                "units": units,
                "units_trained": outcome.units_trained,
                "started_from": outcome.started_from,
            },
        )
        self.report.publish(self.study)

    def _stop_if_requested(self) -> None:
        stop = preemption.STOP.current
        if stop is None:
            return
        forwarded = CHILDREN.signal()
        self.report.stopping(forwarded)
        while self.running:  # each trial commits where it stands (its own grace) and exits
            self._wait_for_one()
        note = (
            f"{forwarded} running trial(s) committed where they stood, and the ledger {self.ledger.uri} holds the rest"
        )
        raise SweepStopped(stop, self.ledger.uri, 0, None, note=note)

    def _finish(self) -> SweepResult:
        self.report.publish(self.study)  # the scheduler recorded sweep_finished (the best trial) when it was done
        return self.report.result(self.study, self.ledger.uri)


def refuse_storage_options_in_parameters() -> None:
    """storage_options may hold credentials and endpoints: from the worker's environment, never a parameter (as for
    the training flow: flows/train.py)."""
    context = FlowRunContext.get()
    raw = (context.flow_run.parameters or {}).get("config") if context and context.flow_run else None
    train = raw.get("train") if isinstance(raw, dict) else None
    if isinstance(train, dict) and any(str(k).lower().replace("-", "_") == "storage_options" for k in train):
        raise ConfigError(
            "storage_options cannot be set through a flow-run parameter (the API stores parameters, and they choose "
            "endpoints); set TRAIN_STORAGE_OPTIONS in the environment of the worker instead"
        )


def main(argv: list[str] | None = None) -> int:
    """``python -m flows.sweep``: exit 0 when every trial has ended, else non-zero with one clear message."""
    from flows.options import sweep_options

    def check(config: TrainConfig, options: dict[str, Any]) -> None:
        """Before Prefect starts: the sweep's options, and the recipe (allowed for this command, as ``python -m
        flows.train`` allows it) with its base arguments."""
        from training.start.preflight import preflight

        SweepConfig(train=config, **options)
        if ":" in config.recipe:
            allow_recipe(config.recipe)
        preflight(config)

    def run_sweep(config: TrainConfig, **options: Any) -> SweepResult:
        return sweep(SweepConfig(train=config, **options))

    def subject(config: TrainConfig, options: dict[str, Any]) -> str:
        return f"sweep {options.get('sweep_name')!r}"

    return cli.run(run_sweep, sys.argv[1:] if argv is None else argv, done_line, sweep_options(), check, subject)


if __name__ == "__main__":
    sys.exit(main())
