"""Configuration text from outside the process, parsed within bounds: config files, JSON in TRAIN_* variables
and flags.

Whoever writes a config file or a worker's environment does not get to spend its memory or stop every launch with
a traceback: a 600-byte YAML alias bomb grew to 5.9 GB, a 5000-digit integer and 100000 nested brackets raised
from inside the parsers, and a duplicated key silently overrode the first. So the size is checked before reading,
YAML anchors and aliases are refused (nothing expands), nesting and node counts are limited while parsing, numbers
are limited in characters before they are converted, and a key set twice is refused naming the key and its line.
Every problem is one ``ConfigError`` line that names the option and never quotes the text back at length.
"""

from __future__ import annotations

import json
import os
import re
import stat
import tomllib
from collections.abc import Hashable, Iterable, Mapping
from typing import Any

import yaml

from training.exceptions import ConfigError

MAX_FILE_BYTES = 256 * 1024  # a config file of every field with long descriptions is a few KiB
MAX_JSON_CHARS = 65536  # the bound recipe_args already has once parsed
MAX_DEPTH = 32  # mappings and lists inside each other
MAX_NODES = 20_000  # values of every kind, in one file or variable
MAX_NUMBER_CHARS = 40  # an int64 has 19 digits; float and date literals stay well under this

# Outside strings and comments: brackets, the dots of dotted keys, and literals that start with a digit (numbers,
# dates).
_TOKEN = re.compile(r"[#\"'\[\]{}.=]|(?<![\w.+-])[+-]?\d[\w.+:-]*")


def short(value: Any, limit: int = 120) -> str:
    """``repr(value)``, cut to ``limit`` characters with the full length said."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def check_keys(keys: Iterable[Any], fields: Mapping[str, Any], where: str) -> None:
    """Refuses any key that is not exactly a field name, in one line naming the first and counting the rest.

    pydantic-settings would match 'Storage_Options' to storage_options, and take '_env_prefix', '_env_file',
    '_secrets_dir', '_cli_parse_args', ... as instructions to itself about where to read settings from."""
    unknown = [key for key in keys if key not in fields]
    if not unknown:
        return
    key = unknown[0]
    exact = {name.lower(): name for name in fields}.get(str(key).lower().replace("-", "_"))
    if isinstance(key, str) and key.startswith("_"):
        reason = "is not a field: keys starting with '_' are pydantic-settings' own options, never read here"
    elif exact:
        reason = f"is not a field: field names are matched exactly, write {exact!r}"
    else:
        reason = "is not a field (python -m flows.train --help lists them)"
    more = f" (and {len(unknown) - 1} more unknown key{'s' if len(unknown) > 2 else ''})" if len(unknown) > 1 else ""
    raise ConfigError(f"{where} key {short(key, 60)} {reason}{more}")


def read_bounded(path: str, option: str, limit: int = MAX_FILE_BYTES) -> str:
    """The UTF-8 text of a regular file of at most ``limit`` bytes; its size is checked before anything is read,
    and opening never blocks (a FIFO put in its place is refused, not waited on)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError as exc:
        raise ConfigError(f"{option}: cannot open it ({exc.strerror})") from None
    info = os.fstat(fd)
    too_big = f"{info.st_size} bytes; config files are read up to {limit} bytes" if info.st_size > limit else None
    if problem := too_big if stat.S_ISREG(info.st_mode) else "not a regular file":
        os.close(fd)
        raise ConfigError(f"{option}: {problem}")
    with os.fdopen(fd, "rb") as f:
        data = f.read(limit + 1)
    if len(data) > limit:
        raise ConfigError(f"{option}: grew past {limit} bytes while being read")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{option}: not UTF-8 text (byte {exc.start})") from None


