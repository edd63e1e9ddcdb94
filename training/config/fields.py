"""The checks of single ``TrainConfig`` fields (``Annotated[..., check]``): bounds, names and URLs, each error naming
the option, the value and the fix. Checks across fields are ``TrainConfig``'s own."""

from __future__ import annotations

import json
import math
import re
from typing import Any

from pydantic import AfterValidator

from checkpointing.io.protocols import check_store_url
from checkpointing.store import validate_name

MAX_SEED = 2**63 - 1  # torch.manual_seed and the sampler's arithmetic take signed 64-bit seeds
MAX_BATCH = 2**31 - 1
RECIPE_NAME = re.compile(r"^[A-Za-z][A-Za-z0-9_.-]{0,63}$")
METRIC_NAME = re.compile(r"^[A-Za-z][A-Za-z0-9_./-]{0,127}$")


def export_uri(value: str | None) -> str | None:
    """export_on_complete is a flow-run parameter that names a file to write: keep it to a weights file."""
    if value is None:
        return None
    if not value.lower().endswith((".pt", ".pth", ".safetensors")):
        raise ValueError(f"export_on_complete={value!r}: name a .pt, .pth or .safetensors file, e.g. s3://b/model.pt")
    return check_store_url(value, "export_on_complete")


def recipe_path(value: str) -> str:
    """A registered recipe name ('digits') or an import path ('package.module:ClassName'); whether this
    process may load it is decided later, against the worker's allow-list (training.recipe.loader)."""
    module, sep, attr = value.partition(":")
    if not sep and RECIPE_NAME.match(value):
        return value
    if not sep or not module or not attr or not all(p.isidentifier() for p in [*module.split("."), attr]):
        raise ValueError(
            f"recipe={value!r}: use a registered recipe name (e.g. 'digits') or an import path "
            f"'package.module:ClassName' (e.g. 'recipes.digits:DigitsRecipe')"
        )
    return value


def store_url(option: str):
    return AfterValidator(lambda v: v if v is None else check_store_url(v, option))


def valid_checkpoint_name(option: str):
    return AfterValidator(lambda v: v if v is None else validate_name(v, option))


def finite(option: str, low: float, high: float):
    def check(v: float) -> float:
        if not math.isfinite(v) or not low <= v <= high:
            raise ValueError(f"{option}={v!r}: use a number of seconds from {low:g} to {high:g}")
        return v

    return AfterValidator(check)


def optional_finite(option: str, low: float, high: float):
    def check(v: float | None) -> float | None:
        if v is not None and (not math.isfinite(v) or not low <= v <= high):
            raise ValueError(f"{option}={v!r}: use a number from {low:g} to {high:g}, or leave it unset")
        return v

    return AfterValidator(check)


def json_object(option: str):
    def check(v: dict[str, Any]) -> dict[str, Any]:
        try:
            text = json.dumps(v, allow_nan=False)
        except (TypeError, ValueError) as exc:
            raise ValueError(
                f"{option}: use a JSON object of strings, numbers, booleans, lists and objects ({exc})"
            ) from None
        if len(text) > 65536:
            raise ValueError(
                f"{option}: {len(text)} characters of JSON; keep it under 65536 (pass a file path instead)"
            )
        return v

    return AfterValidator(check)
