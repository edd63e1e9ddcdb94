"""The pieces of the run report that need no server: artifact keys, progress, batch-size changes, the SVG."""

from __future__ import annotations

import xml.etree.ElementTree as ET
from types import SimpleNamespace

import pytest
from prefect.client.schemas.actions import ArtifactCreate

from flows.artifacts import artifact_key, batch_size_changes, loss_curve_svg, percent_done
from training.config import TrainConfig


@pytest.mark.parametrize("run_name", ["Exp_1.v2", "a", "UPPER--case__x", "9lives"])
def test_artifact_keys_from_any_valid_run_name_are_accepted_by_prefect(run_name):
    key = artifact_key(run_name, "summary")
    ArtifactCreate(key=key, type="markdown", data="x")  # raises on a key Prefect would refuse
    assert key.startswith("train-") and key.endswith("-summary")


def test_progress_counts_partial_epochs_and_batches():
    epochs = TrainConfig(max_duration="4ep")
    batches = TrainConfig(max_duration="200ba")

    assert percent_done(epochs, {"epoch": 1, "sample_in_epoch": 50}, num_train_samples=100) == 37.5
    assert percent_done(epochs, {"epoch": 1, "sample_in_epoch": 50}, num_train_samples=None) == 25.0
    assert percent_done(batches, {"step": 50, "epoch": 3}, num_train_samples=100) == 25.0
    assert percent_done(batches, {"step": 400}, num_train_samples=100) == 100.0


def test_batch_size_changes_are_listed_where_they_happened():
    def ckpt(name, size):
        return SimpleNamespace(name=name, manifest=SimpleNamespace(metadata={"global_batch_size": size}))

    history = [ckpt("a", 32), ckpt("b", 32), ckpt("c", 48), ckpt("d", 48), ckpt("e", 32)]
    assert batch_size_changes(history) == ["32 -> 48 at c", "48 -> 32 at e"]


def test_loss_curve_is_well_formed_svg_with_one_point_per_unit():
    svg = loss_curve_svg([(8, 1.4), (16, 1.2), (24, 0.9)], title="run <1> & co")
    root = ET.fromstring(svg)
    ns = "{http://www.w3.org/2000/svg}"

    assert root.tag == f"{ns}svg"
    assert len(root.find(f"{ns}g").findall(f"{ns}circle")) == 3
    assert len(root.find(f"{ns}polyline").get("points").split()) == 3
    assert loss_curve_svg([(5, 1.0)], title="one unit").startswith("<svg")  # a single point, no zero division
