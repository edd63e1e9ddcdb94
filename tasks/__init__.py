"""Prefect tasks: one unit of training, a recipe's own loop, and evaluation. The retry policy lives here."""

from tasks.own_loop import loop_task, train_loop
from tasks.train_unit import evaluate, train_unit, unit_task

__all__ = ["evaluate", "loop_task", "train_loop", "train_unit", "unit_task"]
