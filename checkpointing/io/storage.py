"""A handful of object-store operations over fsspec, each retried by tenacity on transient faults.

Remote paths stay strings (a ``pathlib.Path`` collapses ``s3://`` to ``s3:/``). Only operations an
object store really has are used: put a whole object, get a whole object, list, delete. There is no
rename and no symlink, so the commit protocol in ``store.py`` never relies on one.
"""

from __future__ import annotations

import errno
import logging
import os
import random
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import IO, Any, TypeVar

import fsspec
from tenacity import RetryCallState, Retrying, retry_if_exception

from checkpointing.errors import (
    AccessDeniedError,
    CheckpointError,
    DamagedFileError,
    LinkedLocationError,
    ManifestError,
    PermanentStorageError,
    StorageError,
)
from checkpointing.io import confine
from checkpointing.io.hashing import BackgroundSha256
from checkpointing.io.localfs import LocalFiles
from checkpointing.io.protocols import is_local_fs, protocol_of, with_endpoint_alias
from checkpointing.io.untrusted import printable

log = logging.getLogger(__name__)
T = TypeVar("T")

# What S3-compatible stores answer for faults worth retrying: HTTP statuses and error codes (a throttled or
# timed-out request may come back as 400/409/429 with one of these codes).
_TRANSIENT_STATUSES = {408, 429, 500, 502, 503, 504}
_TRANSIENT_CODES = {
    "SlowDown",
    "Throttling",
    "ThrottlingException",
    "TooManyRequests",
    "RequestLimitExceeded",
    "RequestTimeout",
    "RequestTimeoutException",
    "InternalError",
    "ServiceUnavailable",
    "OperationAborted",
    "PriorRequestNotComplete",
}
# For errors that carry no HTTP status (network failures, other fsspec backends): words in their message.
_TRANSIENT_WORDS = (
    "slowdown",
    "slow down",
    "throttl",
    "requesttimeout",
    "request timeout",
    "internalerror",
    "serviceunavailable",
    "service unavailable",
    "internal error",
    "bad gateway",
    "gateway timeout",
    "connection reset",
    "connection aborted",
    "broken pipe",
    "server disconnected",
    "timed out",
    "timeout",
    "temporarily unavailable",
)
_TRANSIENT_STATUS_TEXT = re.compile(r"\b(500|502|503|504|429)\b")
_CHUNK = 16 * 1024 * 1024
_TRANSIENT_ERRNOS = {
    errno.EREMOTEIO,
    errno.EBUSY,
    errno.ETIMEDOUT,
    errno.ECONNRESET,
    errno.ECONNABORTED,
    errno.EAGAIN,
    errno.EPIPE,
    errno.ECONNREFUSED,
}
_PERMANENT_TYPES = (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError, LinkedLocationError)
_NETWORK_ERRORS = {
    "ClientConnectionError",
    "ServerDisconnectedError",
    "ClientPayloadError",
    "EndpointConnectionError",
    "ConnectTimeoutError",
    "ReadTimeoutError",
    "ConnectionClosedError",
    "ServerTimeoutError",
    "IncompleteReadError",
    "ResponseStreamingError",
}


@dataclass(frozen=True)
class RetrySettings:
    """How long to keep trying an object-store call on transient faults: until ``max_seconds`` have passed since its
    first attempt (no attempt starts later; the wait before the last one is cut to fit), and at least ``attempts``
    times whatever the clock says (a floor, for a budget that one slow attempt could use up). The wait before retry n
    is drawn from [0, min(max_wait, initial_wait * 2**(n-1))] (full jitter), so a call keeps asking every few seconds
    through an outage as long as the budget, and each attempt is one request (no library retries underneath)."""

    attempts: int = 6
    max_seconds: float = 120.0
    initial_wait: float = 0.2
    max_wait: float = 4.0


