"""Writer generations and leases: one process trains a run at a time, and a newer one takes over without loss.

Each run of the flow (a restart too) claims a generation under ``<run>/claims/`` with an exclusive
create (O_EXCL locally, a conditional put on S3). A commit first checks that no higher generation has
been claimed; a stale writer gets a FencedError naming who displaced it, and the newer writer logs whom
it displaced, so two trainings of one ``run_name`` never lose work silently.

Claims lie in the bucket, where anyone who may write it may write one: only names of 1-19 digits count (a
generation is an int64), a claim file is read bounded (untrusted.py) and each field typed, and a claim that is
not readable is still a claim of the generation its name gives, only without who made it.

A claim alone cannot stop an older writer that is still alive: it would train on, side by side with the new
one, until its next commit is refused (seen when a worker reported one death twice and the run was restarted
twice). So a writer also holds a *lease* (``leases/<generation>``), renewed every ``LEASE_SECONDS`` by a
thread while it trains. A newer attempt that finds the previous lease alive asks it to stop
(``leases/<generation>.stop``) and waits: the holder commits where it stands at its next step boundary,
releases its lease and leaves; then the newer attempt claims and resumes from that checkpoint. A holder that
is dead stops renewing, and its lease counts as gone ``LEASE_STALE`` seconds after its last renewal.

A holder on *this* machine that has exited is known gone at once, without that wait (a SIGKILLed run relaunched
where it ran: 15 s of every such relaunch). Its lease says which process held it: host, kernel boot, pid namespace,
user, pid and the process's start time. Only when the boot, the pid namespace and the user are this process's own is
the pid read (``/proc/<pid>/stat``): a pid of another namespace (a container with the same host name) or one hidden
by ``hidepid`` would look dead, and a pid reused by another process has another start time. A lease is written
where others may write, so this can only hasten a takeover, never prevent one: a forged identity costs a live
holder its steps since its last commit, as a fence-out would.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from checkpointing.errors import DamagedFileError, FencedError
from checkpointing.io.redact import redact_uri
from checkpointing.io.storage import Storage
from checkpointing.io.untrusted import MAX_CLAIM_BYTES, MAX_INT, MAX_LABEL, as_dict, printable, read_json
from checkpointing.manifest import Writer

log = logging.getLogger(__name__)

CLAIMS = "claims"
LEASES = "leases"
LEASE_SECONDS = 5.0  # how often a holder renews its lease
LEASE_STALE = 3 * LEASE_SECONDS  # a lease not renewed for this long belongs to a holder that is gone
_CLAIM_NAME = re.compile(r"^[0-9]{1,19}$")
_MAX_HOST = 255


@dataclass(frozen=True)
class Claim:
    generation: int
    label: str = ""
    host: str = ""
    pid: int = 0
    claimed_at: float = 0.0
    owner: str = ""  # who trains: a flow run id, or the host and pid of a run outside Prefect

    def describe(self) -> str:
        age = f", {time.time() - self.claimed_at:.0f} s ago" if self.claimed_at else ""
        who = f"{self.label}, " if self.label else ""
        return f"generation {self.generation} ({who}host {self.host or '?'}, pid {self.pid or '?'}{age})"


class Fence:
    """The claims of one run folder."""

    def __init__(self, storage: Storage):
        self.storage = storage

    def newest(self) -> int:
        names = self.storage.sizes(CLAIMS) if self.storage.exists(CLAIMS) else {}
        generations = (int(n) for n in names if _CLAIM_NAME.match(n))  # ASCII digits: str.isdigit takes '²' too
        return max((g for g in generations if g <= MAX_INT), default=0)

    def read(self, generation: int) -> Claim:
        """Who claimed ``generation``, as far as its file says; fields that are missing or not of their type
        (or a file that is not a claim at all) leave that part of the description blank."""
        try:
            raw = as_dict(read_json(self.storage, f"{CLAIMS}/{generation:012d}", MAX_CLAIM_BYTES), "the claim")
        except (FileNotFoundError, DamagedFileError):
            return Claim(generation=generation)
        label, host, pid, claimed_at, owner = (raw.get(k) for k in ("label", "host", "pid", "claimed_at", "owner"))
        return Claim(
            generation=generation,
            label=printable(label)[:MAX_LABEL] if isinstance(label, str) else "",  # it goes into log lines
            host=printable(host)[:_MAX_HOST] if isinstance(host, str) else "",
            pid=pid if isinstance(pid, int) and not isinstance(pid, bool) and 0 < pid <= MAX_INT else 0,
            claimed_at=_time(claimed_at),
            owner=printable(owner)[:MAX_LABEL] if isinstance(owner, str) else "",
        )

    def claim(self, floor: int, label: str = "", owner: str = "", handover_seconds: float = 0.0) -> int:
        """Claims a generation above ``floor`` and every claim so far; logs the writer it displaces. With
        ``handover_seconds``, a previous holder whose lease is alive is first asked to commit and stop, and
        waited for (up to that long; then it is fenced out instead)."""
        previous = self.newest()
        if previous and handover_seconds > 0:
            self.take_over(previous, label, owner, handover_seconds)
        generation = max(previous, floor) + 1
        label = label[:MAX_LABEL]
        for _ in range(100):
            me = Writer.current(generation, label)
            body = {
                "generation": generation,
                "label": label,
                "host": me.host,
                "pid": me.pid,
                "claimed_at": time.time(),
                "owner": owner,
            }
            if self.storage.create(f"{CLAIMS}/{generation:012d}", json.dumps(body).encode()):
                if previous:
                    log.info(
                        "%s: claimed writer generation %d; the previous writer was %s. If that one is still "
                        "running, its next commit will be refused (two trainings of one run_name).",
                        self.storage.url,
                        generation,
                        self.read(previous).describe(),
                    )
                return generation
            generation += 1
        raise FencedError(f"{self.storage.url}: could not claim a writer generation (100 concurrent claims?)")

    def take_over(self, generation: int, label: str, owner: str, timeout: float) -> bool:
        """Asks the holder of ``generation`` to hand over (commit and stop) if its lease is alive, and waits until
        it released the lease or stopped renewing it. Returns False when it was gone already."""
        lease = self.read_lease(generation)
        if lease is None or lease.get("released") or _age(lease) > LEASE_STALE:
            return False
        if exited_here(lease):
            log.info(
                "%s: generation %d was held by pid %s on this machine, which has exited: taken over at once",
                redact_uri(self.storage.url), generation, lease.get("pid"),
            )  # fmt: skip
            return False
        holder = self.read(generation)
        log.warning(
            "%s: %s still holds this run (lease renewed %.0f s ago); asking it to commit where it stands and stop",
            self.storage.url,
            holder.describe(),
            max(_age(lease), 0.0),
        )
        request = {"by": label, "owner": owner, "host": socket.gethostname(), "pid": os.getpid(), "at": time.time()}
        self.storage.put(f"{LEASES}/{generation:012d}.stop", json.dumps(request).encode())
        deadline, beat, seen_at = time.monotonic() + timeout, lease.get("beat"), time.monotonic()
        while time.monotonic() < deadline:
            time.sleep(min(1.0, LEASE_SECONDS / 2))
            lease = self.read_lease(generation)
            if lease is None or lease.get("released"):
                log.info("%s: generation %d handed over", redact_uri(self.storage.url), generation)
                return True
            if exited_here(lease):
                log.info("%s: generation %d exited while handing over", redact_uri(self.storage.url), generation)
                return True
            if lease.get("beat") != beat:
                beat, seen_at = lease.get("beat"), time.monotonic()
            elif time.monotonic() - seen_at > LEASE_STALE:
                break  # it stopped renewing: gone
        log.warning(
            "%s: generation %d did not hand over within %.0f s; fencing it out", self.storage.url, generation, timeout
        )
        return True

    def read_lease(self, generation: int) -> dict[str, Any] | None:
        """The holder's lease (``beat``, ``renewed_at``, ``released``), or None when there is none readable."""
        try:
            return as_dict(read_json(self.storage, f"{LEASES}/{generation:012d}", MAX_CLAIM_BYTES), "the lease")
        except (FileNotFoundError, DamagedFileError):
            return None

    def stop_request(self, generation: int) -> dict[str, Any] | None:
        """The request of a newer attempt that this generation hand over, if one was made: who asked (escaped)."""
        try:
            raw = as_dict(read_json(self.storage, f"{LEASES}/{generation:012d}.stop", MAX_CLAIM_BYTES), "the request")
        except (FileNotFoundError, DamagedFileError):
            return None
        return {
            k: printable(v)[:MAX_LABEL] if isinstance(v, str) else v
            for k, v in raw.items()
            if k in ("by", "owner", "host", "pid")
        }

    def check(self, writer: Writer, pointer_generation: int) -> None:
        newest = max(self.newest(), pointer_generation)
        if newest > writer.generation:
            raise FencedError(
                f"{self.storage.url}: a newer writer, {self.read(newest).describe()}, has claimed this run; this "
                f"writer (generation {writer.generation}, host {writer.host}, pid {writer.pid}) is stale and stops "
                f"without writing. Two trainings of one run_name were running; the newer one carries on from the "
                f"latest checkpoint."
            )


