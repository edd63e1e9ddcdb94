"""The flags of the flows' commands besides TrainConfig's, importable without Prefect or torch: flows/launch.py
answers ``--help`` and a flag mistake with them before the command's imports."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, Field, create_model
from pydantic_settings import SettingsConfigDict


class RetrainOptions(BaseModel):
    """One tick of scheduled retraining: warm-start from <save_folder>/release.json, train, and promote the
    new model only if its metric is not worse."""

    model_config = SettingsConfigDict(extra="forbid", cli_prog_name="python -m flows.retrain")

    metric: str = Field("accuracy", description="The evaluation metric that decides the promotion.")
    higher_is_better: bool = Field(True, description="Whether a higher metric is better (false: lower, e.g. loss).")
    run_prefix: str = Field(
        "retrain", description="A tick's run is named <run_prefix>-<scheduled time, UTC>-<flow-run id, 8 digits>."
    )


def sweep_options() -> type[BaseModel]:
    """The flags of ``python -m flows.sweep`` besides TrainConfig's: SweepConfig's fields but ``train`` (the rest of
    the command line is the trials' base run)."""
    from training.sweep.config import SweepConfig

    fields: dict[str, Any] = {
        name: (field.annotation, field) for name, field in SweepConfig.model_fields.items() if name != "train"
    }
    model = create_model(
        "SweepOptions",
        __config__=SettingsConfigDict(extra="forbid", cli_prog_name="python -m flows.sweep"),
        __doc__="A hyper-parameter sweep: trials of one run over a search space (docs/sweeps.md). Every flag of "
        "python -m flows.train sets the trials' base run.",
        **fields,
    )
    return model
