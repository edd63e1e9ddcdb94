"""The pieces of the run report that need no server: keys, escaping, the per-unit table, curves, progress, ETA."""

from __future__ import annotations

import itertools
import json
import re
import xml.etree.ElementTree as ET
from types import SimpleNamespace

import pytest
from prefect.client.schemas.actions import ArtifactCreate

from flows import artifact_content as content
from flows.artifacts import artifact_key, percent_done, unit_of
from flows.run_summary import batch_size_changes
from training.config import TrainConfig

HOSTILE = '<img src=x onerror="alert(1)"> [x](javascript:alert(1)) `a` | *b* _c_ ![i](http://evil/t.png) \\ &amp;'
SVG = "{http://www.w3.org/2000/svg}"


def unit(n: int, loss: float, **metrics) -> SimpleNamespace:
    """A UnitResult as train_unit returns it (only the fields the report reads)."""
    step = 8 * (n + 1)
    return SimpleNamespace(
        unit=n,
        checkpoint_name=f"ep{n + 1}-ba{step}-sa{32 * step}",
        progress={"epoch": n + 1, "step": step, "samples_seen": 32 * step, "sample_in_epoch": 0},
        resumed_from="fresh initialization" if n == 0 else f"checkpoint ep{n}-ba{step - 8}-sa{32 * (step - 8)}",
        metrics={"train_loss": loss, "samples_per_second": 1000.0 + n, "checkpoint_seconds": 0.25, **metrics},
        num_train_samples=256,
    )


@pytest.mark.parametrize("run_name", ["Exp_1.v2", "a", "UPPER--case__x", "9lives"])
def test_artifact_keys_from_any_valid_run_name_are_accepted_by_prefect(run_name):
    key = artifact_key(run_name, "summary")
    ArtifactCreate(key=key, type="markdown", data="x")  # raises on a key Prefect would refuse
    assert key.startswith("train-") and key.endswith("-summary")


def test_md_escape_leaves_no_markdown_or_html_syntax_unescaped():
    escaped = content.md_escape(HOSTILE + "\nsecond line")

    assert "\n" not in escaped  # a newline could open a new block
    # every ASCII punctuation character is preceded by a backslash (which CommonMark shows literally)
    assert not re.search(r"(?<!\\)[<>\[\]()`|*_!&]", escaped.replace("\\\\", ""))
    assert content.md_unescape(escaped) == " ".join((HOSTILE + "\nsecond line").split())


def test_md_code_fences_a_backtick_inside_with_a_longer_fence():
    assert content.md_code("s3://bucket/runs/x_y") == "`s3://bucket/runs/x_y`"
    assert content.md_code("a`b``c") == "```a`b``c```"
    assert content.md_code("`edge`") == "`` `edge` ``"
    assert content.md_code("") == ""


def test_table_has_fixed_columns_then_every_eval_metric_and_escapes_names():
    rows = [
        content.unit_row(unit(0, 1.5), attempt=1),
        content.unit_row(unit(1, 1.0, eval_accuracy=0.5, **{"eval_" + HOSTILE: 2.0}), attempt=2),
    ]
    rows[1]["resumed_from"] = HOSTILE

    table = content.table(rows)

    columns = list(table[0])
    safe = content.safe_column("eval_" + HOSTILE)
    evals = sorted(["eval_accuracy", safe])
    assert columns == ["unit", "epoch", "step", "samples", "train_loss", *evals, *content.AFTER_EVAL]
    assert re.fullmatch(r"[A-Za-z0-9_.-]+", safe)
    assert table[0]["eval_accuracy"] is None and table[1]["eval_accuracy"] == 0.5
    assert table[1]["resumed from"] == content.md_escape(HOSTILE)
    assert table[0]["checkpoint"] == "ep1-ba8-sa256"  # plain names stay readable in the API
    assert [t["attempt"] for t in table] == [1, 2]
    json.dumps(table, allow_nan=False)  # what the API receives


def test_rows_read_back_from_a_published_table_equal_the_originals():
    rows = [content.unit_row(unit(0, 1.5, eval_accuracy=0.25), attempt=1)]
    rows[0]["resumed_from"] = HOSTILE

    back = [content.row_from_table(line) for line in json.loads(json.dumps(content.table(rows)))]

    assert back[0]["resumed_from"] == " ".join(HOSTILE.split())
    assert back[0]["eval"] == {"eval_accuracy": 0.25}
    assert {k: back[0][k] for k in ("unit", "checkpoint", "step", "samples", "train_loss", "checkpoint_seconds")} == {
        "unit": 0,
        "checkpoint": "ep1-ba8-sa256",
        "step": 8,
        "samples": 256,
        "train_loss": 1.5,
        "checkpoint_seconds": 0.25,
    }


