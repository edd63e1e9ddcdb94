"""Training across machines (``nnodes > 1``): where the nodes meet, the signed offer that tells a node where, and
the torchrun command every node runs.

The unit task's process is node 0. It picks the rendezvous itself — its own address (``TRAIN_NODE_ADDRESS``,
else detected), a free port, a fresh id — runs torchrun's node 0 there, and has the other nodes started as
flow runs of the rank-node deployment (flows/node.py; the Prefect side is tasks/nodes.py, handed to the gang as a
``NodeLauncher``). Those runs take their orders from parameters, which anyone who may create runs can write,
and a rendezvous store runs code in every node that joins it (torch unpickles what its peers send). So a node
joins only a rendezvous that the product chose: node 0 signs each node's offer (endpoint, rendezvous id, nnodes,
node rank, processes per node, run, generation, the config's digest, expiry) with HMAC-SHA256 under a secret
that only the workers hold (``TRAIN_NODE_SECRET``, the same on every worker of the pool: training/config/machines.py),
and a node verifies it before it does anything else. The secret never leaves the environment of the processes that
sign and verify: not in a parameter, a log, an artifact, nor the environment of the rank processes.

torchrun's rendezvous is its ``static`` backend on node 0's TCPStore: it honours ``--node-rank``, so global rank 0
is always on node 0 and connects back to the unit's process over loopback (training/distributed/gang.py). The ``c10d``
backend numbers nodes by sorting their addresses, which would put rank 0 on whichever node sorts first, and its
rendezvous state is unpickled by every node that joins.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import re
import secrets
import socket
import struct
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from training.config import TrainConfig
from training.config.machines import MIN_SECRET, SECRET_ENV, node_address  # what every worker of the pool sets
from training.exceptions import OfferRefused

OFFER_TTL = (
    300  # seconds a node run has to start and join; node 0 waits as long (training/distributed/gang.py START_TIMEOUT)
)
MAX_OFFER = 4096  # bytes of a node offer's JSON
MAX_CONFIG = 1 << 20  # bytes of the config parameter's JSON
_DOMAIN = b"resumable-train node offer v1\n"
_RDZV_ID = re.compile(r"^[a-z0-9-]{1,64}$")
_SIOCGIFADDR = 0x8915


class NodeLauncher(Protocol):
    """Starts and stops the other nodes of one gang (tasks/nodes.py does it with Prefect flow runs)."""

    def start(self, offers: list[dict[str, Any]], config: dict[str, Any]) -> None:
        """Starts one node per signed offer, each given ``config`` (the gang's TrainConfig as JSON)."""

    def problem(self) -> str | None:
        """A line saying which node ended before the gang did, or None while all of them run."""

    def stop(self, grace: float = 0.0) -> None:
        """Waits up to ``grace`` seconds for the nodes to end by themselves, stops every node still running, and
        waits (bounded) until they are gone."""


# -- the rendezvous node 0 chooses ---------------------------------------------------------------------------
@dataclass(frozen=True)
class Rendezvous:
    """Where the nodes of one gang meet: node 0's TCPStore (torchrun's static rendezvous)."""

    address: str
    port: int
    rdzv_id: str

    @property
    def endpoint(self) -> str:
        return f"{self.address}:{self.port}"


def choose_rendezvous() -> Rendezvous:
    """A free port on this node's address and a rendezvous id nobody else uses."""
    address = node_address()
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((socket.gethostbyname(address), 0))
        port = int(sock.getsockname()[1])
    return Rendezvous(address, port, f"rt-{secrets.token_hex(8)}")


# -- the offer -----------------------------------------------------------------------------------------------
class NodeOffer(BaseModel):
    """What node 0 asks one other node to do, as it signed it."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    version: int = Field(1, ge=1, le=1)
    endpoint: str = Field(max_length=300)
    rdzv_id: str = Field(pattern=_RDZV_ID.pattern)
    nnodes: int = Field(ge=2, le=100_000)
    node_rank: int = Field(ge=1, le=99_999)
    nproc_per_node: int = Field(ge=1, le=1024)
    run: str = Field(max_length=200)
    generation: int = Field(ge=0)
    config_sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    expires: int = Field(ge=0)  # unix seconds


def canonical(value: Any) -> bytes:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False).encode()


def config_digest(config: Mapping[str, Any]) -> str:
    return hashlib.sha256(canonical(dict(config))).hexdigest()


def _mac(payload: Mapping[str, Any], secret: str) -> str:
    return hmac.new(secret.encode(), _DOMAIN + canonical(dict(payload)), hashlib.sha256).hexdigest()


def make_offers(
    config: TrainConfig, rendezvous: Rendezvous, generation: int, config_json: dict[str, Any], secret: str
) -> list[dict[str, Any]]:
    """One signed offer per node 1..nnodes-1."""
    expires = int(time.time()) + OFFER_TTL
    offers = []
    for rank in range(1, config.nnodes):
        offer = NodeOffer(
            endpoint=rendezvous.endpoint,
            rdzv_id=rendezvous.rdzv_id,
            nnodes=config.nnodes,
            node_rank=rank,
            nproc_per_node=config.nproc_per_node,
            run=config.run_name,
            generation=generation,
            config_sha256=config_digest(config_json),
            expires=expires,
        )
        offers.append(sign_offer(offer, secret))
    return offers


def sign_offer(offer: NodeOffer, secret: str) -> dict[str, Any]:
    """The offer as a parameter: its fields and their HMAC-SHA256 under the pool's secret."""
    payload = offer.model_dump()
    return {**payload, "signature": _mac(payload, secret)}


def verify_offer(offer: Any, config: Any, secret: str | None, now: float | None = None) -> NodeOffer:
    """The offer, if node 0 of this pool signed it for ``config`` and it has not expired; else OfferRefused."""
    if not secret or len(secret) < MIN_SECRET:
        raise OfferRefused(
            f"node offer refused: this worker has no {SECRET_ENV} (at least {MIN_SECRET} characters), "
            f"so it joins no rendezvous"
        )
    if not isinstance(offer, dict) or not isinstance(offer.get("signature"), str):
        raise OfferRefused("node offer refused: it is not signed")
    payload = {k: v for k, v in offer.items() if k != "signature"}
    try:
        flat = all(isinstance(v, (str, int, float)) for v in payload.values()) and len(canonical(payload)) <= MAX_OFFER
    except ValueError:  # NaN or infinity
        flat = False
    if not flat:
        raise OfferRefused("node offer refused: it is not a flat JSON object of a few fields")
    if not hmac.compare_digest(offer["signature"].encode(), _mac(payload, secret).encode()):
        raise OfferRefused("node offer refused: its signature does not match (not signed by this pool's node 0)")
    try:
        accepted = NodeOffer.model_validate(payload)
    except ValidationError as exc:
        raise OfferRefused(f"node offer refused: {exc.error_count()} malformed field(s)") from None
    if (now if now is not None else time.time()) > accepted.expires:
        raise OfferRefused(
            f"node offer refused: it expired at {time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime(accepted.expires))}"
        )
    _check_config(accepted, config)
    return accepted


def _check_config(offer: NodeOffer, config: Any) -> None:
    if not isinstance(config, dict):
        raise OfferRefused("node offer refused: its config is not a JSON object")
    try:
        body = canonical(config)
    except (TypeError, ValueError, RecursionError):
        raise OfferRefused("node offer refused: its config is not plain JSON") from None
    if len(body) > MAX_CONFIG or not hmac.compare_digest(hashlib.sha256(body).hexdigest(), offer.config_sha256):
        raise OfferRefused("node offer refused: the config is not the one node 0 signed")
    if offer.node_rank >= offer.nnodes:
        raise OfferRefused(f"node offer refused: node_rank {offer.node_rank} of nnodes {offer.nnodes}")


# -- what every node runs --------------------------------------------------------------------------------------
def torchrun_command(
    nproc_per_node: int, nnodes: int, node_rank: int, rendezvous: str, rdzv_id: str, config_file: str, log_dir: str
) -> list[str]:
    """torchrun for one node of a gang: static rendezvous at node 0's store, no restarts (a retry is Prefect's), its
    logs in ``log_dir`` (the gang's folder, removed with it)."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc-per-node={nproc_per_node}",
        f"--nnodes={nnodes}",
        f"--node-rank={node_rank}",
        "--rdzv-backend=static",
        f"--rdzv-endpoint={rendezvous}",
        f"--rdzv-id={rdzv_id}",
        f"--rdzv-conf=timeout={OFFER_TTL}",
        "--max-restarts=0",
        f"--log-dir={log_dir}",
        "-m",
        "training.distributed.rank",
        "--config",
        config_file,
    ]


def node_environment(env: Mapping[str, str], address: str) -> dict[str, str]:
    """The environment of a node's torchrun: without the pool's secret (the ranks run the recipe's code and never
    sign anything), and with gloo and NCCL bound to the interface that carries ``address`` unless the worker
    chose one: left alone, they bind to the address the host name resolves to, often loopback."""
    result = {k: v for k, v in env.items() if k != SECRET_ENV}
    interface = interface_of(socket.gethostbyname(address))
    if interface is not None:
        result.setdefault("GLOO_SOCKET_IFNAME", interface)
        result.setdefault("NCCL_SOCKET_IFNAME", interface)
    return result


def interface_of(ip: str) -> str | None:
    """The network interface whose IPv4 address is ``ip`` (Linux), else None."""
    if not sys.platform.startswith("linux"):
        return None
    import fcntl  # Linux (and Unix) only: imported here so that this module loads everywhere

    for _, name in socket.if_nameindex():
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
            try:
                packed = fcntl.ioctl(sock.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
            except OSError:
                continue
        if socket.inet_ntoa(packed[20:24]) == ip:
            return name
    return None