def parse_yaml(text: str, option: str) -> Any:
    """YAML's safe subset without anchors or aliases, within the depth, node and number bounds."""
    loader = None
    try:
        loader = _BoundedLoader(text, option)  # its reader refuses control characters here
        return loader.get_single_data()
    except yaml.MarkedYAMLError as exc:
        where = f" (line {exc.problem_mark.line + 1}, column {exc.problem_mark.column + 1})" if exc.problem_mark else ""
        raise ConfigError(
            f"{option}: not valid YAML: {_clip(exc.problem or exc.context or 'unreadable')}{where}"
        ) from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{option}: not valid YAML: {_clip(str(exc).splitlines()[0])}") from None
    finally:
        if loader is not None:
            loader.dispose()


def parse_toml(text: str, option: str) -> dict[str, Any]:
    """TOML, with brackets and numbers bounded before tomllib sees them and the tree bounded after."""
    scan_bounds(text, option)
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{option}: {_toml_problem(str(exc), text)}") from None
    check_tree(data, option)
    return data


def parse_json(text: str, option: str) -> Any:
    """JSON of at most MAX_JSON_CHARS characters within the bounds; an object may not repeat a key."""
    if len(text) > MAX_JSON_CHARS:
        raise ConfigError(f"{option}: {len(text)} characters of JSON; keep it under {MAX_JSON_CHARS}")
    scan_bounds(text, option)
    try:
        data = json.loads(text, object_pairs_hook=lambda pairs: _unique(pairs, option))
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{option}: not valid JSON: {exc.msg} (line {exc.lineno}, column {exc.colno})") from None
    check_tree(data, option)
    return data


def scan_bounds(text: str, option: str) -> None:
    """Refuses brackets nested deeper than MAX_DEPTH, dotted keys of more than MAX_DEPTH parts and literals that
    start with a digit and run longer than MAX_NUMBER_CHARS, looking outside strings and comments only (TOML's and
    JSON's lexical rules), without parsing: both parsers recurse per bracket and convert any number of digits, and
    tomllib keeps every prefix of a dotted key (100000 parts took gigabytes)."""
    depth, dots, pos, end = 0, 0, 0, len(text)
    while (m := _TOKEN.search(text, pos)) is not None:
        token, pos = m.group(), m.end()
        if token == "#":
            newline = text.find("\n", pos)
            pos = end if newline < 0 else newline
        elif token in ('"', "'"):
            pos = _string_end(text, m.start())
        elif token == ".":
            dots += 1
        elif token in ("=", "[", "]", "{", "}"):
            dots = 0
            depth += 1 if token in "[{" else -1 if token in "]}" else 0
        elif len(token) > MAX_NUMBER_CHARS:
            raise ConfigError(
                f"{option}: a number of {len(token)} characters ({_at(text, m.start())}); numbers may have at "
                f"most {MAX_NUMBER_CHARS} (write a longer value as a string)"
            )
        if depth > MAX_DEPTH or dots >= MAX_DEPTH:
            raise ConfigError(f"{option}: nested more than {MAX_DEPTH} levels deep ({_at(text, m.start())})")


def check_tree(data: Any, option: str) -> None:
    """Depth, node count and integer size of a parsed value, walked without recursion."""
    stack, nodes = [(data, 1)], 0
    while stack:
        node, depth = stack.pop()
        nodes += 1
        if nodes > MAX_NODES:
            raise ConfigError(f"{option}: more than {MAX_NODES} values; config is small, data belongs in files")
        if isinstance(node, int) and not isinstance(node, bool) and abs(node) >= 10**MAX_NUMBER_CHARS:
            raise ConfigError(f"{option}: an integer of more than {MAX_NUMBER_CHARS} digits")
        children = list(node.values()) if isinstance(node, dict) else node if isinstance(node, list) else []
        if children and depth >= MAX_DEPTH:
            raise ConfigError(f"{option}: nested more than {MAX_DEPTH} levels deep")
        stack.extend((child, depth + 1) for child in children)


