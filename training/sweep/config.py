"""``SweepConfig``: one sweep's settings, validated once, and the ``TrainConfig`` of each of its trials' segments.

A trial is an ordinary run under ``<train.save_folder>/<sweep_name>``; a segment of it is one launch up to a
number of units (a unit = ``train.save_interval``), so the budget ``train.max_duration`` must be a whole number of
units in the same unit of length. ``spec()`` is what a relaunch must repeat: the flow refuses to continue a sweep
whose spec changed.
"""

from __future__ import annotations

import importlib.util
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from checkpointing.manifest import is_valid_name, validate_name
from training.config import ConfigError, Duration, TrainConfig, describe_error
from training.config.trust import location_within
from training.sweep.space import MAX_TRIALS, Space, apply, check_space, count_trials

_IDENTITY = ("recipe", "recipe_args", "seed", "shuffle", "save_interval", "max_duration", "global_batch_size")
_NOT_SPEC = {"train", "max_concurrent_trials", "trial_retries"}


class SweepConfig(BaseModel):
    """A hyper-parameter sweep: trials of one base run over a search space, scheduled by FIFO, ASHA or PBT."""

    model_config = ConfigDict(extra="forbid", validate_default=True)

    train: TrainConfig = Field(
        description="The trials' base run: every trial is this run with its parameters set; save_folder holds the "
        "sweep's folder, max_duration is each trial's full budget, save_interval is one unit."
    )
    sweep_name: str = Field(description="Name of the sweep; its trials live in <train.save_folder>/<sweep_name>/.")
    space: dict[str, Any] = Field(
        description="The search space: {'recipe_args.<name>' or an option: {'grid'|'choice'|'uniform'|'loguniform'|"
        "'randint': [values]}} (Ray Tune's grid_search, choice, uniform, loguniform, randint)."
    )
    num_samples: int = Field(
        1,
        ge=1,
        le=MAX_TRIALS,
        description="Trials per grid combination (Ray Tune's name); with search_alg='optuna', the number of trials.",
    )
    max_concurrent_trials: int = Field(2, ge=1, le=64, description="Trials that train at once (Ray Tune's name).")
    search_alg: Literal["random", "optuna"] = Field(
        "random",
        description="random: the grid's combinations with the other values drawn from a seeded generator; "
        "optuna: each new trial's values suggested by Optuna's TPE sampler from the results so far (pip install "
        "'resumable-train[optuna]'; no grid, no pbt).",
    )
    search_seed: int = Field(
        0,
        ge=0,
        le=2**63 - 1,
        description="Seed of the search's draws and of PBT's choices (train.seed is the trials' own).",
    )
    scheduler: Literal["fifo", "asha", "pbt"] = Field(
        "fifo",
        description="fifo: every trial runs its whole budget; asha: successive halving at rungs of units; "
        "pbt: population based training, synchronous generations.",
    )
    metric: str = Field(
        "eval_loss",
        min_length=1,
        max_length=200,
        description="The unit metric the scheduler compares: eval_<name> for what the recipe's evaluate() returns "
        "(trials evaluate after every unit unless train.eval_interval says otherwise), or train_loss.",
    )
    mode: Literal["min", "max"] = Field(
        "min", description="Whether a lower ('min') or higher ('max') metric is better."
    )
    grace_period: int = Field(1, ge=1, le=10**6, description="ASHA: units before the first rung.")
    reduction_factor: int = Field(2, ge=2, le=100, description="ASHA: 1/reduction_factor of a rung goes on.")
    perturbation_interval: int = Field(1, ge=1, le=10**6, description="PBT: units between exploits.")
    quantile_fraction: float = Field(
        0.25, gt=0, le=0.5, description="PBT: the bottom fraction that exploits the top fraction."
    )
    resample_probability: float = Field(
        0.25, ge=0, le=1, description="PBT: chance that explore draws a value anew instead of perturbing it."
    )
    trial_retries: int = Field(
        2, ge=0, le=100, description="Times a dead trial process is started again; each start resumes the trial."
    )

    def __init__(self, /, **values: Any) -> None:
        """Every problem as one ConfigError (a line per field), as TrainConfig's edge gives it."""
        if "space" in values:  # its problems name the key: one line, not wrapped in pydantic's
            values["space"] = check_space(values["space"])
        try:
            super().__init__(**values)
        except ValidationError as exc:
            raise ConfigError(describe_error(exc)) from None

    @field_validator("sweep_name")
    @classmethod
    def _name(cls, v: str) -> str:
        return validate_name(v, "sweep_name")

    @field_validator("space", mode="before")
    @classmethod
    def _space(cls, v: Any) -> Space:
        return check_space(v)

    @model_validator(mode="after")
    def _cross_checks(self) -> SweepConfig:
        self.units_total()
        count = count_trials(self.space, self.num_samples)
        if count > MAX_TRIALS:
            raise ValueError(f"num_samples={self.num_samples}: the space makes {count} trials; keep it <= {MAX_TRIALS}")
        if self.train.resume_from:
            raise ValueError(
                f"train.resume_from={self.train.resume_from!r} would roll every trial back: leave it out of a sweep"
            )
        if self.train.num_checkpoints_to_keep != -1:
            raise ValueError(
                f"train.num_checkpoints_to_keep={self.train.num_checkpoints_to_keep}: a sweep keeps every unit "
                f"checkpoint (its schedulers, PBT's copies and its best checkpoint read them, and each launch "
                f"verifies them in the store); leave it at -1"
            )
        if self.search_alg == "optuna":
            self._check_optuna()
        return self

    def _check_optuna(self) -> None:
        """search_alg='optuna' needs the package, a space without grid and a scheduler that starts trials one by one."""
        grids = sorted(key for key, spec in self.space.items() if "grid" in spec)
        if grids:
            raise ValueError(
                f"search_alg='optuna' with a grid at {', '.join(grids)}: Optuna's sampler suggests every value "
                f"itself; give {grids[0]} {{'choice': {self.space[grids[0]]['grid']!r}}}, or keep the grid with "
                f"search_alg='random'"
            )
        if self.scheduler == "pbt":
            raise ValueError(
                "search_alg='optuna' with scheduler='pbt': PBT starts its whole population at once and explores by "
                "perturbing, so there is nothing to suggest; use scheduler='fifo' or 'asha', or search_alg='random'"
            )
        if importlib.util.find_spec("optuna") is None:
            raise ValueError(
                "search_alg='optuna': the optuna package is not installed; pip install 'resumable-train[optuna]', "
                "or use search_alg='random'"
            )

    def units_total(self) -> int:
        """``train.max_duration`` in units of ``train.save_interval``."""
        total, unit = self.train.duration, self.train.interval
        if total.unit != unit.unit or total.value % unit.value:
            fix = (
                f"save_interval='1{total.unit}'"
                if total.unit != unit.unit
                else f"max_duration='{unit.value * -(-total.value // unit.value)}{unit.unit}'"
            )
            raise ConfigError(
                f"train.max_duration={str(total)!r} with train.save_interval={str(unit)!r}: a sweep counts its budget "
                f"in units of save_interval, so give both in the same unit ('ep', 'ba' or 'sp') with max_duration a "
                f"multiple of save_interval, e.g. {fix}"
            )
        return total.value // unit.value

    def segment_duration(self, target_units: int) -> str:
        """The ``max_duration`` of a segment that trains up to ``target_units``."""
        unit = self.train.interval
        return str(Duration(target_units * unit.value, unit.unit))

    @property
    def sweep_folder(self) -> str:
        """Where the trials' runs and the ledger (``sweep/``) live."""
        return f"{self.train.save_folder.rstrip('/')}/{self.sweep_name}"

    def trial_config(
        self, params: dict[str, Any], run_name: str, target_units: int, load_path: str | None = None
    ) -> TrainConfig:
        """The base run with ``params`` set, as the run ``run_name`` of the sweep, trained up to ``target_units``."""
        if not 1 <= target_units <= self.units_total():
            raise ConfigError(f"target_units={target_units}: a segment trains 1 to {self.units_total()} units")
        # params and load_path come back from the ledger, a file in the store: only what the space searches may be set,
        # and a run may start only from a copy the sweep made (never another recipe, folder or file)
        unknown = sorted(str(k)[:100] for k in params if k not in self.space)
        if unknown:
            raise ConfigError(
                f"the trial {run_name}'s parameters name {unknown}, which the space does not search: the sweep's ledger "
                f"was written by another search or altered; start a new sweep_name"
            )
        if (
            load_path is not None
            and checkpoint_key(load_path, self.sweep_folder, [f"sweep/exploits/{run_name}"]) is None
        ):
            raise ConfigError(
                f"the trial {run_name} would start from outside its sweep's copies ({str(load_path)[:300]!r} is not "
                f"{self.sweep_folder}/sweep/exploits/{run_name}/checkpoints/<name>): the ledger was altered; start a "
                f"new sweep_name"
            )
        fields = apply(self.train.model_dump(), params)
        fields.update(
            storage_options=self.train.storage_options,  # excluded from dumps: never a flow-run parameter
            save_folder=self.sweep_folder,
            run_name=run_name,
            max_duration=self.segment_duration(target_units),
        )
        if fields.get("eval_interval") is None:  # the schedulers compare units: each one ends with an evaluation
            fields["eval_each_unit"] = True
        if load_path is not None:
            fields.update(load_path=load_path, load_weights_only=False)
        try:
            return TrainConfig.model_validate(fields)
        except ValidationError as exc:
            raise ConfigError(f"the trial {run_name} with {params}: {describe_error(exc)}") from None

    def spec(self) -> dict[str, Any]:
        """What a relaunch must repeat (JSON): the search and scheduler, and the base run's identity."""
        spec = self.model_dump(mode="json", exclude=_NOT_SPEC)
        spec["train"] = {key: getattr(self.train, key) for key in _IDENTITY}
        return spec


def checkpoint_key(location: Any, folder: str, runs: list[str]) -> str | None:
    """``<run>/checkpoints/<name>`` when ``location`` is exactly that checkpoint folder under ``folder`` for one of
    ``runs`` (compared after normalisation: no '..', no empty segments); None when it is anywhere else."""
    if not isinstance(location, str) or len(location) > 4096:
        return None
    name = location.rstrip("/").rsplit("/", 1)[-1]
    if not is_valid_name(name):
        return None
    for run in runs:
        key = f"{run}/checkpoints/{name}"
        expected = f"{folder.rstrip('/')}/{key}"
        if location_within(location, expected) and location_within(expected, location):
            return key
    return None


def spec_differences(recorded: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """The fields whose values differ between two specs (``train.<field>`` for the base run's), sorted."""
    differ = [k for k in sorted(set(recorded) | set(current)) if k != "train" and recorded.get(k) != current.get(k)]
    old, new = recorded.get("train") or {}, current.get("train") or {}
    differ += [f"train.{k}" for k in sorted(set(old) | set(new)) if old.get(k) != new.get(k)]
    return differ
