"""A module a hostile run would like the worker to import: importing it, or calling anything in it, leaves a
mark (the file named by $EVIL_MARKER), so a test can prove that neither happened."""

from __future__ import annotations

import os
from pathlib import Path


def _mark(what: str) -> None:
    if os.environ.get("EVIL_MARKER"):
        with open(os.environ["EVIL_MARKER"], "a") as f:
            f.write(f"{what}\n")


_mark("imported")


class NotARecipe:
    """Allowed by name in a test, but not a recipe: it must be refused before it is called."""

    def __init__(self, **kwargs):
        _mark("called")
        Path(kwargs.get("path", "/dev/null")).write_text("written by a class that is not a recipe")
