"""Recipes that exist only to let tests observe the product from outside."""

from __future__ import annotations

import weakref

from recipes.synthetic import SyntheticRecipe

BUILT_MODELS: list[weakref.ref] = []


class TrackingRecipe(SyntheticRecipe):
    """Remembers (weakly) every model it builds, so a test can see that a failed attempt's is freed."""

    def build_model(self):
        model = super().build_model()
        BUILT_MODELS.append(weakref.ref(model))
        return model