def _time(value: object) -> float:
    """A claim's time, or 0.0 (unknown) for anything but a finite, non-negative number."""
    try:
        seconds = float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else math.nan
    except OverflowError:
        return 0.0
    return seconds if math.isfinite(seconds) and seconds >= 0 else 0.0


_PROC = "/proc"


def _here() -> dict[str, Any] | None:
    """This process's machine, kernel boot, pid namespace and user: what a pid is read against. None without /proc."""
    try:
        with open(f"{_PROC}/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        pidns = os.stat(f"{_PROC}/self/ns/pid").st_ino
    except OSError:
        return None
    return {"host": socket.gethostname(), "boot": boot, "pidns": pidns, "uid": os.getuid()}


def process_identity(pid: int) -> dict[str, Any] | None:
    """What tells this machine's process ``pid`` from any other: host, kernel boot, pid namespace, user and its
    start time (clock ticks since boot). None where ``/proc`` does not say (not Linux, or the process is gone)."""
    try:
        here, start = _here(), _start_ticks(pid)
    except OSError:
        return None
    if here is None or start is None:
        return None
    return {**here, "pid": pid, "start": start}


def _start_ticks(pid: int) -> int | None:
    """The start time of process ``pid``, or None when it is gone or a zombie (killed, not yet reaped)."""
    try:
        with open(f"{_PROC}/{pid}/stat") as f:
            stat = f.read()
    except (FileNotFoundError, ProcessLookupError):
        return None
    fields = stat.rsplit(")", 1)[-1].split()  # after "pid (comm)": comm may hold spaces and parentheses
    if len(fields) < 20 or fields[0] in ("Z", "X"):
        return None
    return int(fields[19])  # field 22 of proc(5), counted from the state (field 3)


def exited_here(lease: dict[str, Any]) -> bool:
    """Whether the lease's holder ran on this machine, in this pid namespace, as this user, and has exited (its pid
    is gone, a zombie, or another process's). False whenever that cannot be known: then the lease must go stale."""
    said = lease.get("process")
    if not isinstance(said, dict):
        return False
    here = _here()
    if here is None or any(said.get(key) != value for key, value in here.items()):
        return False
    pid, start = said.get("pid"), said.get("start")
    if not all(isinstance(v, int) and not isinstance(v, bool) and 0 < v <= MAX_INT for v in (pid, start)):
        return False
    assert isinstance(pid, int)
    try:
        return pid != os.getpid() and _start_ticks(pid) != start
    except OSError:  # present but unreadable (permissions): not proof that it exited
        return False


class Lease:
    """This writer's proof of life, renewed on a thread while it trains; ``on_stop`` is called (once, from that
    thread) when a newer attempt asks it to hand over."""

    def __init__(self, fence: Fence, generation: int, on_stop: Callable[[dict[str, Any]], None]):
        self.fence, self.generation, self.on_stop = fence, generation, on_stop
        self._done = threading.Event()
        self._beat = 0
        self._asked = False
        self._thread = threading.Thread(target=self._run, name=f"lease-g{generation}", daemon=True)
        self._process = process_identity(os.getpid())  # lets a newer attempt on this machine see that it exited

    def start(self) -> Lease:
        self._renew(released=False)
        self._thread.start()
        return self

    def release(self) -> None:
        """Stops renewing and says so, so that a newer attempt need not wait for the lease to go stale."""
        if self._done.is_set():
            return
        self._done.set()
        if self._thread.is_alive():
            self._thread.join(timeout=LEASE_SECONDS * 2)
        try:
            self._renew(released=True)
        except Exception as exc:  # the lease then goes stale: a newer attempt waits LEASE_STALE at most
            log.warning("could not release the lease of generation %d: %s", self.generation, exc)

    def _run(self) -> None:
        while not self._done.wait(LEASE_SECONDS):
            try:
                self._renew(released=False)
                request = None if self._asked else self.fence.stop_request(self.generation)
            except Exception as exc:  # a store hiccup: try again at the next renewal
                log.warning("lease of generation %d not renewed: %s", self.generation, exc)
                continue
            if request is not None:
                self._asked = True
                self.on_stop(request)

    def _renew(self, released: bool) -> None:
        self._beat += 1
        body: dict[str, Any] = {"beat": self._beat, "renewed_at": time.time(), "released": released, "pid": os.getpid()}
        if self._process is not None:
            body["process"] = self._process
        self.fence.storage.put(f"{LEASES}/{self.generation:012d}", json.dumps(body).encode())


def _age(lease: dict[str, Any]) -> float:
    try:
        return time.time() - float(lease.get("renewed_at", 0.0))
    except (TypeError, ValueError):
        return float("inf")
