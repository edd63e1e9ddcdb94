"""A flow run whose report carries hostile names, for the UI test: ``python -m tests.integration.hostile_report
<save_folder>`` (with PREFECT_API_URL set) prints the flow run's id.

A run's parameters, a recipe's metric names and a bucket's manifests reach the Prefect UI through the run
report. Training cannot choose them freely here (run names are validated), so this flow hands RunReport the
results a hostile recipe or bucket could produce: eval metrics and a resumed-from named with HTML and
markdown that would add an image, a link or a script if the report did not escape them. It also leaves two
summary cards behind first, as two racing attempts of one flow run could, which the report must fold into one.
"""

from __future__ import annotations

import sys

from prefect import flow
from prefect.artifacts import create_markdown_artifact
from prefect.runtime import flow_run

from checkpointing import CheckpointStore
from flows.artifacts import RunReport, artifact_key
from training.config import TrainConfig
from training.unit.loop import UnitResult

HOSTILE = (
    '<img src=x onerror="document.title=1"><b>bold</b> [click](javascript:alert(1)) ![i](http://127.0.0.1:9/t.png)'
)
RUN_NAME = "hostile_run.1"


def units() -> list[UnitResult]:
    out = []
    for n in range(3):
        step = 8 * (n + 1)
        out.append(
            UnitResult(
                unit=n,
                checkpoint=f"memory://nowhere/ep{n + 1}",
                checkpoint_name=f"ep{n + 1}-ba{step}-sa{32 * step}",
                progress={"epoch": n + 1, "step": step, "samples_seen": 32 * step, "sample_in_epoch": 0},
                complete=n == 2,
                checkpoint_committed=True,
                origin="store",
                steps=8,
                resumed_from=HOSTILE,
                metrics={
                    "loss": 2.0 - n / 2,
                    "samples_per_second": 1000.0,
                    "checkpoint_seconds": 0.1,
                    "eval_accuracy": 0.4 + n / 10,
                    "eval_" + HOSTILE: 1.0 + n,
                },
                num_train_samples=256,
            )
        )
    return out


@flow(name="hostile-report", flow_run_name=RUN_NAME)
def hostile_report(save_folder: str) -> str:
    config = TrainConfig(run_name=RUN_NAME, save_folder=save_folder, max_duration="3ep")
    for attempt in (1, 2):  # as if two attempts of this flow run had raced: the report keeps one card
        create_markdown_artifact(f"attempt {attempt}", key=artifact_key(RUN_NAME, "summary"))
    report = RunReport(config, CheckpointStore(save_folder, RUN_NAME), None)
    done = units()
    for result in done:
        report.unit_done(result)
    report.finish(done, {HOSTILE: 0.5, "accuracy": 0.75}, started_from=HOSTILE)
    return str(flow_run.id)


if __name__ == "__main__":
    print(hostile_report(sys.argv[1]))