def is_transient(exc: BaseException) -> bool:
    """True for faults that a retry can cure: timeouts, resets, 5xx, throttling.

    An HTTP answer decides by its status and error code, never by words in its message (a 400 whose
    message quotes a key like ``step-500`` is not a 500). s3fs turns botocore's ClientError into an
    OSError; the ClientError stays on the chain, so its status and code are read from there."""
    if isinstance(exc, _PERMANENT_TYPES):
        return False
    if isinstance(exc, (TimeoutError, ConnectionError)):
        return True
    for e in _chain(exc):
        status, code = http_status(e), error_code(e)
        if status is not None or code:
            return status in _TRANSIENT_STATUSES or code in _TRANSIENT_CODES
    if isinstance(exc, OSError) and exc.errno in _TRANSIENT_ERRNOS:  # s3fs maps 500 -> EREMOTEIO, 503 -> EBUSY
        return True
    if {type(e).__name__ for e in _chain(exc)} & _NETWORK_ERRORS:
        return True
    text = " ".join(str(e).lower() for e in _chain(exc))
    return any(word in text for word in _TRANSIENT_WORDS) or bool(_TRANSIENT_STATUS_TEXT.search(text))


def http_status(exc: BaseException) -> int | None:
    """The HTTP status an error carries: botocore's ``response``, or a ``status``/``status_code`` attribute."""
    response = getattr(exc, "response", None)
    if isinstance(response, dict):
        status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        return int(status) if status else None
    for attribute in ("status_code", "status"):
        value = getattr(exc, attribute, None)
        if isinstance(value, int) and 100 <= value <= 599:
            return value
    return None


def error_code(exc: BaseException) -> str:
    """The S3 error code of a botocore ClientError (``SlowDown``, ``NoSuchBucket``, ...), else ''."""
    response = getattr(exc, "response", None)
    code = response.get("Error", {}).get("Code") if isinstance(response, dict) else None
    return str(code) if code else ""


def no_such_bucket(exc: BaseException) -> bool:
    """True when S3 said the bucket itself is missing (not merely the object)."""
    return any(error_code(e) == "NoSuchBucket" for e in _chain(exc))


def _chain(exc: BaseException) -> Iterator[BaseException]:
    seen = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        yield current
        current = current.__cause__ or current.__context__


