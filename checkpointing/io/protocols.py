"""Which object stores a URL needs, checked before anything is written; endpoint aliases other tools use.

fsspec reaches Google Cloud Storage and Azure only through packages this project does not install by
default (gcsfs, adlfs). Without them fsspec fails at the first I/O call with an ImportError that names
a package but not how to get it for this project; a run would get as far as its first write. So the
URL is checked when the configuration is validated, and the message names the extra to install.

Composer users point S3 clients at another endpoint (CoreWeave, MinIO, ...) with ``S3_ENDPOINT_URL``;
botocore only reads ``AWS_ENDPOINT_URL``. ``with_endpoint_alias`` honours the former when nothing else
names an endpoint.
"""

from __future__ import annotations

import os
from typing import Any

import fsspec

# protocol -> the extra of this project that installs its fsspec implementation
EXTRAS = {"gs": "gcs", "gcs": "gcs", "az": "azure", "abfs": "azure", "abfss": "azure"}
_S3 = ("s3", "s3a")


# Stores a run may live in. Anything else (http://, ssh://, chained 'a::b' URLs, ...) is refused: a run's
# parameters must not make the worker open arbitrary endpoints.
SUPPORTED = ("file", "local", "memory", "s3", "s3a", "gs", "gcs", "az", "abfs", "abfss")


def check_store_url(url: str, option: str = "save_folder") -> str:
    """Returns ``url`` (stripped) if it is a local path or a URL of a supported store that fsspec can open here;
    else a ValueError naming the option and the fix."""
    url = _well_formed(url, option)
    protocol = protocol_of(url)
    if protocol in ("file", "local", "memory"):
        return url
    try:
        fsspec.get_filesystem_class(protocol)
    except ImportError as exc:
        extra = EXTRAS.get(protocol)
        if extra:
            raise ValueError(
                f"{option}={url!r}: install the {extra} extra: pip install 'resumable-train[{extra}]'"
            ) from exc
        raise ValueError(f"{option}={url!r}: fsspec needs a package for {protocol}:// ({exc})") from exc
    except ValueError as exc:
        raise ValueError(
            f"{option}={url!r}: unknown protocol {protocol!r}; use a local path or file://, memory://, s3://, "
            f"gs:// or az:// (abfs://)"
        ) from exc
    return url


def _well_formed(value: str, option: str) -> str:
    text = str(value).strip()
    if not text:
        raise ValueError(
            f"{option}={value!r}: empty; use a local folder such as 'runs' or a URL such as 's3://bucket/runs'"
        )
    if len(text) > 1024 or any(ord(c) < 32 or ord(c) == 127 for c in text):
        raise ValueError(f"{option}={value[:80]!r}: use a printable path or URL under 1024 characters")
    if "::" in text:
        raise ValueError(f"{option}={value!r}: chained fsspec URLs ('a::b') are not supported; give one store's URL")
    protocol = protocol_of(text)
    if protocol not in SUPPORTED:
        raise ValueError(
            f"{option}={value!r}: protocol {protocol!r} is not supported; use a local path, file://, s3://, "
            f"gs://, az:// or memory://"
        )
    return text


def protocol_of(url: str) -> str:
    """The scheme of ``url`` in lower case (``s3``, ``memory``, ...); ``file`` for a plain path."""
    return (fsspec.core.split_protocol(str(url))[0] or "file").lower()


def open_url(url: str, storage_options: dict[str, Any] | None = None) -> tuple[fsspec.AbstractFileSystem, str]:
    """fsspec's filesystem and path for ``url`` with ``storage_options`` (and the ``S3_ENDPOINT_URL`` alias)."""
    return fsspec.core.url_to_fs(url, **with_endpoint_alias(url, storage_options))


def is_local_fs(fs: fsspec.AbstractFileSystem) -> bool:
    """True for the local disk, where links and special files exist and must not be followed."""
    protocols = (fs.protocol,) if isinstance(fs.protocol, str) else fs.protocol
    return bool({"file", "local"} & set(protocols))


def with_endpoint_alias(url: str, storage_options: dict[str, Any] | None) -> dict[str, Any]:
    """``storage_options`` for ``url``, plus ``S3_ENDPOINT_URL`` as the endpoint of an s3:// URL when neither
    the options nor the AWS variables name one. Never logs (options may hold credentials)."""
    options = dict(storage_options or {})
    endpoint = os.environ.get("S3_ENDPOINT_URL")
    if not endpoint or protocol_of(url) not in _S3:
        return options
    client_kwargs = dict(options.get("client_kwargs") or {})
    configured = (
        "endpoint_url" in options
        or "endpoint_url" in client_kwargs
        or os.environ.get("AWS_ENDPOINT_URL")
        or os.environ.get("AWS_ENDPOINT_URL_S3")
    )
    if configured:
        return options
    client_kwargs["endpoint_url"] = endpoint
    return {**options, "client_kwargs": client_kwargs}
