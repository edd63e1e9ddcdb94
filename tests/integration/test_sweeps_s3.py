"""PBT (python -m flows.sweep --scheduler pbt) on S3 over real HTTP (moto's server): an exploit copies the donor's
checkpoint inside the bucket with CopyObject (moto's request recorder shows no upload of the copy and no read of the
donor's data while copying), the copy holds the donor's weights, and the exploiting trial's new run continues the
donor's progress with the perturbed parameters."""

from __future__ import annotations

import json
import os
import subprocess

import pytest
import s3fs
import torch

from checkpointing import CheckpointStore, Ledger, open_checkpoint_uri
from checkpointing.io.storage import Storage
from checkpointing.store import STATE_FILE
from tests.conftest import ROOT
from tests.integration.test_ledger_s3 import recorder  # noqa: F401 - moto's request recorder, as a fixture
from tests.integration.test_sweeps import NAME, command

pytestmark = pytest.mark.slow
STEPS_PER_UNIT = 8  # 256 samples in batches of 32


def weights(uri: str, options: dict) -> dict[str, torch.Tensor]:
    loaded = open_checkpoint_uri(uri, storage_options=options, files=[STATE_FILE])
    return loaded.objects[STATE_FILE]["state"]["model"]


def path_of(url: str) -> str:
    """The bucket/key an S3 request names (path-style URL, query left out)."""
    return url.split("?")[0].split("://", 1)[-1].split("/", 1)[-1]


def test_pbt_on_s3_exploits_by_copy_object_and_the_new_run_continues_the_donor(s3, prefect_env, recorder, tmp_path):  # noqa: F811
    folder, options = s3
    aws = {k: v for k, v in os.environ.items() if k.startswith("AWS_")}  # the moto server's fake credentials
    env = {**prefect_env, **aws, "TRAIN_STORAGE_OPTIONS": json.dumps(options)}
    cmd = command(folder, "pbt", max_duration="2ep", perturbation_interval=1, quantile_fraction=0.25)
    log = tmp_path / "sweep.log"

    def run_sweep() -> None:
        with open(log, "w") as out:
            done = subprocess.run(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, timeout=900)
        assert done.returncode == 0, log.read_text()[-4000:]

    requests = recorder(run_sweep)

    sweep = f"{folder}/{NAME}"
    events = Ledger(Storage(sweep, options)).read()
    exploits = [e.body for e in events if e.kind == "exploit"]
    assert exploits, [e.kind for e in events]
    bucket = s3fs.S3FileSystem(**options, skip_instance_cache=True)
    copied = bucket.find(f"{sweep}/sweep/exploits")
    assert copied and all("/checkpoints/" in key for key in copied), copied
    for key in copied:  # each object of a copy was made by CopyObject, none uploaded
        writes = [(m, h) for m, url, h in requests if m in ("PUT", "POST") and path_of(url) == key]
        assert writes and all(m == "PUT" and "x-amz-copy-source" in h for m, h in writes), (key, writes)

    for exploit in exploits:
        donor_state = f"{path_of(exploit['donor_checkpoint'])}/{STATE_FILE}"
        copy_requests = [i for i, (_, url, _) in enumerate(requests) if f"/exploits/{exploit['run_name']}/" in url]
        during = requests[copy_requests[0] : copy_requests[-1] + 1]
        assert not [url for m, url, _ in during if m == "GET" and path_of(url) == donor_state], exploit

        donor = weights(exploit["donor_checkpoint"], options)
        copy = weights(exploit["copy"], options)
        assert donor.keys() == copy.keys() and all(torch.equal(donor[k], copy[k]) for k in donor)

        donor_step = open_checkpoint_uri(exploit["donor_checkpoint"], storage_options=options, files=[]).info
        first = sorted(CheckpointStore(sweep, exploit["run_name"], storage_options=options).list(),
                       key=lambda info: info.progress["samples_seen"])[0]  # fmt: skip
        assert first.progress["step"] == donor_step.progress["step"] + STEPS_PER_UNIT, (first.name, exploit)
        recipe_args = first.manifest.metadata["config"]["recipe_args"]
        perturbed = {k.split(".", 1)[1]: v for k, v in exploit["params_after"].items()}
        before = {k.split(".", 1)[1]: v for k, v in exploit["params_before"].items()}
        assert {k: recipe_args[k] for k in perturbed} == perturbed != before, (recipe_args, exploit)
