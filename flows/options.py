"""The flags of the flows' commands besides TrainConfig's, importable without Prefect or torch: flows/launch.py
answers ``--help`` and a flag mistake with them before the command's imports."""

from __future__ import annotations

from pydantic import BaseModel, Field
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
