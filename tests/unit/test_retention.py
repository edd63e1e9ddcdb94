"""Retention: newest N, or the best N by a metric plus the newest, and never what `latest` names."""

from __future__ import annotations

import uuid

import torch

from checkpointing import CheckpointStore, Writer


def store_with(losses: list[float]) -> CheckpointStore:
    store = CheckpointStore(f"memory://{uuid.uuid4().hex}", "r")
    for i, loss in enumerate(losses):
        store.save(
            f"c{i}",
            {"state.pt": {"w": torch.full((2,), float(i))}},
            progress={"samples_seen": i},
            metadata={"metrics": {"loss": loss}},
            writer=Writer.current(1),
        )
    return store


def names(store: CheckpointStore) -> list[str]:
    return [i.name for i in store.list()]


def test_keep_best_by_a_metric_keeps_the_n_lowest_losses_and_the_newest():
    store = store_with([0.9, 0.1, 0.5, 0.2, 0.7])
    deleted = store.prune(2, score_attribute="loss", score_order="min")
    # the 2 best by loss, c1 (0.1) and c3 (0.2), plus the newest (c4, loss 0.7), which a resume needs
    assert names(store) == ["c1", "c3", "c4"]
    assert sorted(deleted) == ["c0", "c2"]


def test_keeping_one_by_a_score_keeps_the_best_and_the_newest_never_one_for_the_other():
    store = store_with([0.9, 0.1, 0.5, 0.6])
    store.prune(1, score_attribute="loss", score_order="min")
    assert names(store) == ["c1", "c3"]  # Ray's num_to_keep=1 with a score; Lightning's save_top_k=1 plus last
    store = store_with([0.9, 0.5, 0.1])  # the newest is also the best: one checkpoint is enough
    store.prune(1, score_attribute="loss", score_order="min")
    assert names(store) == ["c2"]


def test_keep_best_with_max_order_prefers_higher_values():
    store = store_with([0.9, 0.2, 0.5, 0.1, 0.7])
    store.prune(3, score_attribute="loss", score_order="max")
    assert names(store) == ["c0", "c2", "c4"]


def test_keep_newest_ignores_metrics():
    store = store_with([0.9, 0.2, 0.5, 0.1, 0.7])
    store.prune(2)
    assert names(store) == ["c3", "c4"]
