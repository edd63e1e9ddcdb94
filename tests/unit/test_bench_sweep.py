"""The sweep benchmark's own pieces (bench/sweep_vs_ray.py): both sides get the same 8 trials in the same order, the
ledger is read the way SWEEP_SPEC writes it, and the table puts ours / ray side by side. Neither Ray nor a sweep runs."""

from __future__ import annotations

import pytest

from bench import sweep_vs_ray as bench


def test_the_grid_has_8_trials_with_the_first_key_varying_slowest():
    trials = bench.trial_grid(bench.SPACE)
    assert len(trials) == 8
    assert trials[0] == {"recipe_args.lr": 3e-4, "recipe_args.hidden": 32}
    assert trials[1] == {"recipe_args.lr": 3e-4, "recipe_args.hidden": 128}
    assert trials[-1] == {"recipe_args.lr": 1e-2, "recipe_args.hidden": 128}


def test_ray_is_given_exactly_these_trials_as_one_grid_search_over_their_dicts():
    trials = bench.trial_grid(bench.SPACE)
    space = bench.ray_param_space(trials)
    assert space == {"params": {"grid_search": trials}}  # what tune.grid_search(trials) returns
    assert space["params"]["grid_search"] is not trials  # copies: Ray may annotate them


def test_our_sweep_is_given_the_same_grid_in_its_own_words():
    assert bench.our_space({"recipe_args.lr": [0.1, 0.2]}) == {"recipe_args.lr": {"grid": [0.1, 0.2]}}


def test_a_trials_parameters_become_the_recipes_constructor_arguments():
    assert bench.recipe_kwargs({"recipe_args.lr": 0.01, "recipe_args.hidden": 32}) == {"lr": 0.01, "hidden": 32}
    with pytest.raises(ValueError, match="global_batch_size"):
        bench.recipe_kwargs({"global_batch_size": 32})


def event(kind: str, time: float, **body) -> dict:
    return {"format": 1, "seq": 0, "kind": kind, "time": time, "writer": "w", "body": body, "sha256": ""}


def test_units_and_the_time_of_the_best_trials_last_segment_are_read_from_the_ledger():
    events = [
        event("trial_created", 100.0, trial="t000", index=0, params={"recipe_args.lr": 0.1}),
        event("trial_created", 100.0, trial="t001", index=1, params={"recipe_args.lr": 0.2}),
        event("segment_started", 101.0, trial="t000", run_name="t000", target_units=1),
        event("segment_started", 101.5, trial="t001", run_name="t001", target_units=1),
        event(
            "segment_finished",
            110.0,
            trial="t000",
            run_name="t000",
            target_units=1,
            status="ok",
            units_trained=1,
            units=[{"unit": 1, "metrics": {"train_seconds": 2.5}}],
        ),
        event("segment_finished", 111.0, trial="t001", status="ok", units_trained=1),
        event("segment_finished", 125.0, trial="t001", status="ok", units_trained=3),
        event("segment_finished", 126.0, trial="t000", status="failed", units_trained=0),
    ]
    out = bench.from_ledger(events, "t001", t0=95.0)
    assert out == {
        "units": 5,
        "best_params": {"recipe_args.lr": 0.2},
        "to_best": 30.0,
        "trials": 2,
        "per_trial": [1, 4],
        "launches": 4,
        "launch_seconds": [9.0],
        "segment": 9.0,
        "overhead": 6.5,
    }  # overhead: the segment's 9 s less its unit's 2.5 s of training


def figures(wall: float, to_best: float, units: int) -> dict:
    return {"wall": wall, "to_best": to_best, "units": units, "best_trial": "t007",
            "best_params": {"recipe_args.lr": 0.01, "recipe_args.hidden": 128}, "best_metric": 0.1, "note": "n",
            "per_trial": [4, 4, 8, 16], "launches": 4}  # fmt: skip


def test_the_table_shows_each_side_and_the_ratio_ours_over_ray():
    lines = bench.table({"ours": [figures(30.0, 20.0, 16)], "ray": [figures(60.0, 40.0, 32)]})
    assert lines[0] == "| figure | ours | ray | ours / ray |"
    assert "| whole process, s | 30.00 | 60.00 | 0.50x |" in lines
    assert "| units (epochs) trained | 16 | 32 | 0.50x |" in lines
    assert (
        "- ray: best t007 (hidden=128, lr=0.01) eval_loss 0.1000; units per trial [4, 4, 8, 16] in 4 trial launches; n"
        in lines
    )


def test_the_table_of_one_side_has_no_ratio():
    lines = bench.table({"ray": [figures(60.0, 40.0, 32)]})
    assert lines[0] == "| figure | ray |"
    assert "| to the best trial's last result, s | 40.00 |" in lines


def test_the_table_compares_warm_trial_processes_with_a_process_per_segment_and_ray():
    warm = {**figures(30.0, 20.0, 16), "segment": 5.0, "overhead": 4.0}
    fresh = {**figures(60.0, 50.0, 16), "segment": 20.0, "overhead": 16.0}
    lines = bench.table({"ours": [warm], "ours-fresh": [fresh], "ray": [figures(20.0, 10.0, 32)]})
    assert lines[0] == "| figure | ours | ours-fresh | ray | ours / ray | ours-fresh / ray | ours / ours-fresh |"
    assert "| whole process, s | 30.00 | 60.00 | 20.00 | 1.50x | 3.00x | 0.50x |" in lines
    assert (
        "| a segment's overhead, s (wall - its units' train_seconds; median) | 4.00 | 16.00 | - | - | - | 0.25x |"
        in lines
    )
