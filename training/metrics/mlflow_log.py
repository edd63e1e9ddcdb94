"""MLflow for a run that is resumed, retried and relaunched: one MLflow run, one curve.

On when the worker's environment names a tracking server (``MLFLOW_TRACKING_URI``, MLflow's own variable) and
``mlflow`` is left on. Where a run may connect is the worker's to say, so no run parameter names a server.

- The MLflow run's id is kept in the run folder (``mlflow.json``, written through the checkpoint store's Storage):
  every later unit, retry or relaunch, on any machine, continues that MLflow run.
- Secrets never leave the process (checkpointing/io/redact.py): ``mlflow.json`` and the log lines hold the tracking
  URI without its password (``http://trainer:***@host``; the client uses the real one from the environment), URIs in
  tags and warnings are redacted too.
- Parameters: the config without ``storage_options``, filtered recursively with the word list the recipes' own
  refusals use: the value of a credential-like key at any depth is ``<redacted>``, secrets in strings are masked.
- Checkpoints: each committed checkpoint's URI as a tag (``checkpoint.<name>``, ``latest_checkpoint``); no bytes.
- One curve: MLflow keeps every value it is sent, so a step is never sent twice. On opening, the steps MLflow holds
  for each metric are read; values a resumed or retried attempt logs at those steps again (the same values:
  training resumes exactly) are not sent. Values are sent in batches (every ``log_every_n_steps`` and before each
  commit).
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable, Mapping
from typing import Any

from checkpointing import CheckpointStore
from checkpointing.io.redact import redact, redact_text, redact_uri
from training.config import TrainConfig

logger = logging.getLogger(__name__)

ID_FILE = "mlflow.json"
URI_ENV = "MLFLOW_TRACKING_URI"
EXPERIMENT_ENV = "MLFLOW_EXPERIMENT_NAME"
NOT_PARAMS = {"storage_options", "config_file"}


def mlflow_wanted(config: TrainConfig) -> bool:
    return config.mlflow and bool(os.environ.get(URI_ENV, "").strip())


def params_of(config: TrainConfig) -> dict[str, str]:
    """The config as MLflow parameters, values as text: ``storage_options`` left out, credentials redacted."""
    fields = redact({k: v for k, v in config.model_dump(mode="json").items() if k not in NOT_PARAMS})
    return {k: (v if isinstance(v, str) else json.dumps(v, sort_keys=True))[:6000] for k, v in fields.items()}


class MlflowRun:
    """Rank 0's MLflow run of one training run, opened lazily at the first start."""

    def __init__(self, config: TrainConfig, store: CheckpointStore):
        self.config, self.store = config, store
        self.run_id: str | None = None
        self._client: Any = None
        self._on = True
        self._pending: list[tuple[int, dict[str, float]]] = []
        self._held: dict[str, int] = {}  # per metric: the newest step MLflow holds (read at open, then sent)

    def start(self, step: int) -> None:
        self._pending = [(s, v) for s, v in self._pending if s <= step]  # a failed attempt's later steps: retrained
        if self._client is None:
            self._guard(self._open)

    def log(self, step: int, values: Mapping[str, float]) -> None:
        if not self._on:
            return
        self._pending.append((step, dict(values)))
        if len(self._pending) >= self.config.log_every_n_steps:
            self._guard(self._send)

    def checkpoint(self, step: int, name: str, uri: str) -> None:
        self._guard(self._send)
        if name and self._on and self._client is not None:
            shown = redact_uri(uri)
            self._guard(lambda: self._tag({f"checkpoint.{name}": shown, "latest_checkpoint": shown}))

    def end(self, complete: bool) -> None:
        self._guard(self._send)
        if complete and self._on and self._client is not None:
            self._guard(lambda: self._client.set_terminated(self.run_id, "FINISHED"))

    # -- helpers --------------------------------------------------------------------------------------
    def _open(self) -> None:
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        # a server that is down must not hold training for minutes (MLflow's defaults: 7 retries, 120 s each)
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "1")
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "10")
        uri = os.environ[URI_ENV].strip()
        shown = redact_uri(uri)  # what is stored and logged: the password stays in this process
        if shown != uri:  # MLflow prints "View run ... at <tracking URI>" to stdout when a run ends
            os.environ["MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT"] = "true"
        client = MlflowClient(tracking_uri=uri)
        run = self._kept_run(client, shown)
        params = params_of(self.config)
        if run is None:
            experiment = self._experiment(client)
            run = client.create_run(
                experiment, run_name=self.config.run_name, tags={"run_uri": redact_uri(self.store.uri)}
            )
            self._keep(run.info.run_id, shown)
            logger.info("MLflow run %s (experiment %s) at %s", run.info.run_id, experiment, shown)
        else:
            if run.info.status != "RUNNING":
                client.update_run(run.info.run_id, status="RUNNING")
            self._held = {
                key: max(m.step for m in client.get_metric_history(run.info.run_id, key)) for key in run.data.metrics
            }
            params = {k: v for k, v in params.items() if k not in run.data.params}  # MLflow params never change
            logger.info(
                "MLflow run %s continues (steps held up to %s)", run.info.run_id, max(self._held.values(), default=None)
            )
        self._client, self.run_id = client, run.info.run_id
        if params:
            client.log_batch(self.run_id, params=[Param(k, v) for k, v in params.items()])

    def _keep(self, run_id: str, shown: str) -> None:
        self.store.storage.put(ID_FILE, json.dumps({"run_id": run_id, "tracking_uri": shown}).encode())

    def _kept_run(self, client: Any, shown: str) -> Any:
        """The MLflow run named in the run folder, if it is on this server (``shown``: its redacted URI) and still
        there. A file of an earlier version that holds the URI's password is rewritten without it."""
        if not self.store.storage.exists(ID_FILE):
            return None
        try:
            kept = json.loads(self.store.storage.get(ID_FILE, max_bytes=65536))
            kept_uri = str(kept.get("tracking_uri"))
            if redact_uri(kept_uri) != shown:
                logger.warning(
                    "MLflow: the run was logged to %s before; starting a new MLflow run at %s",
                    redact_uri(kept_uri),
                    shown,
                )
                return None
            run = client.get_run(str(kept["run_id"]))
            if kept_uri != shown:
                self._keep(run.info.run_id, shown)
        except Exception as exc:
            logger.warning(
                "MLflow: the run kept in %s is unusable (%s); starting a new MLflow run", ID_FILE, redact_text(str(exc))
            )
            return None
        return None if run.info.lifecycle_stage == "deleted" else run

    def _experiment(self, client: Any) -> str:
        name = self.config.mlflow_experiment or os.environ.get(EXPERIMENT_ENV) or "Default"
        found = client.get_experiment_by_name(name)
        if found is not None:
            return str(found.experiment_id)
        try:
            return str(client.create_experiment(name))
        except Exception:  # another run created it meanwhile
            found = client.get_experiment_by_name(name)
            if found is None:
                raise
            return str(found.experiment_id)

    def _send(self) -> None:
        if self._client is None or not self._pending:
            return
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [
            Metric(key, float(value), now, step)
            for step, values in self._pending
            for key, value in values.items()
            if step > self._held.get(key, -1)
        ]
        for i in range(0, len(metrics), 1000):  # MLflow's limit per batch
            self._client.log_batch(self.run_id, metrics=metrics[i : i + 1000])
        for m in metrics:
            self._held[m.key] = max(self._held.get(m.key, -1), m.step)
        self._pending = []

    def _tag(self, tags: dict[str, str]) -> None:
        from mlflow.entities import RunTag

        self._client.log_batch(self.run_id, tags=[RunTag(k, v) for k, v in tags.items()])

    def _guard(self, call: Callable[[], Any]) -> None:
        if not self._on:
            return
        try:
            call()
        except Exception as exc:  # a metric never fails training: warned once, MLflow is off from here on
            self._on, self._pending = False, []
            logger.warning(
                "MLflow metrics are off for the rest of this process: %s: %s", type(exc).__name__, redact_text(str(exc))
            )
