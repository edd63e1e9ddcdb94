"""TrainConfig: the one settings tree, validated once at the edge.

Flags (``--run_name x``), environment variables (``TRAIN_RUN_NAME=x``) and an optional YAML or TOML
file (``--config_file run.toml``) all fill this one class; precedence is flags > environment > file
> defaults. Everything below the edge takes the typed object.
"""

from __future__ import annotations

import contextvars
import hashlib
import json
import os
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, Field, ValidationError, field_validator, model_validator
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict, SettingsError

from checkpointing.store import validate_name
from training.config.durations import MAX_COUNT, Duration, duration_validator, optional_duration_validator
from training.config.fields import (
    MAX_BATCH,
    MAX_SEED,
    METRIC_NAME,
    export_uri,
    finite,
    json_object,
    optional_finite,
    recipe_path,
    store_url,
    valid_checkpoint_name,
)
from training.config.save_folder import format_save_folder
from training.config.sources import BoundedCliSource, BoundedEnvSource, check_flag_json, file_source
from training.config.text import ConfigError, check_keys, short

_config_file: contextvars.ContextVar[str | None] = contextvars.ContextVar("config_file", default=None)
_flags: contextvars.ContextVar[PydanticBaseSettingsSource | None] = contextvars.ContextVar("flags", default=None)


