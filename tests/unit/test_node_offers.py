"""A node joins only a rendezvous that node 0 of its pool signed for this very config, before it expires
(training/distributed/nodes.py); the pool's secret stays out of what the ranks see; a node stops when node 0 goes silent."""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
import time

import pytest

from flows.train import main
from training.config import ConfigError, TrainConfig
from training.distributed.gang import run_on_gang
from training.distributed.node_run import NodeFailed, supervise
from training.distributed.nodes import (
    SECRET_ENV,
    NodeOffer,
    OfferRefused,
    Rendezvous,
    make_offers,
    node_address,
    node_environment,
    sign_offer,
    torchrun_command,
    verify_offer,
)

SECRET = "s" * 64
CONFIG = TrainConfig(run_name="r", nnodes=3, nproc_per_node=2)
CONFIG_JSON = json.loads(CONFIG.model_dump_json())
RENDEZVOUS = Rendezvous("10.1.2.3", 29500, "rt-0123456789abcdef")


def offers(secret: str = SECRET) -> list[dict]:
    return make_offers(CONFIG, RENDEZVOUS, 4, CONFIG_JSON, secret)


def through_the_api(value):
    return json.loads(json.dumps(value))  # what a flow-run parameter is after the server stored it


def test_each_node_gets_its_own_offer_and_accepts_it_after_a_trip_through_json():
    accepted = [verify_offer(through_the_api(o), through_the_api(CONFIG_JSON), SECRET) for o in offers()]
    assert [a.node_rank for a in accepted] == [1, 2]
    assert {(a.endpoint, a.rdzv_id, a.nnodes, a.nproc_per_node, a.run, a.generation) for a in accepted} == {
        ("10.1.2.3:29500", "rt-0123456789abcdef", 3, 2, "r", 4)
    }
    assert all(SECRET not in json.dumps(o) for o in offers())


def test_an_offer_signed_with_another_key_is_refused():
    with pytest.raises(OfferRefused, match=r"^node offer refused: its signature does not match"):
        verify_offer(offers(secret="x" * 64)[0], CONFIG_JSON, SECRET)


@pytest.mark.parametrize(
    "field, value",
    [("endpoint", "10.6.6.6:29500"), ("rdzv_id", "rt-other"), ("nnodes", 2), ("node_rank", 2),
     ("nproc_per_node", 8), ("run", "other"), ("generation", 5), ("expires", 2**40), ("config_sha256", "0" * 64)],
)  # fmt: skip
def test_an_offer_with_any_field_changed_is_refused(field, value):
    changed = {**offers()[0], field: value}
    with pytest.raises(OfferRefused, match="its signature does not match"):
        verify_offer(changed, CONFIG_JSON, SECRET)


def test_an_offer_with_a_field_added_is_refused():
    with pytest.raises(OfferRefused, match="its signature does not match"):
        verify_offer({**offers()[0], "extra": "x"}, CONFIG_JSON, SECRET)


def test_an_expired_offer_is_refused_even_with_a_good_signature():
    offer = offers()[0]
    verify_offer(offer, CONFIG_JSON, SECRET, now=offer["expires"])
    with pytest.raises(OfferRefused, match=r"^node offer refused: it expired at "):
        verify_offer(offer, CONFIG_JSON, SECRET, now=offer["expires"] + 1)


@pytest.mark.parametrize("offer", [{}, None, "offer", {"signature": 1}, {"endpoint": "10.6.6.6:1"}])
def test_an_unsigned_offer_is_refused(offer):
    with pytest.raises(OfferRefused, match=r"^node offer refused: it is not signed$"):
        verify_offer(offer, CONFIG_JSON, SECRET)


def test_nested_or_oversized_offers_are_refused_before_any_signature_is_computed():
    for bad in ({**offers()[0], "endpoint": {"a": [1]}}, {**offers()[0], "run": "x" * 5000}):
        with pytest.raises(OfferRefused, match="not a flat JSON object"):
            verify_offer(bad, CONFIG_JSON, SECRET)


def test_a_config_other_than_the_signed_one_is_refused():
    for config in ({**CONFIG_JSON, "save_folder": "/"}, {**CONFIG_JSON, "storage_options": {}}, [], "x"):
        with pytest.raises(OfferRefused, match="config"):
            verify_offer(offers()[0], config, SECRET)


def test_a_worker_without_the_secret_refuses_every_offer():
    for secret in (None, "", "short"):
        with pytest.raises(OfferRefused, match=f"this worker has no {SECRET_ENV}"):
            verify_offer(offers()[0], CONFIG_JSON, secret)