class _BoundedLoader(yaml.SafeLoader):
    """SafeLoader that refuses anchors and aliases (an alias bomb expands nothing), counts nodes and depth while
    composing (before its recursion goes deep), bounds integer literals and refuses a key set twice."""

    def __init__(self, text: str, option: str):
        super().__init__(text)
        self.option, self.depth, self.nodes = option, 0, 0

    def compose_node(self, parent: Any, index: Any) -> Any:
        event = self.peek_event()
        if isinstance(event, yaml.AliasEvent) or getattr(event, "anchor", None) is not None:
            raise ConfigError(
                f"{self.option}: YAML anchors and aliases (&, *) are not read ({_mark(event)}); write the values out"
            )
        self.nodes += 1
        if self.nodes > MAX_NODES:
            raise ConfigError(f"{self.option}: more than {MAX_NODES} values; config is small, data belongs in files")
        if self.depth >= MAX_DEPTH:
            raise ConfigError(f"{self.option}: nested more than {MAX_DEPTH} levels deep ({_mark(event)})")
        self.depth += 1
        try:
            return super().compose_node(parent, index)
        finally:
            self.depth -= 1

    def construct_mapping(self, node: Any, deep: bool = False) -> dict[Any, Any]:
        self.flatten_mapping(node)
        mapping: dict[Any, Any] = {}
        for key_node, value_node in node.value:
            key = self.construct_object(key_node, deep=deep)
            if not isinstance(key, Hashable):
                raise ConfigError(f"{self.option}: a mapping or list used as a key ({_mark(key_node)})")
            if key in mapping:
                raise ConfigError(f"{self.option}: key {short(key, 60)} is set twice ({_mark(key_node)})")
            mapping[key] = self.construct_object(value_node, deep=deep)
        return mapping

    def construct_bounded_int(self, node: Any) -> int:
        if len(node.value) > MAX_NUMBER_CHARS:
            raise ConfigError(
                f"{self.option}: a number of {len(node.value)} characters ({_mark(node)}); numbers may have at most "
                f"{MAX_NUMBER_CHARS} (write a longer value as a string)"
            )
        return self.construct_yaml_int(node)


_BoundedLoader.add_constructor("tag:yaml.org,2002:int", _BoundedLoader.construct_bounded_int)


def _unique(pairs: list[tuple[str, Any]], option: str) -> dict[str, Any]:
    mapping: dict[str, Any] = {}
    for key, value in pairs:
        if key in mapping:
            raise ConfigError(f"{option}: key {short(key, 60)} is set twice")
        mapping[key] = value
    return mapping


def _string_end(text: str, start: int) -> int:
    """Where the TOML/JSON string opening at ``start`` ends (past its closing quotes; the text's end if unclosed)."""
    quote = text[start] * 3 if text.startswith(text[start] * 3, start) else text[start]
    pos = start + len(quote)
    while (close := text.find(quote, pos)) >= 0:
        backslashes = len(text[pos:close]) - len(text[pos:close].rstrip("\\"))
        if quote[0] == "'" or backslashes % 2 == 0:
            return close + len(quote)
        pos = close + 1
    return len(text)


def _toml_problem(message: str, text: str) -> str:
    """tomllib's message, naming the key when it is a key set twice ("Cannot overwrite a value (at line 3, ...)")."""
    m = re.search(r"\(at line (\d+), column \d+\)", message)
    if m and message.startswith(("Cannot overwrite", "Cannot declare")):
        line = int(m.group(1))
        lines = text.split("\n")
        key = lines[line - 1].split("=", 1)[0].strip(" \t[]") if line <= len(lines) else "?"
        return f"key {short(key, 60)} is set twice (line {line})"
    return f"not valid TOML ({_clip(message)})"


def _at(text: str, index: int) -> str:
    line = text.count("\n", 0, index) + 1
    return f"line {line}, column {index - text.rfind(chr(10), 0, index)}"


def _mark(item: Any) -> str:
    mark = item.start_mark
    return f"line {mark.line + 1}, column {mark.column + 1}"


def _clip(text: str, limit: int = 160) -> str:
    return text if len(text) <= limit else f"{text[:limit]}..."