class Storage:
    """Object-store I/O rooted at one URL. Every call retries transient faults with backoff+jitter.

    Local folders go through ``LocalFiles``, which never follows a symbolic link below ``anchor`` (by
    default the root itself; a CheckpointStore anchors at ``save_folder``, so the run folder is walked too; a
    deployment run's stores anchor at the worker's allowed root: checkpointing/io/confine.py).
    On S3, s3fs's and botocore's own retries are turned off (unless the caller set them): this class's
    tenacity policy is the one retry layer, so ``RetrySettings.max_seconds`` bounds a call."""

    def __init__(
        self,
        url: str,
        storage_options: dict[str, Any] | None = None,
        retry: RetrySettings | None = None,
        anchor: str | None = None,
    ):
        if "://" not in url:  # a plain local path: report it absolute, as file URIs are
            url = os.path.abspath(url)
        self.url = url.rstrip("/")
        self.retry = retry or RetrySettings()
        protocol = protocol_of(self.url)
        options = _with_single_retry_layer(protocol, with_endpoint_alias(self.url, storage_options), self.retry)
        self.fs, self.root = fsspec.core.url_to_fs(self.url, **options)
        self.root = self.root.rstrip("/")
        self.protocol = self.fs.protocol if isinstance(self.fs.protocol, str) else self.fs.protocol[0]
        self.is_local = is_local_fs(self.fs)
        self.local: LocalFiles | None = None
        if self.is_local and confine.local_roots() is not None:  # a deployment run: walked from its allowed root
            self.local = confine.local_files(self.root, self.url)
        elif self.is_local:
            base = os.path.abspath(fsspec.core.url_to_fs(anchor)[1]) if anchor else self.root
            self.local = LocalFiles(base, os.path.relpath(self.root, base) if base != self.root else "")
        if protocol in ("s3", "s3a") and "retries" not in (storage_options or {}):
            self.fs.retries = 1  # s3fs keeps it as an attribute, not an option
        self._bucket_found = self.is_local or self.protocol == "memory"  # no buckets there

    # -- paths ---------------------------------------------------------------------------------
    def path(self, key: str) -> str:
        return f"{self.root}/{key}" if key else self.root

    def uri(self, key: str = "") -> str:
        return f"{self.url}/{key}" if key else self.url

    # -- operations ----------------------------------------------------------------------------
    def put(self, key: str, data: bytes) -> None:
        local = self.local
        if local is not None:
            self.retried(f"put {key}", lambda: local.write(key, data), missing_is_error=True)
        else:
            self.retried(f"put {key}", lambda: self.fs.pipe_file(self.path(key), data), missing_is_error=True)

    def open_write(self, key: str, block_size: int | None = None) -> IO[bytes]:
        """A file handle to stream ``key`` into (not retried: the caller redoes the whole file). Locally, a
        link there is removed, not written through; on object stores, ``block_size`` is the upload part."""
        if self.local is not None:
            return self.local.open_write(key)
        return self.fs.open(self.path(key), "wb", block_size=block_size)

    def create(self, key: str, data: bytes) -> bool:
        """Writes ``key`` only if it does not exist yet (atomically); False if it already did.

        Local files use O_EXCL; object stores a conditional put (S3: If-None-Match: *)."""
        local = self.local
        if local is not None:
            return self.retried(f"create {key}", lambda: local.create(key, data), missing_is_error=True)

        def create_remote() -> bool:
            try:
                self.fs.pipe_file(self.path(key), data, mode="create")
            except FileExistsError:
                return False
            return True

        return self.retried(f"create {key}", create_remote, missing_is_error=True)

    def copy(self, src: str, dst: str) -> None:
        """Copies object ``src`` to ``dst`` inside this store: on S3 a server-side CopyObject (no byte passes through
        this process); locally in chunks, never through a link."""
        local = self.local
        if local is not None:
            return self.retried(f"copy {src} to {dst}", lambda: local.copy(src, dst), missing_is_error=True)
        self.retried(
            f"copy {src} to {dst}", lambda: self.fs.copy(self.path(src), self.path(dst)), missing_is_error=True
        )

    def get(self, key: str, max_bytes: int | None = None) -> bytes:
        """The object's bytes; with ``max_bytes``, no more than ``max_bytes + 1`` of them are read (a caller
        that gets more than ``max_bytes`` knows the object is too big without having read it all)."""
        limit = None if max_bytes is None else max_bytes + 1
        local = self.local
        if local is not None:
            chunk = _CHUNK if limit is None else min(_CHUNK, limit)  # a 1 GiB `latest` costs 4 KiB, not 16 MiB
            return self.retried(f"get {key}", lambda: _first_bytes(local.read(key, chunk), limit))
        if limit is None:
            return self.retried(f"get {key}", lambda: self.fs.cat_file(self.path(key)))

        def first_bytes() -> bytes:
            try:
                return self.fs.cat_file(self.path(key), start=0, end=limit)
            except OSError as exc:  # S3 answers any byte range of an empty object with 416: it holds no bytes
                if any(http_status(e) == 416 or error_code(e) == "InvalidRange" for e in _chain(exc)):
                    return b""
                raise

        return self.retried(f"get {key}", first_bytes)

    def get_hashed(self, key: str, max_bytes: int | None = None) -> tuple[bytes, str]:
        """Reads an object once and its sha256: each chunk is hashed on a helper thread while the next
        one is read (both release the GIL), so verifying costs little more than reading. With ``max_bytes``,
        reading stops past ``max_bytes`` (the caller sees more than it expected, without all of it)."""

        def read() -> tuple[bytes, str]:
            digest, chunks, total = BackgroundSha256(), [], 0
            for chunk in self._chunks(key):
                chunks.append(chunk)
                digest.submit(chunk)
                total += len(chunk)
                if max_bytes is not None and total > max_bytes:
                    break
            return b"".join(chunks), digest.hexdigest()

        return self.retried(f"get {key}", read)

    def open_read(self, key: str) -> IO[bytes]:
        """A file handle to read ``key`` from (seekable; not retried: the caller redoes the whole read). Locally, never
        through a link."""
        if self.local is not None:
            return self.retried(f"open {key}", lambda: self.local.open_read(key))  # type: ignore[union-attr]
        return self.retried(f"open {key}", lambda: self.fs.open(self.path(key), "rb"))

    def download(self, key: str, path: str, expected_size: int) -> int:
        """Copies ``key`` into the local file ``path`` (made, or truncated), retrying the whole copy on a transient
        fault; stops reading past ``expected_size`` bytes. Returns the bytes the object held (up to one past)."""

        def copy() -> int:
            total = 0
            with open(path, "wb") as out:
                for chunk in self._chunks(key):
                    out.write(chunk)
                    total += len(chunk)
                    if total > expected_size:
                        break
            return total

        return self.retried(f"read {key}", copy)

    def _chunks(self, key: str) -> Iterator[bytes]:
        if self.local is not None:
            yield from self.local.read(key)
            return
        with self.fs.open(self.path(key), "rb") as f:
            while chunk := f.read(_CHUNK):
                yield chunk

    def exists(self, key: str) -> bool:
        """True for a file or folder; a link or special file in a local folder is damage, not a file."""
        local = self.local
        if local is not None:
            return self.retried(f"exists {key}", lambda: local.kind(key) in ("file", "dir"))
        return self.retried(f"exists {key}", lambda: self.fs.exists(self.path(key)))

    def sizes(self, prefix: str) -> dict[str, int]:
        """Sizes of every object under ``prefix``, keyed by path relative to it (NOT_A_FILE for a link)."""
        local = self.local
        if local is not None:
            return self.retried(f"list {prefix}", lambda: local.sizes(prefix))
        base = self.path(prefix).rstrip("/") + "/"

        def find() -> dict[str, int]:
            self.fs.invalidate_cache()
            found = self.fs.find(base, detail=True)
            return {
                p[len(base) :]: int(info.get("size") or 0)
                for p, info in found.items()
                if info.get("type", "file") == "file"
            }

        return self.retried(f"list {prefix}", find)

    def list_dirs(self, prefix: str) -> list[str]:
        """Names of the immediate sub-folders of ``prefix`` (empty when it does not exist)."""
        local = self.local
        if local is not None:
            return self.retried(f"list {prefix}", lambda: local.list_dirs(prefix))
        base = self.path(prefix).rstrip("/")

        def ls() -> list[str]:
            self.fs.invalidate_cache()
            try:
                entries = self.fs.ls(base, detail=True)
            except FileNotFoundError as exc:
                if no_such_bucket(exc) or self._missing_bucket():
                    raise
                return []
            return sorted(e["name"].rstrip("/").rsplit("/", 1)[-1] for e in entries if e.get("type") == "directory")

        return self.retried(f"list {prefix}", ls)

    def delete(self, key: str, recursive: bool = False) -> None:
        local = self.local
        if local is not None:
            return self.retried(f"delete {key}", lambda: local.delete(key, recursive))

        def rm() -> None:
            try:
                self.fs.rm(self.path(key), recursive=recursive)
            except FileNotFoundError as exc:
                if no_such_bucket(exc):
                    raise

        self.retried(f"delete {key}", rm)

    def require_bucket(self) -> None:
        """PermanentStorageError naming the bucket when the store says it does not exist (an object store that
        answers NoSuchBucket); nothing when it exists, has no buckets, or the question itself failed."""
        if self._missing_bucket():
            bucket = printable(self.root.split("/", 1)[0])
            raise PermanentStorageError(
                f"no such bucket '{bucket}' (in {printable(self.url)}): create it, or fix the bucket's name"
            )

    def _missing_bucket(self) -> bool:
        """After a "not found": was it the bucket? (A HEAD answer has no body to say so.) Checked until the
        bucket is seen once, so a mistyped bucket fails the first read instead of looking like a new run."""
        if self._bucket_found:
            return False
        missing = _missing_bucket_of(self)
        self._bucket_found = missing is False
        return bool(missing)

    # -- retry ---------------------------------------------------------------------------------
    def retried(self, what: str, fn: Callable[[], T], missing_is_error: bool = False, key: str = "") -> T:
        """Runs ``fn`` with retries. FileNotFoundError passes through for reads (a missing object is an
        answer); for writes, and for reads from a bucket that does not exist, it is a permanent error (else
        a mistyped bucket would read as "no checkpoint yet" and a run would start over). ``key`` names where a
        full disk or a refused file is said to be when the OSError itself names no file."""
        r = self.retry
        retrying = Retrying(
            retry=retry_if_exception(_retryable),
            stop=_stop_when_spent(r),
            wait=_full_jitter(r),
            before_sleep=lambda state: _log_retry(self.uri(), what, state),
            reraise=True,
        )
        try:
            return retrying(fn)
        except _OWN_ERRORS:
            raise  # the product's own typed errors (from a whole commit run under this policy) say what to do
        except FileNotFoundError as exc:
            if not missing_is_error and not no_such_bucket(exc) and not self._missing_bucket():
                raise
            raise PermanentStorageError(
                f"{what} at {self.uri()} failed (permanent): no such bucket or folder ({exc}); "
                f"create it or fix save_folder"
            ) from exc
        except Exception as exc:
            raise _storage_error(what, self.uri(), exc, self.is_local, self.uri(key)) from exc


