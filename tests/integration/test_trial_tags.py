"""A sweep trial's tag is its flow run's alone (issue 46): the sweep finds a dead trial process's flow run by it
(tasks/trial.py), while its unit task runs carry only the tags a person gave, so Prefect's task engine asks the API for
no concurrency slot under a tag no limit can name (flows/train.py's tasks_without_trial_tag)."""

from __future__ import annotations

import pytest
from prefect import tags
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId, FlowRunFilterTags

from flows.train import train
from tasks.trial import TRIAL_TAG


@pytest.mark.slow  # a Prefect test server and the train flow's task runs
@pytest.mark.usefixtures("prefect_harness")
def test_a_trial_s_tag_marks_its_flow_run_and_not_its_units(make_config):
    tag = f"{TRIAL_TAG}-0123456789ab"
    with tags(tag, "keep-me"):
        result = train(make_config(run_name="tagged", max_duration="2ep"))
    assert [u.unit for u in result.units] == [0, 1]
    with get_client(sync_client=True) as client:
        runs = client.read_flow_runs(flow_run_filter=FlowRunFilter(tags=FlowRunFilterTags(all_=[tag])))
        assert len(runs) == 1 and {tag, "keep-me"} <= set(runs[0].tags), [r.tags for r in runs]
        units = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[runs[0].id])))
    assert {"tagged-unit-0", "tagged-unit-1"} <= {u.name for u in units}  # and the final evaluation
    assert all(set(u.tags) == {"keep-me"} for u in units), [u.tags for u in units]