def test_curves_have_one_panel_per_metric_and_one_point_per_unit():
    rows = [content.unit_row(unit(i, 2.0 - i / 2, eval_accuracy=0.3 + i / 10), attempt=1) for i in range(3)]
    series = content.curves(rows)

    svg = content.curve_svg(series, title=HOSTILE)

    root = ET.fromstring(svg)  # well-formed: the hostile title is escaped
    assert list(series) == ["train_loss", "eval_accuracy"]
    lines = root.findall(f"{SVG}polyline")
    assert [len(line.get("points").split()) for line in lines] == [3, 3]
    assert content.curve_svg({"train_loss": [(5, 1.0)]}, title="one unit").startswith(
        "<svg"
    )  # one point, no zero division
    image = content.svg_image(svg, "curves")
    assert image.startswith("![curves](data:image/svg+xml;base64,") and image.endswith(")")


def test_long_curves_are_thinned_keeping_first_and_last():
    points = [(i, float(i)) for i in range(10_000)]
    kept = content.thinned(points, 400)
    assert len(kept) == 400 and kept[0] == points[0] and kept[-1] == points[-1]
    assert content.sparkline([3.0, 2.0, 1.0, 1.0]) == "█▅▁▁"


def test_progress_counts_partial_epochs_and_batches():
    epochs = TrainConfig(max_duration="4ep")
    batches = TrainConfig(max_duration="200ba")

    assert percent_done(epochs, {"epoch": 1, "sample_in_epoch": 50}, num_train_samples=100) == 37.5
    assert percent_done(epochs, {"epoch": 1, "sample_in_epoch": 50}, num_train_samples=None) == 25.0
    assert percent_done(batches, {"step": 50, "epoch": 3}, num_train_samples=100) == 25.0
    assert percent_done(batches, {"step": 400}, num_train_samples=100) == 100.0


def test_total_samples_and_eta_say_what_is_left():
    epochs, batches = TrainConfig(max_duration="4ep").duration, TrainConfig(max_duration="200ba").duration

    assert content.total_samples(epochs, {}, num_train_samples=256, batch=32) == 1024
    assert content.total_samples(epochs, {}, num_train_samples=None, batch=32) is None
    # after a resize to batch 64, 160 samples in at (continued) step 2: 198 more steps of 64
    assert content.total_samples(batches, {"samples_seen": 160, "step": 2}, None, batch=64) == 160 + 198 * 64
    assert content.total_samples(SimpleNamespace(unit="sp", value=5000), {}, None, batch=32) == 5000

    text = content.progress_text(done=256, total=1024, rate=128.0, attempt=2)
    assert text == "256 / 1,024 samples · ETA 6 s at 128 samples/s · flow run attempt 2 (restarted 1×)"
    assert content.duration_text(3725) == "1 h 02 min" and content.duration_text(125) == "2 min 05 s"
    assert "total known after the first unit" in content.progress_text(0, None, None, 1)


def test_unit_of_a_manifest_is_the_unit_that_ended_there():
    per_epoch, per_8_batches = TrainConfig(save_interval="1ep"), TrainConfig(save_interval="8ba")

    assert unit_of({"epoch": 1, "sample_in_epoch": 0, "step": 8}, per_epoch) == 0
    assert unit_of({"epoch": 3, "sample_in_epoch": 0, "step": 24}, per_epoch) == 2
    assert unit_of({"epoch": 1, "sample_in_epoch": 64, "step": 10}, per_epoch) == 1  # a last, partial unit
    assert unit_of({"step": 8}, per_8_batches) == 0 and unit_of({"step": 30}, per_8_batches) == 3


def test_batch_size_changes_are_listed_where_they_happened():
    def ckpt(name, size):
        return SimpleNamespace(name=name, manifest=SimpleNamespace(metadata={"global_batch_size": size}))

    history = [ckpt("a", 32), ckpt("b", 32), ckpt("c", 48), ckpt("d", 48), ckpt("e", 32)]
    assert batch_size_changes(history) == ["32 -> 48 at c", "48 -> 32 at e"]