_OWN_ERRORS = (LinkedLocationError, CheckpointError, StorageError, ManifestError, DamagedFileError)


def _retryable(exc: BaseException) -> bool:
    """A transient fault of the store itself. The product's own errors are never retried again: a StorageError
    has had its retries (a whole commit run under this policy calls the store's retried calls), and the others
    (a commit that did not verify, a fenced writer) would fail the same way."""
    return not isinstance(exc, _OWN_ERRORS) and is_transient(exc)


_JITTER = random.Random()  # the store's own generator: never training's (see training/unit/rng.py)


def _stop_when_spent(r: RetrySettings) -> Callable[[RetryCallState], bool]:
    """Stop once the time budget is spent and the floor of attempts is reached (see RetrySettings)."""

    def stop(state: RetryCallState) -> bool:
        return state.attempt_number >= r.attempts and _elapsed(state) >= r.max_seconds

    return stop


def _full_jitter(r: RetrySettings) -> Callable[[RetryCallState], float]:
    """tenacity's ``wait_random_exponential`` (uniform in [0, min(max_wait, initial_wait * 2**(n-1))]), drawn from
    the store's own generator (tenacity's draws from the global ``random`` would shift a recipe's stream), cut so
    that the next attempt starts within the budget: the last one runs when the budget ends, not a back-off later."""

    def wait(state: RetryCallState) -> float:
        drawn = _JITTER.uniform(0, min(r.max_wait, r.initial_wait * 2 ** min(state.attempt_number - 1, 60)))
        left = r.max_seconds - _elapsed(state)
        return drawn if state.attempt_number < r.attempts else max(0.0, min(drawn, left))

    return wait


