"""release.json is read as untrusted input: bounded, validated, confined to its save folder, retried."""

from __future__ import annotations

import json
import os
import uuid

import pytest

from checkpointing import RetrySettings
from checkpointing.release import MAX_RELEASE_BYTES, RELEASE, Release, ReleaseError, ReleaseFile


@pytest.fixture
def folder() -> str:
    return f"memory://release-{uuid.uuid4().hex}/runs"


def good(folder: str, **changes) -> dict:
    fields = dict(
        run_name="tick-1",
        checkpoint=f"{folder}/tick-1/checkpoints/ep3",
        metric="accuracy",
        value=0.9,
        metrics={"accuracy": 0.9, "loss": 0.3},
        promoted_at=1.0,
        flow_run_id=None,
    )
    return {**fields, **changes}


def put_raw(folder: str, data: bytes) -> None:
    ReleaseFile(folder).storage.put(RELEASE, data)


def test_no_release_reads_as_none_and_a_written_one_reads_back(folder):
    releases = ReleaseFile(folder)
    assert releases.read() is None
    releases.write(Release(**good(folder)))
    assert releases.read() == Release(**good(folder))


@pytest.mark.parametrize(
    "content, problem",
    [
        (b"[1, 2]", "a JSON list, not an object"),
        (b"{not json", "not JSON"),
        (b'{"value": NaN}', "not JSON"),
        (b"[" * 20000 + b"]" * 20000, "not JSON"),
        (json.dumps({k: v for k, v in good("F").items() if k != "metric"}).encode(), "no 'metric' field"),
        (json.dumps(good("F", value="0.9")).encode(), "value='0.9': expected a finite number"),
        (json.dumps(good("F", value=True)).encode(), "value='True': expected a finite number"),
        (json.dumps(good("F", value=10**400)).encode(), "expected a finite number"),
        (
            json.dumps(good("F", metrics={"accuracy": 1.5})).replace("1.5", "1e999").encode(),
            "metrics['accuracy']='inf'",
        ),
        (json.dumps(good("F", metrics=[0.9])).encode(), "metrics: expected an object"),
        (json.dumps(good("F", run_name="../other")).encode(), "run_name='../other'"),
        (json.dumps(good("F", metric="m" * 1000)).encode(), "expected a string of 1-256 characters"),
    ],
)
def test_a_malformed_release_is_an_error_naming_the_problem_never_no_release(folder, content, problem):
    put_raw(folder, content.replace(b'"F/', f'"{folder}/'.encode()))
    with pytest.raises(ReleaseError, match=r"release\.json: ") as error:
        ReleaseFile(folder).read()
    assert problem in str(error.value)


@pytest.mark.parametrize(
    "checkpoint",
    [
        "s3://someone-elses-bucket/runs/tick-1/checkpoints/ep3",  # another bucket
        "/etc/tick-1/checkpoints/ep3",  # a local path
        "{folder}/tick-1/checkpoints/../../x/checkpoints/ep3",  # out of the folder
        "{folder}/other-run/checkpoints/ep3",  # not the run the release names
        "{folder}/tick-1",  # a run, not a checkpoint
        "{folder}/tick-1/checkpoints/ep3/../../../../x",
    ],
)
def test_a_release_pointing_outside_its_save_folder_is_refused(folder, checkpoint):
    put_raw(folder, json.dumps(good(folder, checkpoint=checkpoint.format(folder=folder))).encode())
    with pytest.raises(ReleaseError):
        ReleaseFile(folder).read()
    with pytest.raises(ReleaseError):  # and it is never written either
        ReleaseFile(folder).write(Release(**good(folder, checkpoint=checkpoint.format(folder=folder))))


def test_an_oversized_release_is_refused_without_reading_it_all(folder):
    put_raw(folder, b" " * (10 * MAX_RELEASE_BYTES) + json.dumps(good(folder)).encode())
    releases = ReleaseFile(folder)
    reads = []
    cat_file = releases.storage.fs.cat_file
    releases.storage.fs.cat_file = lambda path, **kw: reads.append(kw) or cat_file(path, **kw)
    with pytest.raises(ReleaseError, match=f"larger than {MAX_RELEASE_BYTES} bytes"):
        releases.read()
    assert reads == [{"start": 0, "end": MAX_RELEASE_BYTES + 1}]


def test_a_local_release_that_is_a_link_is_not_followed(tmp_path):
    secret = tmp_path / "elsewhere.json"
    secret.write_text(json.dumps(good(str(tmp_path / "runs"))))
    (tmp_path / "runs").mkdir()
    os.symlink(secret, tmp_path / "runs" / RELEASE)
    with pytest.raises(ReleaseError, match="symbolic link"):
        ReleaseFile(str(tmp_path / "runs")).read()


def test_a_transient_fault_is_retried_with_the_given_settings(folder, caplog):
    ReleaseFile(folder).write(Release(**good(folder)))
    releases = ReleaseFile(folder, retry=RetrySettings(attempts=3, initial_wait=0.0, max_wait=0.0))
    cat_file, faults = releases.storage.fs.cat_file, [TimeoutError("read timed out")] * 2

    def flaky(path, **kw):
        if faults:
            raise faults.pop()
        return cat_file(path, **kw)

    releases.storage.fs.cat_file = flaky
    assert releases.read().run_name == "tick-1"
    assert not faults and caplog.text.count("retrying") == 2
