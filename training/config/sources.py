"""TrainConfig's sources, each bounded: flags, TRAIN_* variables and a config file.

pydantic-settings decodes a dict or list field's flag or variable with a plain ``json.loads`` (100000 nested
brackets raise RecursionError, 5000 digits a ValueError, a repeated key wins silently), and its YAML/TOML sources
read a file whole. These sources take the same values through training/config/text.py instead, so a
worker's environment or a person's flags get one ConfigError line, and the file is read once.
"""

from __future__ import annotations

import json
import re
import typing
from collections.abc import Mapping
from typing import Any, TypeVar

from pydantic.fields import FieldInfo
from pydantic_settings import BaseSettings, CliSettingsSource, EnvSettingsSource, InitSettingsSource

from training.config.file import read_config_file
from training.config.text import parse_json

T = TypeVar("T")


class BoundedEnvSource(EnvSettingsSource):
    """TRAIN_* variables; a dict or list field's JSON (TRAIN_RECIPE_ARGS, TRAIN_STORAGE_OPTIONS) within bounds."""

    def decode_complex_value(self, field_name: str, field: FieldInfo, value: Any) -> Any:
        return parse_json(value, f"{self.env_prefix}{field_name}".upper())


class BoundedCliSource(CliSettingsSource[T]):
    """Flags; the JSON of a dict or list field (``--recipe_args '{...}'``) within bounds once merged. Its ``--help``
    names a dict or list flag's value ``JSON`` and shows a default made by a factory as the JSON to type
    (pydantic-settings wrote ``dict[str,Any]`` and ``(default factory: TrainConfig.<lambda>)``)."""

    def decode_complex_value(self, field_name: str, field: FieldInfo, value: Any) -> Any:
        return parse_json(value, f"--{field_name}")

    def _metavar_format_recurse(self, obj: Any) -> str:
        while typing.get_origin(obj) is typing.Annotated:
            obj = typing.get_args(obj)[0]
        if typing.get_origin(obj) in (dict, list) or obj in (dict, list):
            return "JSON"
        return str(super()._metavar_format_recurse(obj))

    def _help_format(self, field_name: str, field_info: FieldInfo, *args: Any, **kwargs: Any) -> str:
        text = str(super()._help_format(field_name, field_info, *args, **kwargs))
        factory = field_info.default_factory
        if factory is None or getattr(field_info, "default_factory_takes_validated_data", False):
            return text
        default = json.dumps(factory()).replace("%", "%%")  # type: ignore[call-arg]  # argparse formats help with %
        return _FACTORY.sub(lambda _: f"(default: {default})", text)


_FACTORY = re.compile(r"\(default factory: [^()]*\)")


def check_flag_json(argv: list[str], fields: Mapping[str, FieldInfo]) -> None:
    """Bounds the JSON given to a dict or list flag before pydantic-settings parses it (it merges repeated flags
    with its own ``json.loads`` before any source sees the value)."""
    json_fields = {name for name, field in fields.items() if typing.get_origin(field.annotation) in (dict, list)}
    for i, arg in enumerate(argv):
        flag, inline, value = arg.partition("=")
        if not flag.startswith("--") or flag[2:].replace("-", "_") not in json_fields:
            continue
        text = value if inline else (argv[i + 1] if i + 1 < len(argv) else "")
        if text.lstrip()[:1] in ("{", "["):
            parse_json(text, flag)


def file_source(settings_cls: type[BaseSettings], path: str) -> InitSettingsSource:
    """The config file's checked values, handed to pydantic-settings as data (it never opens the file)."""
    return InitSettingsSource(settings_cls, init_kwargs=read_config_file(path, settings_cls.model_fields))