def _elapsed(state: RetryCallState) -> float:
    return state.seconds_since_start or 0.0


def _first_bytes(chunks: Iterator[bytes], limit: int | None) -> bytes:
    if limit is None:
        return b"".join(chunks)
    head, size = [], 0
    for chunk in chunks:
        head.append(chunk if size + len(chunk) <= limit else chunk[: limit - size])
        size += len(head[-1])
        if size >= limit:
            break
    return head[0] if len(head) == 1 else b"".join(head)


_NO_SPACE = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG}
_NOT_ALLOWED = {errno.EACCES, errno.EPERM, errno.EROFS}


def _storage_error(what: str, uri: str, exc: Exception, is_local: bool, where: str = "") -> StorageError:
    """The typed error for a call that failed for good: callers decide on the type, never on the text. A full disk
    or a refused local file is said in those words, at the path, whatever wrapped the OSError (torch.save turns
    a failed write into ``RuntimeError: [enforce fail at inline_container...``, the OSError on its chain)."""
    detail = f"{type(exc).__name__}: {exc}"
    own_errors = _NO_SPACE | _NOT_ALLOWED if is_local else _NO_SPACE  # s3fs says a 403 as EACCES: the credentials
    os_error = next((e for e in _chain(exc) if isinstance(e, OSError) and e.errno in own_errors), None)
    if os_error is not None:
        return _os_error(what, where or uri, os_error)
    if is_transient(exc):
        return StorageError(f"{what} at {uri} failed (transient, retries exhausted): {detail}")
    if isinstance(exc, PermissionError) or any(
        http_status(e) == 403 or error_code(e) in ("AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch")
        for e in _chain(exc)
    ):
        fix = (
            "check that this user may read and write that folder"
            if is_local
            else "check the credentials (AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, AWS_PROFILE or the instance role) "
            "and that they may read and write there"
        )
        return AccessDeniedError(f"{what} at {uri} failed: access denied; {fix} ({detail})")
    return PermanentStorageError(f"{what} at {uri} failed (permanent): {detail}")


