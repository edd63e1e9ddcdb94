"""Hyper-parameter sweeps below Prefect: the search space, the sweep's settings, the study its ledger folds into,
and the schedulers (FIFO, ASHA, PBT) that decide from the study alone. Pure code: no Prefect, no I/O, no torch.

The face: ``from training.sweep import SweepConfig, Study, plan, unfinished_segments, Job, Plan``.
"""

from training.sweep.config import SweepConfig, checkpoint_key, spec_differences
from training.sweep.schedulers import Job, Plan, plan, rungs, trial_name, unfinished_segments
from training.sweep.space import apply, check_space, perturb, trial_parameters
from training.sweep.study import Event, Study, Trial

__all__ = [
    "Event",
    "Job",
    "Plan",
    "Study",
    "SweepConfig",
    "Trial",
    "apply",
    "check_space",
    "checkpoint_key",
    "perturb",
    "plan",
    "rungs",
    "spec_differences",
    "trial_name",
    "trial_parameters",
    "unfinished_segments",
]
