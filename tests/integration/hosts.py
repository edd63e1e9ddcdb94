"""Several "machines" on one: Linux network namespaces, for the tests of training across machines.

Each host is a network namespace of its own: its own loopback, and one interface (``eth0``, one end of a veth
pair whose other end is on a bridge in the root namespace) with its own address on a private /24. Hosts reach
each other, and the bridge's address in the root namespace (where the tests' Prefect server listens), and
nothing else; what one host binds on its loopback no other host sees. Processes are started in a host with
``ip netns exec``; ``pids(host)`` lists every process whose network namespace is that host's, from /proc.

Everything is named with a random tag (``rt<tag>...``) and removed by ``down()``, which first SIGKILLs whatever
still runs in a host. A machine whose kernel refuses namespaces makes ``available()`` say why.
"""

from __future__ import annotations

import ipaddress
import os
import random
import secrets
import signal
import subprocess
from dataclasses import dataclass, field
from pathlib import Path


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and proc.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)} exited {proc.returncode}: {proc.stderr.strip()}")
    return proc


def available() -> str | None:
    """None when this machine can make network namespaces here, else why not (for a skip reason)."""
    if os.geteuid() != 0:
        return "network namespaces need root (ip netns add)"
    name = f"rtprobe{secrets.token_hex(3)}"
    try:
        made = _ip("netns", "add", name, check=False)
    except FileNotFoundError:
        return "no `ip` command (iproute2) on this machine"
    if made.returncode != 0:
        return f"the kernel refused a network namespace: {made.stderr.strip()}"
    _ip("netns", "del", name, check=False)
    return None


def _free_subnet() -> ipaddress.IPv4Network:
    """A /24 in 10.200-250.x.0 that no interface of the root namespace has an address in."""
    used = [ipaddress.ip_interface(word).network for word in _ip("-o", "-4", "addr", "show").stdout.split()
            if "/" in word and word[0].isdigit()]  # fmt: skip
    while True:
        subnet = ipaddress.IPv4Network(f"10.{random.randint(200, 250)}.{random.randint(0, 255)}.0/24")
        if not any(subnet.overlaps(network) for network in used):
            return subnet


@dataclass
class Hosts:
    """``count`` hosts on a bridge; ``address(i)`` is host i's, ``bridge_address`` the root namespace's."""

    count: int
    tag: str = field(default_factory=lambda: secrets.token_hex(2))
    subnet: ipaddress.IPv4Network = field(default_factory=_free_subnet)
    made: list[str] = field(default_factory=list)

    @property
    def bridge(self) -> str:
        return f"rt{self.tag}br"

    @property
    def bridge_address(self) -> str:
        return str(self.subnet.network_address + 1)

    def name(self, i: int) -> str:
        return f"rt{self.tag}h{i}"

    def address(self, i: int) -> str:
        return str(self.subnet.network_address + 10 + i)

    def up(self) -> Hosts:
        """Creates the bridge and the hosts; on any failure removes what it made and raises."""
        try:
            _ip("link", "add", self.bridge, "type", "bridge")
            self.made.append(f"link:{self.bridge}")
            _ip("addr", "add", f"{self.bridge_address}/{self.subnet.prefixlen}", "dev", self.bridge)
            _ip("link", "set", self.bridge, "up")
            for i in range(self.count):
                self._add_host(i)
        except BaseException:
            self.down()
            raise
        return self

    def _add_host(self, i: int) -> None:
        ns, outside, inside = self.name(i), f"rt{self.tag}v{i}", f"rt{self.tag}p{i}"
        _ip("netns", "add", ns)
        self.made.append(f"netns:{ns}")
        _ip("link", "add", outside, "type", "veth", "peer", "name", inside)
        self.made.append(f"link:{outside}")
        _ip("link", "set", outside, "master", self.bridge, "up")
        _ip("link", "set", inside, "netns", ns)
        _ip("-n", ns, "link", "set", inside, "name", "eth0")
        _ip("-n", ns, "addr", "add", f"{self.address(i)}/{self.subnet.prefixlen}", "dev", "eth0")
        _ip("-n", ns, "link", "set", "eth0", "up")
        _ip("-n", ns, "link", "set", "lo", "up")

    def popen(self, i: int, command: list[str], env: dict[str, str], log: Path, cwd: Path) -> subprocess.Popen:
        """Starts ``command`` in host i (its own session, output to ``log``)."""
        with open(log, "ab") as out:
            return subprocess.Popen(["ip", "netns", "exec", self.name(i), *command], cwd=cwd, env=env, stdout=out,
                                    stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip

    def pids(self, i: int) -> list[int]:
        """Every live process in host i's network namespace."""
        return _in_namespace(Path(f"/run/netns/{self.name(i)}"))

    def down(self) -> dict[str, list[int]]:
        """SIGKILLs what still runs in each host, removes the hosts and the bridge; returns the pids it had to kill,
        by host."""
        killed: dict[str, list[int]] = {}
        for i in range(self.count):
            if f"netns:{self.name(i)}" in self.made:
                pids = self.pids(i)
                for pid in pids:
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        continue
                if pids:
                    killed[self.name(i)] = pids
        for item in reversed(self.made):
            kind, name = item.split(":", 1)
            _ip(*(["netns", "del", name] if kind == "netns" else ["link", "del", name]), check=False)
        self.made.clear()
        return killed


def _in_namespace(netns: Path) -> list[int]:
    try:
        target = os.stat(netns).st_ino
    except OSError:
        return []
    found = []
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            if os.stat(entry / "ns" / "net").st_ino == target and alive(entry):
                found.append(int(entry.name))
        except OSError:
            continue
    return found


def alive(proc: Path) -> bool:
    try:
        return (proc / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False