def test_a_node_rank_outside_the_gang_is_refused_even_when_signed():
    fields = {k: v for k, v in offers()[0].items() if k != "signature"}
    odd = sign_offer(NodeOffer.model_validate({**fields, "node_rank": 3}), SECRET)
    with pytest.raises(OfferRefused, match="node_rank 3 of nnodes 3"):
        verify_offer(odd, CONFIG_JSON, SECRET)


def test_nnodes_above_one_without_the_secret_is_one_line_exit_2_and_nothing_written(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for secret, state in ((None, "it is not set"), ("short", "it has 5 characters")):
        if secret is None:
            monkeypatch.delenv(SECRET_ENV, raising=False)
        else:
            monkeypatch.setenv(SECRET_ENV, secret)
        assert main(["--save_folder", str(tmp_path / "runs"), "--nnodes", "2"]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"error: nnodes > 1 needs {SECRET_ENV}") and state in err and err.count("\n") == 1, err
        assert list(tmp_path.iterdir()) == []


def test_a_loopback_node_address_is_refused_with_what_to_set(monkeypatch):
    monkeypatch.setenv("TRAIN_NODE_ADDRESS", "127.0.0.1")
    with pytest.raises(
        ConfigError, match=re.escape("TRAIN_NODE_ADDRESS='127.0.0.1' is not reachable from other machines")
    ):
        node_address()


def test_a_gang_across_machines_needs_a_launcher_and_starts_nothing_without_one(monkeypatch):
    monkeypatch.setenv(SECRET_ENV, SECRET)
    with pytest.raises(ConfigError, match="nnodes=2: the other nodes are started as Prefect flow runs"):
        run_on_gang(TrainConfig(nnodes=2), {"op": "unit"}, generation=1)


def test_a_gang_across_machines_refuses_a_worker_without_the_secret_before_starting_anything(monkeypatch):
    monkeypatch.delenv(SECRET_ENV, raising=False)
    started = []

    class Launcher:
        def start(self, offers, config):
            started.append(offers)

        def problem(self):
            return None

        def stop(self, grace=0.0):
            pass

    with pytest.raises(ConfigError, match=f"needs {SECRET_ENV}"):
        run_on_gang(TrainConfig(nnodes=2), {"op": "unit"}, generation=1, launch_nodes=Launcher)
    assert started == []


def test_the_ranks_never_see_the_secret_and_gloo_binds_where_the_node_is_reached():
    env = node_environment({SECRET_ENV: SECRET, "PATH": "/bin"}, "127.0.0.1")
    assert SECRET_ENV not in env and env["PATH"] == "/bin"
    assert env["GLOO_SOCKET_IFNAME"] == env["NCCL_SOCKET_IFNAME"] == "lo"
    assert node_environment({"GLOO_SOCKET_IFNAME": "ib0"}, "127.0.0.1")["GLOO_SOCKET_IFNAME"] == "ib0"


def test_every_node_runs_torchruns_static_rendezvous_at_node_0_with_its_own_rank():
    cmd = torchrun_command(2, 3, 1, "10.1.2.3:29500", "rt-x", "/tmp/c.json", "/tmp/logs")
    assert cmd[1:3] == ["-m", "torch.distributed.run"]
    assert {"--nnodes=3", "--node-rank=1", "--nproc-per-node=2", "--rdzv-backend=static", "--max-restarts=0",
            "--rdzv-endpoint=10.1.2.3:29500", "--rdzv-id=rt-x", "--log-dir=/tmp/logs"} <= set(cmd)  # fmt: skip
    assert cmd[-4:] == ["-m", "training.distributed.rank", "--config", "/tmp/c.json"]


def sleeper() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], start_new_session=True)


def test_a_node_stops_its_ranks_once_node_0_stops_answering():
    listener = socket.create_server(("127.0.0.1", 0))
    endpoint = f"127.0.0.1:{listener.getsockname()[1]}"
    proc = sleeper()
    listener.close()  # node 0's store is gone
    started = time.monotonic()
    with pytest.raises(NodeFailed, match=f"node 0's rendezvous at {endpoint} has not answered for 1 s"):
        supervise(proc, endpoint, lost_after=1.0, every=0.2)
    assert time.monotonic() - started < 5
    assert proc.poll() is not None  # killed, not left behind


def test_a_node_keeps_its_ranks_while_node_0_answers_and_returns_their_exit_code():
    listener = socket.create_server(("127.0.0.1", 0))
    proc = subprocess.Popen([sys.executable, "-c", "import time, sys; time.sleep(2); sys.exit(3)"],
                            start_new_session=True)  # fmt: skip
    assert supervise(proc, f"127.0.0.1:{listener.getsockname()[1]}", lost_after=0.5, every=0.2) == 3
    listener.close()
