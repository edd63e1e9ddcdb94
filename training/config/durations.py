"""Lengths of training as users write them: ``'<n>ep'``, ``'<n>ba'``, ``'<n>sp'``, and Composer's habits.

Composer takes an integer for ``max_duration``, ``save_interval`` and ``eval_interval`` and means epochs
(``save_interval=1`` is its default), and its Time strings also count tokens (``'1000tok'``) and fractions of the
run (``'0.5dur'``). An integer (or a string of digits, as a flag or a TRAIN_* variable gives it) is read here as
``'<n>ep'``; tokens and fractions are refused with one line that names what to write instead, instead of the
generic "use '<n>ep'..." that does not say why a valid Composer value failed.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BeforeValidator

_DURATION = re.compile(r"^\s*(\d+)\s*(ep|ba|sp)\s*$", re.IGNORECASE)
_COMPOSER_ONLY = re.compile(r"^\s*[\d.]+\s*(tok|dur)\s*$", re.IGNORECASE)
MAX_COUNT = 10**12  # epochs, batches or samples: far past any real run, far below int64 overflow
_UNITS = "'<n>ep' (epochs), '<n>ba' (batches) or '<n>sp' (samples)"


@dataclass(frozen=True)
class Duration:
    """A length of training: ``value`` epochs (``'ep'``), optimizer steps (``'ba'``) or samples (``'sp'``).

    Samples are Composer's unit: a budget in samples does not drift when the global batch size changes."""

    value: int
    unit: Literal["ep", "ba", "sp"]

    @classmethod
    def parse(cls, text: str, option: str = "duration") -> Duration:
        """``text`` as a Duration, or ValueError naming ``option``. Each text is parsed once per process: the config's
        validation parses it, and the loop's reads (``TrainConfig.duration`` and the like, several a step) find it."""
        parsed = _parsed(str(text))
        if parsed is None:
            raise ValueError(_problem(str(text), option))
        return parsed

    def __str__(self) -> str:
        return f"{self.value}{self.unit}"


@functools.lru_cache(maxsize=256)  # a Duration is frozen: one value shared by every reader is safe
def _parsed(text: str) -> Duration | None:
    m = _DURATION.match(text)
    if not m or not 1 <= int(m.group(1)) <= MAX_COUNT:
        return None
    return Duration(int(m.group(1)), m.group(2).lower())  # type: ignore[arg-type]


def _problem(text: str, option: str) -> str:
    composer = _COMPOSER_ONLY.match(text)
    if composer and composer.group(1).lower() == "dur":
        return (
            f"{option}={text!r}: a fraction of the run ('dur', Composer's) is not read here; write it as {_UNITS}, "
            f"e.g. '5ep' for half of max_duration='10ep'"
        )
    if composer:
        return f"{option}={text!r}: tokens ('tok', Composer's) are not counted here; use {_UNITS}"
    return f"{option}={text!r}: use {_UNITS} with 1 <= n <= 10**12, e.g. '10ep', '500ba' or '100000sp'"


def _epochs_if_integer(value: Any) -> Any:
    """Composer's integer duration is epochs: 3 or '3' -> '3ep' (a bool is left for validation to refuse)."""
    if isinstance(value, int) and not isinstance(value, bool):
        return f"{value}ep"
    if isinstance(value, str) and value.strip().isdigit():
        return f"{value.strip()}ep"
    return value


def duration_validator(option: str) -> BeforeValidator:
    """The validator of a duration field: Composer's integer as epochs, then ``Duration.parse``'s check."""
    return BeforeValidator(lambda v: str(Duration.parse(_epochs_if_integer(v), option)))


def optional_duration_validator(option: str) -> BeforeValidator:
    return BeforeValidator(lambda v: v if v is None else str(Duration.parse(_epochs_if_integer(v), option)))