class TrainConfig(BaseSettings):
    """Resumable training of a PyTorch recipe, one checkpointed unit at a time."""

    model_config = SettingsConfigDict(
        env_prefix="TRAIN_",
        extra="forbid",
        validate_default=True,
        cli_prog_name="python -m flows.train",
        cli_exit_on_error=False,
        cli_hide_none_type=True,
        cli_avoid_json=False,
    )

    run_name: Annotated[str, AfterValidator(validate_name)] = Field(
        "default", description="Name of the run; its checkpoints live in <save_folder>/<run_name>/."
    )
    save_folder: Annotated[str, store_url("save_folder")] = Field(
        "runs",
        description="Where runs are stored: a local path or any fsspec URL (file://, s3://, memory://; gs:// and "
        "az:// with the gcs / azure extras). Composer's '{run_name}' is substituted (a run already gets its own "
        "folder <save_folder>/<run_name>); its other format variables are refused, naming what to write instead.",
    )
    recipe: Annotated[str, AfterValidator(recipe_path)] = Field(
        "recipes.digits:DigitsRecipe",
        description="The recipe to train: a registered name ('digits') or an import path 'module:Class' that "
        "the worker allows (entry points 'resumable_train.recipes' or TRAIN_ALLOWED_RECIPES).",
    )
    recipe_args: Annotated[dict[str, Any], json_object("recipe_args")] = Field(
        default_factory=dict, description="Keyword arguments for the recipe's constructor (JSON on the CLI)."
    )
    max_duration: Annotated[str, duration_validator("max_duration")] = Field(
        "5ep", description="Total length of training: '<n>ep', '<n>ba' or '<n>sp' (samples); an integer is epochs."
    )
    save_interval: Annotated[str, duration_validator("save_interval")] = Field(
        "1ep",
        description="Length of one unit (one Prefect task, one checkpoint): '<n>ep', '<n>ba' or '<n>sp'; an integer "
        "is epochs (Composer's save_interval=1).",
    )
    save_overwrite: bool = Field(
        False,
        description="Composer's option. false: a launch never writes over a run's checkpoints; with autoresume=false "
        "a run that has checkpoints is refused. true, with autoresume=false: a new launch starts the run over, "
        "deleting its checkpoints before it trains (a restart of that launch continues what it trained). With "
        "autoresume=true it changes nothing (a run that continues never writes a checkpoint name twice), and says so "
        "when the run has checkpoints.",
    )
    save_network_weights: bool = Field(
        False,
        description="MindSpore's checkpoint_network: with every checkpoint also save the model's weights alone, as "
        "weights.pt in the checkpoint's folder (a plain state_dict: torch.load(f, weights_only=True)), listed and "
        "verified by its manifest and removed with it by retention.",
    )
    global_batch_size: int = Field(
        64, ge=1, le=MAX_BATCH, description="Samples per optimizer step, summed over all processes."
    )
    seed: int = Field(42, ge=0, le=MAX_SEED, description="Seed for initialization, data order and every RNG.")
    shuffle: bool = Field(True, description="Visit samples in a seeded random order each epoch (else in id order).")
    autoresume: bool = Field(
        True,
        description="Continue the run's latest good checkpoint. If false, a run that already has "
        "checkpoints is refused rather than overwritten.",
    )
    load_path: Annotated[str | None, store_url("load_path")] = Field(
        None,
        description="Where to start when the run has no checkpoint yet (ignored, with a warning, once it has): a "
        "checkpoint or run folder URI, or a weights file or folder URI (a state_dict, an export, .safetensors, a "
        "Composer, Lightning, MindSpore or Ray checkpoint, a Hugging Face folder). With load_weights_only=false a full "
        "checkpoint's optimizer state and progress are carried over; the new run's optimizer hyper-parameters (lr, "
        "weight decay, momentum, betas: as the recipe builds them) win over the checkpoint's, its LR schedule "
        "continues at the carried step, and one line says which values changed.",
    )
    resume_from: Annotated[str | None, valid_checkpoint_name("resume_from")] = Field(
        None,
        description="Roll the run back: continue it from this checkpoint of the run (a name as "
        "'python -m checkpointing ls' shows it); later checkpoints stop being candidates (recorded in the run "
        "under rollbacks/, never deleted). Applied once: a relaunch or restart with the same value continues "
        "from the newest checkpoint.",
    )
    load_weights_only: bool = Field(
        False,
        description="With load_path: take only the model weights (fine-tuning), not optimizer or progress. "
        "Implied when load_path is a weights file.",
    )
    load_strict: bool = Field(
        True,
        description="With load_path: the weights must match the model key for key and shape for shape; false "
        "loads the keys that match and logs how many were skipped or missing.",
    )
    load_ignore_keys: list[str] = Field(
        default_factory=list,
        description="With load_path: glob patterns (fnmatch) of weight keys to leave out, e.g. '[\"fc.*\"]'; "
        "model keys they match keep their fresh initialization.",
    )
    ignore_data_skip: bool = Field(
        False, description="On resume, restart the current epoch's data from its first sample."
    )
    data_skip_steps: int | None = Field(
        None,
        ge=0,
        le=MAX_COUNT,
        description="On resume, skip this many batches of the new size from the start of the "
        "epoch instead of the saved position (for a changed dataset).",
    )
    num_checkpoints_to_keep: int = Field(
        -1, le=10**6, description="How many checkpoints to keep (-1 keeps all); the one 'latest' names is always kept."
    )
    checkpoint_score_attribute: str | None = Field(
        None,
        description="With num_checkpoints_to_keep: keep the best checkpoints by this unit metric (e.g. 'loss') "
        "instead of the newest; the one 'latest' names is always kept too.",
    )
    checkpoint_score_order: Literal["max", "min"] = Field(
        "max", description="Whether a higher ('max') or lower ('min') checkpoint_score_attribute is better."
    )
    storage_options: dict[str, Any] = Field(
        default_factory=dict,
        repr=False,
        exclude=True,
        description='fsspec options for save_folder, e.g. {"client_kwargs": {"endpoint_url": "http://..."}}. '
        "Put credentials in the standard AWS variables or profile; these options are never logged "
        "and never sent to the Prefect API as a parameter.",
    )
    snapshot_interval: Annotated[str | None, optional_duration_validator("snapshot_interval")] = Field(
        None,
        description="Take a snapshot every '<n>ba', '<n>sp' or '<n>ep' inside a unit as well as at its end: the state "
        "is copied into reused host buffers (the only stall) and committed in the background; the newest one stays "
        "in this machine's shared memory, so a relaunch here after a hard kill loses at most that interval ('1ba': "
        "one step). The store gets the newest snapshot each time its previous upload is done. Default: at unit ends "
        "only.",
    )
    host_memory_tier: bool = Field(
        True,
        description="Keep the run's newest snapshots in this machine's shared memory (/dev/shm, private to your "
        "user; TRAIN_HOST_TIER_DIR in the worker's environment picks another folder), where a relaunch on the same "
        "machine resumes from them when they are newer than the store's; removed when the run completes. false: "
        "snapshots are held in private memory only.",
    )
    async_upload: bool | None = Field(
        None,
        description="Upload checkpoints in the background while the next unit trains. Default: on for "
        "remote stores (s3://, ...), off for local folders and memory://.",
    )
    nproc_per_node: int = Field(
        1,
        ge=1,
        le=1024,
        description="Processes per machine for each unit. Above 1, each unit runs under torchrun with "
        "DDP (gloo on CPU, nccl on CUDA).",
    )
    nnodes: int = Field(
        1,
        ge=1,
        le=100_000,
        description="Machines that train each unit together. Above 1, the unit starts the other machines' processes "
        "itself, as runs of the 'node' deployment on the same work pool; where they meet is the product's choice "
        "(never a parameter's).",
    )
    num_workers: int = Field(0, ge=0, le=256, description="DataLoader worker processes.")
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="Where to train: auto picks CUDA when present.")
    unit_retries: int = Field(2, ge=0, le=100, description="Prefect retries of a failed unit (each one resumes).")
    max_restarts: int = Field(
        3,
        ge=0,
        le=1000,
        description="Restarts of a deployment's flow run (after a crash or a preemption) after which "
        "the run ends Failed instead of resuming again.",
    )
    retry_delay_seconds: Annotated[float, finite("retry_delay_seconds", 0, 3600)] = Field(
        1.0, description="Base delay of the exponential backoff between unit retries."
    )
    store_retry_attempts: int = Field(
        6,
        ge=1,
        le=100,
        description="The fewest attempts of an object-store call on transient faults, however long they take (a "
        "floor; store_retry_max_seconds decides how long a call keeps trying).",
    )
    store_retry_max_seconds: Annotated[float, finite("store_retry_max_seconds", 1, 86400)] = Field(
        120.0,
        description="How long an object-store call (a whole checkpoint upload included) keeps retrying transient "
        "faults, an endpoint outage included: no attempt starts later than this after the first (back-off with "
        "jitter, at most 4 s between attempts), unless store_retry_attempts are not made yet.",
    )
    eval_interval: Annotated[str | None, optional_duration_validator("eval_interval")] = Field(
        None,
        description="Evaluate on the recipe's eval split every '<n>ep', '<n>ba' or '<n>sp' inside the run (always "
        "done at the end too); the metrics, prefixed 'eval_', are stored in the next checkpoint's manifest and "
        "may drive checkpoint_score_attribute.",
    )
    eval_each_unit: bool = Field(
        False, description="Evaluate after every unit: the same as eval_interval=save_interval."
    )
    grad_clip_norm: Annotated[float | None, optional_finite("grad_clip_norm", 1e-12, 1e12)] = Field(
        None,
        description="Clip the global gradient norm (all parameters, every process) to this before each optimizer "
        "step; with fp16 the gradients are unscaled first.",
    )
    grad_accumulation: int = Field(
        1,
        ge=1,
        le=4096,
        description="Micro-batches per process per optimizer step: each process loads, runs and frees its share of "
        "the global batch in this many pieces (less activation memory; the same update).",
    )
    precision: Literal["fp32", "bf16", "fp16"] = Field(
        "fp32",
        description="fp32, or autocast to bf16 / fp16; fp16 adds a gradient scaler whose state is checkpointed.",
    )
    parallelism: Literal["ddp", "fsdp"] = Field(
        "ddp",
        description="With several processes: ddp (every process holds the whole model; one state.pt) or fsdp (FSDP2 "
        "fully_shard; every process writes its shards of a torch.distributed.checkpoint checkpoint).",
    )
    preemption_grace_seconds: Annotated[float, finite("preemption_grace_seconds", 0, 86400)] = Field(
        25.0,
        description="Seconds between a termination signal and the SIGKILL that follows it (Kubernetes' "
        "terminationGracePeriodSeconds is 30 by default; Slurm: the N of --signal=TERM@N). On the signal, training "
        "stops at the next step and commits a checkpoint there if this run's save times say it fits; else it "
        "leaves at once and says so.",
    )
    preemption_signals: list[str] = Field(
        default_factory=lambda: ["SIGTERM"],
        description='Signals that ask for a checkpoint and a clean exit, e.g. \'["SIGTERM", "SIGUSR1"]\' for '
        "Slurm's --signal=USR1@60.",
    )
    log_every_n_steps: int = Field(20, ge=1, le=MAX_COUNT, description="Print a progress line every this many steps.")
    tensorboard: bool = Field(
        True,
        description="Write TensorBoard event files (per step: loss, lr; samples/s every log_every_n_steps; unit, "
        "eval and report metrics) to <metrics_dir>/<run_name>, else to <save_folder>/<run_name>/tb for a local "
        "save_folder (an object store needs metrics_dir). A resumed run continues the same curve.",
    )
    metrics_dir: str | None = Field(
        None,
        description="Local folder for TensorBoard event files, one sub-folder per run (<metrics_dir>/<run_name>); "
        "without it, a run whose save_folder is an object store writes none.",
    )
    mlflow: bool = Field(
        True,
        description="Log parameters, metrics and checkpoint URIs to MLflow when the environment sets "
        "MLFLOW_TRACKING_URI; a resumed run continues the same MLflow run. false turns it off.",
    )
    mlflow_experiment: str | None = Field(
        None, description="MLflow experiment of the run (default: MLFLOW_EXPERIMENT_NAME, else 'Default')."
    )
    progress_bar: bool = Field(
        True,
        description="Show a progress bar (step, loss, time left) when stdout and stderr are a terminal (never "
        "under a Prefect worker); false turns it off.",
    )
    inject_fault_at_step: int | None = Field(
        None,
        ge=1,
        le=MAX_COUNT,
        description="Fault injection for demos and tests: the first attempt of the unit that reaches "
        "this global step raises right after the step. Off by default.",
    )
    export_on_complete: Annotated[str | None, AfterValidator(export_uri)] = Field(
        None,
        description="When the run completes, write its final weights with recipe, recipe_args and product version "
        "to this file URI (.pt/.pth: torch.save; .safetensors).",
    )
    config_file: str | None = Field(
        None, description="YAML or TOML file with any of these fields (flags and TRAIN_* variables override it)."
    )

    def __init__(self, /, **values: Any) -> None:
        """Keyword arguments are field names, exactly: a flow-run parameter arrives here as TrainConfig(**dict)
        (pydantic validates the ``config`` parameter through this constructor), and pydantic-settings would match
        'Storage_Options' to storage_options and obey '_env_prefix', '_cli_parse_args', '_secrets_dir', ..."""
        check_keys(values, type(self).model_fields, "TrainConfig:")
        try:
            super().__init__(**values)
        except SettingsError as exc:  # a bounded source's one line, wrapped by pydantic-settings
            if isinstance(exc.__cause__, ConfigError):
                raise exc.__cause__ from None
            raise

    @field_validator("checkpoint_score_attribute")
    @classmethod
    def _metric_name(cls, v: str | None) -> str | None:
        if v is not None and not METRIC_NAME.match(v):
            raise ValueError(f"checkpoint_score_attribute={v!r}: use a metric name such as 'loss' or 'eval_accuracy'")
        return v

    @field_validator("preemption_signals")
    @classmethod
    def _signals(cls, v: list[str]) -> list[str]:
        from training.preemption import parse_signals

        return [s.name for s in parse_signals(v)]

    @field_validator("metrics_dir")
    @classmethod
    def _metrics_dir(cls, v: str | None) -> str | None:
        if v is None:
            return None
        text = v.strip()
        if text.startswith("file://"):
            text = text.removeprefix("file://")
        if not text or "://" in text or any(ord(c) < 32 for c in text) or len(text) > 1024:
            raise ValueError(
                f"metrics_dir={short(v)}: TensorBoard event files go to a local folder; use a local path such as "
                f"'tensorboard' (sync it to an object store yourself), or leave it unset"
            )
        return text

    @field_validator("mlflow_experiment")
    @classmethod
    def _mlflow_experiment(cls, v: str | None) -> str | None:
        if v is not None and (not v.strip() or len(v) > 500 or any(ord(c) < 32 for c in v)):
            raise ValueError(
                f"mlflow_experiment={short(v)}: use a name of 1 to 500 printable characters, or leave it unset"
            )
        return v

    @field_validator("num_checkpoints_to_keep")
    @classmethod
    def _keep(cls, v: int) -> int:
        if v == 0 or v < -1:
            raise ValueError(f"num_checkpoints_to_keep={v}: use -1 (keep all) or a count >= 1")
        return v

    @model_validator(mode="after")
    def _cross_checks(self) -> TrainConfig:
        if self.load_weights_only and not self.load_path:
            raise ValueError("load_weights_only=True needs load_path: set load_path to a checkpoint or run URI")
        if self.eval_interval is not None and self.eval_each_unit:
            raise ValueError(
                f"eval_each_unit=True and eval_interval={self.eval_interval!r} both set how often to evaluate: "
                f"keep eval_interval"
            )
        if self.resume_from and not self.autoresume:
            raise ValueError(
                f"resume_from={self.resume_from!r} continues the run from that checkpoint, and autoresume=False "
                f"refuses a run that has checkpoints: drop one of them"
            )
        if (self.load_ignore_keys or not self.load_strict) and not self.load_path:
            raise ValueError("load_strict and load_ignore_keys apply to load_path: set load_path, or leave them out")
        if self.save_network_weights and self.parallelism == "fsdp":
            raise ValueError(
                "save_network_weights=True with parallelism='fsdp': the weights are shards of every process; export "
                "a checkpoint's whole weights with python -m checkpointing export <checkpoint URI> <file>"
            )
        self.save_folder = format_save_folder(self.save_folder, self.run_name)
        return self

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ):
        flags = _flags.get()
        sources: list[PydanticBaseSettingsSource] = [*([flags] if flags else []), init_settings]
        sources.append(BoundedEnvSource(settings_cls))  # not env_settings: its JSON decoding is unbounded
        path = _config_file.get() or os.environ.get("TRAIN_CONFIG_FILE")
        if path:
            sources.append(file_source(settings_cls, path))
        return tuple(sources)

    # -- derived -------------------------------------------------------------------------------
    # The duration fields stay text (what flow-run parameters, manifests and model_copy(update=...) carry); each text
    # is parsed once, by its validator, and these reads (several a step) find that value (Duration.parse).
    @property
    def duration(self) -> Duration:
        return Duration.parse(self.max_duration)

    @property
    def interval(self) -> Duration:
        return Duration.parse(self.save_interval)

    @property
    def eval_every(self) -> Duration | None:
        """How often to evaluate inside the run (None: only at the end)."""
        if self.eval_interval is not None:
            return Duration.parse(self.eval_interval)
        return self.interval if self.eval_each_unit else None

    @property
    def snapshot_every(self) -> Duration | None:
        """How often to snapshot inside a unit (None: at its end only)."""
        return Duration.parse(self.snapshot_interval) if self.snapshot_interval is not None else None

    def fingerprint(self) -> str:
        """Hash of what defines the model and data order (not durations, batch size or storage)."""
        key = {"recipe": self.recipe, "recipe_args": self.recipe_args, "seed": self.seed, "shuffle": self.shuffle}
        return hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:16]


