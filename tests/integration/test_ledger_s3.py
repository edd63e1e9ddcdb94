"""A sweep's ledger and PBT's checkpoint copy on S3 over HTTP (moto): events are appended with conditional puts, so a
second writer is fenced; and copy_checkpoint is a server-side CopyObject: moto's request recorder shows that no byte
of the checkpoint's files was read through this process."""

from __future__ import annotations

import json
import urllib.request

import pytest
import torch

from checkpointing import CheckpointStore, Ledger, LedgerFencedError, Writer, copy_checkpoint, open_checkpoint_uri
from checkpointing.io.storage import Storage
from deployments.local_s3 import LocalS3

NAME = "ep1-ba4-sa16"


@pytest.fixture
def sweep(s3) -> Storage:
    folder, options = s3
    return Storage(f"{folder}/sw", options)


def test_events_round_trip_and_a_second_writer_is_fenced_by_the_conditional_put(sweep):
    first, second = Ledger(sweep, writer="host:1"), Ledger(sweep, writer="host:2")
    first.read()
    first.append("sweep_started", {"sweep_name": "sw", "spec": {"metric": "loss"}})
    assert [e.kind for e in second.read()] == ["sweep_started"]
    second.append("trial_created", {"trial": "t000", "index": 0, "params": {}})
    with pytest.raises(LedgerFencedError, match="another sweep process is writing this sweep"):
        first.append("trial_created", {"trial": "t000", "index": 0, "params": {}})
    events = Ledger(sweep).read()
    assert [(e.seq, e.writer) for e in events] == [(0, "host:1"), (1, "host:2")]


@pytest.fixture
def recorder(moto_server, tmp_path, monkeypatch):
    """moto's request recorder (moto_api), writing to this test's folder; yields a function that records the requests
    one call makes, as (method, url, headers)."""
    from moto.moto_api import recorder as moto_recorder

    monkeypatch.setattr(moto_recorder, "_location", str(tmp_path / "recording"))
    endpoint = LocalS3(moto_server).endpoint

    def api(action: str, method: str = "POST") -> str:
        request = urllib.request.Request(f"{endpoint}/moto-api/recorder/{action}", method=method)
        with urllib.request.urlopen(request, timeout=60) as answer:
            return answer.read().decode()

    def record(call) -> list[tuple[str, str, dict[str, str]]]:
        api("reset-recording")
        api("start-recording")
        try:
            call()
        finally:
            api("stop-recording")
        entries = recorded_entries(api("download-recording", "GET"))
        return [(e["method"], e["url"], {k.lower(): v for k, v in e["headers"].items()}) for e in entries]

    return record


def recorded_entries(text: str) -> list[dict]:
    """The recording's entries. moto's threaded server appends each as two writes (the JSON, then a newline) with no
    lock, so two requests at once can leave two entries on one line ("{...}{...}" then two newlines): read as
    consecutive JSON values, not one per line."""
    decoder, entries, at = json.JSONDecoder(), [], 0
    while (at := len(text) - len(text[at:].lstrip())) < len(text):
        entry, at = decoder.raw_decode(text, at)
        entries.append(entry)
    return entries


def test_copy_checkpoint_on_s3_is_copy_object_and_reads_no_byte_of_the_checkpoint(s3, sweep, recorder):
    options = s3[1]
    donor = CheckpointStore(sweep.url, "t001", storage_options=options)
    donor.save(
        NAME,
        {"state.pt": {"state": {"model": {"w": torch.arange(4096.0)}}}},
        progress={"epoch": 1, "step": 4, "samples_seen": 16},
        writer=Writer.current(1),
    )
    target = f"sweep/exploits/t003-e1/checkpoints/{NAME}"
    uris: list[str] = []
    requests = recorder(lambda: uris.append(copy_checkpoint(sweep, f"t001/checkpoints/{NAME}", target)))

    copies = [(m, url) for m, url, headers in requests if m == "PUT" and "x-amz-copy-source" in headers]
    assert {url.split("?")[0].rsplit("/", 1)[-1] for _, url in copies} == {"state.pt", "manifest.json"}
    data_reads = [url for m, url, _ in requests if m == "GET" and url.split("?")[0].endswith("/state.pt")]
    assert data_reads == [], data_reads  # the manifest is read (to verify it); the data file never is
    uploads = [url for m, url, headers in requests if m == "PUT" and "x-amz-copy-source" not in headers]
    assert uploads == [], uploads

    loaded = open_checkpoint_uri(uris[0], storage_options=options)
    assert torch.equal(loaded.objects["state.pt"]["state"]["model"]["w"], torch.arange(4096.0))
    copy = CheckpointStore(sweep.uri("sweep/exploits"), "t003-e1", storage_options=options)
    assert copy.check(NAME, deep=True) == []
