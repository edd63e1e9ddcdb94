"""Secrets never leave the process: what the product logs or stores goes through here first.

A URI can carry a credential (``http://trainer:<password>@host``, a presigned S3 URL, an Azure SAS) and a run's
parameters can nest one (``service.auth.api_key``, an Azure ``connection_string``). Logs reach stdout and the
Prefect UI; run folders, manifests and MLflow are read by whoever reads the bucket or the server. So:

- ``redact_uri``: a userinfo's password becomes ``***`` (``trainer:***@host``); a userinfo without a password is
  masked whole (it may be a token: ``https://<token>@host``), except in ``az://`` / ``abfs://`` URLs, where it
  names the container. A query (or fragment) parameter whose name is credential-like (the word list below:
  ``X-Amz-Credential``, ``token``, ``sig`` ...) has its value masked; in a signed URL (a parameter named ``sig``,
  ``signature`` or ``X-...-Signature``: presigned S3/GCS, Azure SAS) every value is masked, since the signed
  query as a whole grants access. Anything else is returned unchanged, character for character.
- ``CREDENTIAL_WORDS``: the one list of credential-like names, shared by ``redact`` and the recipes' own refusals
  (recipes/gpt.py). A name matches when one of its words (split at ``_ - . :``, spaces and camelCase) is in the list,
  or, for an entry of several words (``connection_string``), when the name without separators contains it.
- ``redact``: a copy of nested dicts/lists with the values of credential-like keys replaced by ``REDACTED``, and
  every string through ``redact_text`` (URIs, and ``AccountKey=...``-style pairs of a connection string).
"""

from __future__ import annotations

import re
from typing import Any
from urllib.parse import unquote, urlsplit

REDACTED = "<redacted>"  # a value of a credential-like key
MASK = "***"  # a secret inside a URI or a line of text

CREDENTIAL_WORDS = (
    "secret", "secrets", "password", "passwords", "passwd", "pwd", "passphrase", "token",
    "credential", "credentials", "key", "apikey", "session", "auth", "authorization", "bearer", "cookie", "cookies",
    "sig", "signature", "sas", "jwt",
    "api_key", "access_key", "secret_key", "private_key", "account_key", "session_token", "client_secret",
    "connection_string", "shared_access_signature",
)  # fmt: skip
_WORDS = frozenset(w for w in CREDENTIAL_WORDS if "_" not in w)
_COMPOUNDS = tuple(w.replace("_", "") for w in CREDENTIAL_WORDS if "_" in w)
_SIGNATURES = re.compile(r"sig|signature|x-[a-z0-9]+-signature", re.IGNORECASE)
_AZURE = ("az", "abfs", "abfss")
_URI = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://[^\s'\"<>`]+")
_PAIR = re.compile(r"(?<![A-Za-z0-9_.-])([A-Za-z][A-Za-z0-9_.-]*)=([^;&\s'\"]+)")


def words_of(name: str) -> list[str]:
    """``X-Amz-Credential`` -> [x, amz, credential]; ``accountKey`` -> [account, key]."""
    spaced = re.sub(r"([a-z0-9])([A-Z])", r"\1 \2", str(name))
    return [w for w in re.split(r"[^A-Za-z0-9]+", spaced.lower()) if w]


def is_credential_name(name: object) -> bool:
    """True for a key or parameter name that looks like a credential (``CREDENTIAL_WORDS``)."""
    words = words_of(str(name))
    compact = "".join(words)
    return any(w in _WORDS for w in words) or any(c in compact for c in _COMPOUNDS)


def credential_keys(value: Any) -> list[str]:
    """The credential-like key names anywhere in nested dicts and lists, outermost first."""
    if isinstance(value, dict):
        here = [str(k) for k in value if is_credential_name(k)]
        return here + [k for v in value.values() for k in credential_keys(v)]
    if isinstance(value, (list, tuple)):
        return [k for v in value for k in credential_keys(v)]
    return []


def redact(value: Any) -> Any:
    """A copy of ``value`` with credential-like keys' values ``REDACTED`` and secrets in strings masked."""
    if isinstance(value, dict):
        return {k: REDACTED if is_credential_name(k) else redact(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [redact(v) for v in value]
    if isinstance(value, str):
        return redact_text(value)
    return value


def redact_text(text: str) -> str:
    """Every URI in ``text`` through ``redact_uri``, and ``Name=value`` pairs with a credential-like name masked
    (``AccountKey=...;`` of a connection string, ``token=...`` in a message)."""
    text = _URI.sub(lambda m: redact_uri(m.group(0)), str(text))
    return _PAIR.sub(lambda m: f"{m.group(1)}={MASK}" if is_credential_name(m.group(1)) else m.group(0), text)


def redact_uri(uri: str) -> str:
    """``uri`` without its secrets (the module's docstring says which); unchanged if it has none."""
    uri = str(uri)
    if "://" not in uri:
        return uri
    try:
        parts = urlsplit(uri)
    except ValueError:  # not parseable (an open IPv6 bracket): nothing after the scheme is shown
        return uri.split("://", 1)[0] + "://" + MASK
    netloc = parts.netloc
    if "@" in netloc:
        userinfo, host = netloc.rsplit("@", 1)
        user, colon, _ = userinfo.partition(":")
        if colon:
            userinfo = f"{user}:{MASK}"
        elif parts.scheme.lower() not in _AZURE:
            userinfo = MASK
        netloc = f"{userinfo}@{host}"
    signed = any(_SIGNATURES.fullmatch(_name(p)) for p in f"{parts.query}&{parts.fragment}".split("&"))
    out = f"{uri.split('://', 1)[0]}://{netloc}{parts.path}"
    if "?" in uri.split("#", 1)[0]:
        out += "?" + _masked_params(parts.query, signed)
    if "#" in uri:
        out += "#" + _masked_params(parts.fragment, signed)
    return out


def _name(param: str) -> str:
    return unquote(param.split("=", 1)[0])


def _masked_params(query: str, signed: bool) -> str:
    params = query.split("&")
    return "&".join(
        f"{p.split('=', 1)[0]}={MASK}" if "=" in p and (signed or is_credential_name(_name(p))) else p for p in params
    )