def load_config(argv: list[str] | None = None, **overrides: Any) -> TrainConfig:
    """Builds TrainConfig from flags, TRAIN_* variables and an optional config file."""
    argv = list(argv or [])
    check_flag_json(argv, TrainConfig.model_fields)
    flags: BoundedCliSource[TrainConfig] = BoundedCliSource(TrainConfig, cli_parse_args=argv, cli_exit_on_error=False)
    file_token, flags_token = _config_file.set(_find_config_file(argv)), _flags.set(flags(args=argv))
    try:
        return TrainConfig(**overrides)
    finally:
        _flags.reset(flags_token)
        _config_file.reset(file_token)


def _find_config_file(argv: list[str]) -> str | None:
    for i, arg in enumerate(argv):
        if arg in ("--config_file", "--config-file") and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith(("--config_file=", "--config-file=")):
            return arg.split("=", 1)[1]
    return None


def describe_error(exc: ValidationError) -> str:
    """One line per invalid field: name, value and what is accepted."""
    lines = []
    for err in exc.errors():
        field = ".".join(str(p) for p in err["loc"]) or "config"
        msg = err["msg"].removeprefix("Value error, ")
        if field == "storage_options":  # may hold credentials: never echo the value
            lines.append(f"storage_options: {msg}")
        elif msg.startswith(f"{field}=") or field == "config":
            lines.append(msg)
        else:
            lines.append(f"{field}={short(err.get('input'))}: {msg}")
    return "\n".join(lines)
