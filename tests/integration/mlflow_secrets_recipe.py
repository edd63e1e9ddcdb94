"""The recipe of tests/integration/test_mlflow_secrets.py, in a module of its own: the run's process imports it, and
importing the test module would import tests/conftest.py, which resets the allowed recipes of that process."""

from __future__ import annotations

from typing import Any

from tests.recipes_for_tests import PacedRecipe


class ServiceRecipe(PacedRecipe):
    """The paced test recipe with the arguments of a recipe that talks to a service (only carried, never used)."""

    def __init__(self, service: dict[str, Any], deploy: list[Any], azure: dict[str, Any], **kwargs: Any):
        super().__init__(**kwargs)
