"""What every worker of a multi-machine pool sets (``nnodes > 1``): the pool's shared secret and the address other
machines reach this one at.

Read from the worker's environment, beside what it allows a run (training/config/trust.py, limits.py), so that a run's
start-up check (training/start/preflight.py) and the machinery that starts the nodes (training/distributed/nodes.py)
read them from one place below both:

    TRAIN_NODE_SECRET=<at least 32 characters, the same on every worker>   # node 0 signs offers with it
    TRAIN_NODE_ADDRESS=10.0.0.5                                             # default: the default route's address
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import re
import socket

from training.config import ConfigError, TrainConfig

SECRET_ENV = "TRAIN_NODE_SECRET"
ADDRESS_ENV = "TRAIN_NODE_ADDRESS"
MIN_SECRET = 32  # characters: an offer is public (a flow-run parameter), so a short secret could be guessed offline
_HOST = re.compile(r"^[A-Za-z0-9.:-]{1,253}$")


def node_secret() -> str:
    """The pool's shared secret, from this worker's environment; ConfigError when it is missing or short."""
    secret = os.environ.get(SECRET_ENV, "")
    if len(secret) < MIN_SECRET:
        state = "is not set" if not secret else f"has {len(secret)} characters"
        raise ConfigError(
            f"nnodes > 1 needs {SECRET_ENV} in the worker's environment (the same on every worker of the pool, at "
            f"least {MIN_SECRET} characters; it {state}): nodes join only a rendezvous signed with it. Generate one "
            f"with: python -c 'import secrets; print(secrets.token_hex(32))'"
        )
    return secret


def node_address() -> str:
    """This machine's address as the other nodes reach it: ``TRAIN_NODE_ADDRESS``, else the source address of
    the default route; never loopback."""
    configured = os.environ.get(ADDRESS_ENV, "").strip()
    address = configured or _default_route_address()
    if not _HOST.match(address):
        raise ConfigError(f"{ADDRESS_ENV}={address!r}: use an IP address or a host name the other nodes resolve")
    try:
        ip = ipaddress.ip_address(socket.gethostbyname(address))
    except OSError as exc:
        raise ConfigError(f"{ADDRESS_ENV}={address!r} does not resolve here ({exc})") from None
    if ip.is_loopback or ip.is_unspecified:
        where = f"{ADDRESS_ENV}={address!r} is" if configured else f"this machine's detected address is {address}:"
        raise ConfigError(
            f"{where} not reachable from other machines; set {ADDRESS_ENV} in the worker's environment to the "
            f"address other nodes reach this one at (on Kubernetes: the pod IP, status.podIP)"
        )
    return address


def check_multinode(config: TrainConfig) -> None:
    """Start-up check of a run with ``nnodes > 1``: the secret and this node's address are there."""
    if config.nnodes > 1:
        node_secret()
        node_address()


def _default_route_address() -> str:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe, contextlib.suppress(OSError):
        probe.connect(("192.0.2.1", 9))  # TEST-NET-1: no packet is sent; the kernel picks the source address
        return str(probe.getsockname()[0])
    return socket.gethostbyname(socket.gethostname())
