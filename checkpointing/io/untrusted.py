"""What a store holds is untrusted: small JSON files are bounded before they are parsed and typed after, and
text from a store is escaped before a person sees it.

Anyone who may write a bucket may write ``latest``, a manifest, a roll-back record or a claim, and a reader
that fails on one of them fails every relaunch of the run. ``json.loads`` alone is not safe for that: it reads
whatever size it is given (a 1 GiB ``latest`` cost +1.85 GB of memory), and its scanner recurses once per
nesting level (100 000 ``[`` end in RecursionError, or in a crash where a library raised the recursion limit).
So every small file goes through ``read_json``: at most ``max_bytes`` are fetched (``Storage.get`` stops at
``max_bytes + 1``), nesting is measured on the bytes before the parser runs, and every failure is a
``DamagedFileError`` (a ValueError) that names the problem, never the content. Callers then type each field
with the helpers below and turn damage into a fallback or one clear line.
"""

from __future__ import annotations

import json
import math
import operator
import re
from itertools import accumulate, count
from typing import TYPE_CHECKING, Any

from checkpointing.errors import DamagedFileError

if TYPE_CHECKING:
    from checkpointing.io.storage import Storage

# Caps, each with room above the largest file this package writes of that kind:
# - a manifest lists every file of a checkpoint: measured ~535 bytes per rank for a sharded (DCP) checkpoint
#   with 4 files a rank (548 045 bytes for 1024 ranks, 8.8 MB for 16 384 ranks), so 16 MiB holds ~31 000
#   ranks. Its worst case, 16 MiB of ``{},``, parses into ~400 MB of Python objects for a moment.
#   The writer refuses a manifest over the cap (store.py), so no run can commit one it could not read back.
MAX_MANIFEST_BYTES = 16 << 20
# - ``latest`` is a name (at most 128 characters), a generation and a 64-digit sha256: ~200 bytes.
MAX_POINTER_BYTES = 4 << 10
# - a claim is a generation, host, pid, time and a label (the flow's is ~70 characters; labels are cut to
#   MAX_LABEL when written).
MAX_CLAIM_BYTES = 4 << 10
# - a roll-back record names its target and, for people, at most MAX_LISTED checkpoints it set aside
#   (names of at most 128 characters): under 140 KB.
MAX_ROLLBACK_BYTES = 1 << 20
MAX_LABEL = 256
MAX_LISTED = 1000
# Nesting: a manifest is 4 levels deep plus the recipe_args it records (metadata.config.recipe_args): 128
# leaves recipe_args 124 levels, more than any config layer should accept, and stays far below Python's
# recursion limit (1000), so nothing that walks a parsed value afterwards (a checksum's json.dumps) comes
# near it either.
MAX_JSON_DEPTH = 128
# Generations and counters become file names and int64 tensors: larger is damage.
MAX_INT = 2**63 - 1

_ESCAPE = re.compile(rb"\\.", re.DOTALL)
_STRING = re.compile(rb'"[^"]*"')
_NOT_BRACKET = bytes(b for b in range(256) if b not in b"[]{}")
_OPEN_AS_TWO = bytes.maketrans(b"[{]}", b"\x02\x02\x00\x00")


def read_json(storage: Storage, key: str, max_bytes: int, *, allow_nan: bool = True) -> Any:
    """``key`` parsed as JSON, reading at most ``max_bytes + 1`` bytes of it. FileNotFoundError when it is
    missing (or a local link, which is never followed); DamagedFileError for anything else wrong."""
    return parse_json(storage.get(key, max_bytes=max_bytes), max_bytes, allow_nan=allow_nan)


def parse_json(data: bytes, max_bytes: int, *, allow_nan: bool = True) -> Any:
    """``data`` as JSON: refused when larger than ``max_bytes`` or nested deeper than MAX_JSON_DEPTH, before
    the parser runs. ``allow_nan=False`` refuses NaN and Infinity (not JSON, but Python writes them)."""
    if len(data) > max_bytes:
        raise DamagedFileError(f"larger than {max_bytes} bytes")
    try:
        text = data.decode("utf-8")  # every byte of [ ] { } " \ in UTF-8 is that character: the scan below holds
    except UnicodeDecodeError as exc:
        raise DamagedFileError(f"not UTF-8 (byte {exc.start})") from exc
    depth = nesting_depth(data)
    if depth > MAX_JSON_DEPTH:
        raise DamagedFileError(f"not JSON this reader accepts: nested {depth} levels deep (at most {MAX_JSON_DEPTH})")
    try:
        return json.loads(text, parse_constant=None if allow_nan else _no_constant)
    except json.JSONDecodeError as exc:
        raise DamagedFileError(f"not JSON ({exc.msg} at byte {exc.pos})") from exc
    except (ValueError, RecursionError) as exc:  # e.g. an integer of more than 4300 digits
        raise DamagedFileError(f"not JSON this reader accepts ({type(exc).__name__})") from exc


def nesting_depth(data: bytes) -> int:
    """How deep ``[``/``{`` nest in JSON ``data``, outside strings; linear time, C loops only.

    Escapes go first (``\\"`` would end a string early), then whole strings, then everything but brackets.
    For invalid JSON the figure may be off, but never below the depth the parser reaches before it stops:
    up to the first invalid byte the scan and the parser agree."""
    brackets = _STRING.sub(b"", _ESCAPE.sub(b"", data)).translate(None, _NOT_BRACKET)
    if not brackets:
        return 0
    # Opening brackets count 2, closing 0: after k brackets, the running sum minus k is the depth.
    return max(map(operator.sub, accumulate(brackets.translate(_OPEN_AS_TWO)), count(1)))


def _no_constant(name: str) -> float:
    raise ValueError(f"{name} is not a number JSON allows")


# -- typing parsed values ------------------------------------------------------------------------------
def as_dict(value: Any, what: str) -> dict[str, Any]:
    """A JSON object with string keys (JSON's keys always are; the check keeps mypy and readers honest)."""
    if not isinstance(value, dict):
        raise DamagedFileError(f"{what} is a JSON {_kind(value)}, not an object")
    return value


def as_int(value: Any, what: str, upper: int = MAX_INT) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= upper:
        raise DamagedFileError(f"{what} is not an integer from 0 to {upper}")
    return value


def as_float(value: Any, what: str, *, finite: bool = True) -> float:
    """A JSON number as a float; NaN and infinities only when ``finite`` is False."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise DamagedFileError(f"{what} is not a number")
    try:
        number = float(value)
    except OverflowError as exc:  # an integer too big for a float
        raise DamagedFileError(f"{what} is too large") from exc
    if finite and not math.isfinite(number):
        raise DamagedFileError(f"{what} is not a finite number")
    return number


def as_str(value: Any, what: str, limit: int) -> str:
    if not isinstance(value, str) or len(value) > limit:
        raise DamagedFileError(f"{what} is not a string of at most {limit} characters")
    return value


def _kind(value: Any) -> str:
    return {list: "array", str: "string", bool: "boolean", type(None): "null"}.get(type(value), "number")


# -- showing text ---------------------------------------------------------------------------------------
def printable(value: object) -> str:
    """``value`` as text that is safe on a terminal and in one line: control and other non-printable
    characters (escape sequences, newlines, bidi overrides) and backslashes are shown escaped, as Python
    writes them in string literals (``\\x1b``, ``\\n``, ``\\u202e``, ``\\\\``)."""
    text = str(value)
    if text.isprintable() and "\\" not in text:
        return text
    return "".join(c if c.isprintable() and c != "\\" else c.encode("unicode_escape").decode("ascii") for c in text)
