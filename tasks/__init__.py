"""Prefect tasks: one unit of training (or a recipe's own loop), and evaluation. The retry policy lives here."""

from tasks.train_unit import evaluate, train_unit, unit_outcome, unit_task

__all__ = ["evaluate", "train_unit", "unit_outcome", "unit_task"]