def _os_error(what: str, uri: str, exc: OSError) -> PermanentStorageError:
    """ENOSPC (and quota) or EACCES (and read-only) in the product's words: one line, the path, what to do."""
    code = errno.errorcode.get(exc.errno or 0, str(exc.errno))
    said = f" ({code} on {printable(exc.filename)})" if exc.filename and str(exc.filename) != uri else ""
    if exc.errno in _NO_SPACE:
        return PermanentStorageError(
            f"{what} failed: no space left on device at {uri}{said}; free space there (or choose another "
            f"save_folder), then run the same command again: it resumes from the last checkpoint"
        )
    return AccessDeniedError(
        f"{what} failed: permission denied at {uri}{said or f' ({code})'}; check that this user may write there "
        f"(or choose another save_folder), then run the same command again"
    )


def _with_single_retry_layer(protocol: str, options: dict[str, Any], retry: RetrySettings) -> dict[str, Any]:
    """S3 options with botocore's own retries off and each attempt's timeouts within our time budget."""
    if protocol not in ("s3", "s3a"):
        return options
    config = dict(options.get("config_kwargs") or {})
    config.setdefault("retries", {"total_max_attempts": 1})
    config.setdefault("connect_timeout", max(1.0, min(10.0, retry.max_seconds)))
    config.setdefault("read_timeout", max(1.0, min(60.0, retry.max_seconds)))
    return {**options, "config_kwargs": config}


def _missing_bucket_of(storage: Storage) -> bool | None:
    """Asks the store whether ``storage``'s bucket is missing: only a NoSuchBucket answer says yes; None when
    the question itself failed."""
    try:
        storage.fs.ls(storage.root, refresh=True)
    except FileNotFoundError as exc:  # an empty prefix of an existing bucket reads as missing too
        return no_such_bucket(exc)
    except Exception:
        return None
    finally:
        storage.fs.invalidate_cache(storage.root)
    return False


def _log_retry(url: str, what: str, state: RetryCallState) -> None:
    exc = state.outcome.exception() if state.outcome else None
    log.warning(
        "object store %s: %s failed (attempt %d: %s: %s); retrying in %.2fs",
        url,
        what,
        state.attempt_number,
        type(exc).__name__,
        exc,
        state.next_action.sleep if state.next_action else 0.0,
    )