@pytest.mark.filterwarnings("ignore:Artifact creation outside of a flow:FutureWarning")
def test_an_unreachable_prefect_api_costs_warnings_never_the_run(tmp_path, caplog):
    import logging

    from prefect.settings import PREFECT_API_URL, PREFECT_CLIENT_MAX_RETRIES, temporary_settings

    from checkpointing import CheckpointStore
    from flows.artifacts import RunReport
    from training.unit.loop import UnitResult

    config = TrainConfig(run_name="offline", save_folder=str(tmp_path), max_duration="2ep")
    results = [
        UnitResult(
            complete=n == 1,
            checkpoint=f"x/{n}",
            world_size=1,
            checkpoint_committed=True,
            origin="fresh",
            steps=8,
            **vars(unit(n, 1.0)),
        )
        for n in range(2)
    ]
    with temporary_settings({PREFECT_API_URL: "http://127.0.0.1:9/api", PREFECT_CLIENT_MAX_RETRIES: 0}):
        report = RunReport(config, CheckpointStore(str(tmp_path), "offline"), None)
        for result in results:
            report.unit_done(result)
        report.finish(results, {"accuracy": 0.5}, started_from="no checkpoint")

    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and r.name == "flows.artifacts"]
    assert warnings[0].startswith("could not publish the progress artifact of offline: ConnectError")
    assert warnings[0].endswith("publishing none for 60 s")  # so the next units do not pay for the API again
    assert len(warnings) == 1
    assert (tmp_path / "offline" / "loss.svg").read_text().startswith("<svg")  # the store's copy is still written


@pytest.mark.filterwarnings("ignore:Artifact creation outside of a flow:FutureWarning")
def test_the_curves_leave_out_what_a_roll_back_set_aside(tmp_path):

    import torch
    from prefect.settings import PREFECT_API_URL, PREFECT_CLIENT_MAX_RETRIES, temporary_settings

    from checkpointing import CheckpointStore, Writer
    from flows.artifacts import RunReport

    store = CheckpointStore(str(tmp_path), "rolled")
    names = []
    for n in range(4):
        u = unit(n, 1.0 - n / 10)
        names.append(u.checkpoint_name)
        store.save(u.checkpoint_name, {"state.pt": {"w": torch.zeros(2)}}, progress=u.progress,
                   metadata={"metrics": u.metrics}, writer=Writer.current(1))  # fmt: skip
    store.roll_back(names[1], Writer.current(2))
    config = TrainConfig(run_name="rolled", save_folder=str(tmp_path), max_duration="4ep", global_batch_size=32)
    with temporary_settings({PREFECT_API_URL: "http://127.0.0.1:9/api", PREFECT_CLIENT_MAX_RETRIES: 0}):
        report = RunReport(config, store, store.latest())

    assert list(report.rows) == names[:2]


def test_a_loss_over_orders_of_magnitude_is_drawn_on_a_log_axis():
    """On a linear axis a loss from 10 to 0.01 is one drop then a flat line on the floor: the last units' change
    is invisible. On the log axis equal ratios are equal heights."""
    falling = [(i * 10, 10.0 * 0.1 ** (i / 3)) for i in range(10)]  # 10 -> 0.01, a factor 10 every 3 units
    svg = content.curve_svg({"train_loss": falling}, title="t")
    heights = [float(xy.split(",")[1]) for xy in ET.fromstring(svg).find(f"{SVG}polyline").get("points").split()]
    steps = [b - a for a, b in itertools.pairwise(heights)]
    assert "(log scale)" in svg and max(steps) - min(steps) < 0.5  # the same drop per unit, first to last
    flat = content.curve_svg({"eval_accuracy": [(1, 0.5), (2, 0.9)]}, title="t")
    assert "(log scale)" not in flat  # within one order of magnitude: linear


def test_the_summary_says_where_this_attempt_started_not_the_flow_run(monkeypatch):
    from flows import run_summary

    monkeypatch.setattr(run_summary, "flow_run_attempt", lambda: 1)
    assert run_summary.started_line("fresh initialization") == "this flow run started from: fresh initialization"
    monkeypatch.setattr(run_summary, "flow_run_attempt", lambda: 3)
    line = run_summary.started_line("checkpoint ep2-ba16-sa512")
    assert line.startswith("this attempt (flow-run attempt 3) started from: checkpoint ep2")
    assert "this flow run started from" not in line
