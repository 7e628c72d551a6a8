"""MLflow backend.

Without `logger.mlflow.tracking_uri` the run goes to a local store inside the run
directory: `sqlite:///<run_dir>/mlflow/mlflow.db` (MLflow 3 keeps its plain-file store in
maintenance mode and refuses it by default; SQLite is its recommended local file store)
with artifacts in `<run_dir>/mlflow/artifacts`. Browse with
`mlflow ui --backend-store-uri sqlite:///<run_dir>/mlflow/mlflow.db`. A resumed run
continues the stopped run's MLflow run (by its id) when the store still has it. MLflow
parameters cannot change within a run, so a resumed run whose config differs logs only the
parameters that are new and names the changed ones in a warning (config.yaml has them all).
The steps the stopped run logged after the checkpoint, logged again, keep both values: MLflow's
API cannot delete a logged metric value (metrics.jsonl, TensorBoard and the plots show one).
"""

from __future__ import annotations

import hashlib
import logging
import re
import socket
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from posttrain.config import InputError
from posttrain.schemas import MlflowConfig

# MLflow limits: names of letters (of any script), digits and `_-. /:`, read as a normalised
# path, and at most 250 characters; parameter values of at most 6000 characters.
_BAD_CHARS = re.compile(r"[^\w\-. /:]")
_MAX_KEY_LEN = 250
_MAX_PARAM_LEN = 6000
# Seconds to wait for an MLflow server's TCP connection at the run's start.
_CONNECT_TIMEOUT_S = 10

_log = logging.getLogger("posttrain")


class MlflowBackend:
    def __init__(self, cfg: MlflowConfig, run_dir: Path, resume_id: str | None = None) -> None:
        from mlflow.exceptions import MlflowException
        from mlflow.tracking import MlflowClient

        store = run_dir / "mlflow"
        store.mkdir(parents=True, exist_ok=True)
        self.tracking_uri = cfg.tracking_uri or f"sqlite:///{store.resolve()}/mlflow.db"
        if cfg.tracking_uri:
            _check_server(cfg.tracking_uri)
        try:
            self._client = MlflowClient(tracking_uri=self.tracking_uri)
            exp = self._client.get_experiment_by_name(cfg.experiment_name)
        except MlflowException as e:  # e.g. a file store (./mlruns), which MLflow 3 refuses by default
            raise InputError(f"logger.mlflow.tracking_uri={cfg.tracking_uri}: MLflow cannot use it: {e.message}") \
                from None
        if exp is None:
            artifacts = None if cfg.tracking_uri else (store / "artifacts").resolve().as_uri()
            exp_id = self._client.create_experiment(cfg.experiment_name, artifact_location=artifacts)
        else:
            exp_id = exp.experiment_id
        self._logged_params: dict[str, str] = {}
        if resume_id is not None:
            try:
                run = self._client.get_run(resume_id)
            except MlflowException:  # another store (tracking_uri changed) or a deleted run
                _log.warning("MLflow run %s of the stopped run is not in %s; logging to a new run",
                             resume_id, self.tracking_uri)
            else:
                self.run_id = resume_id
                self._logged_params = dict(run.data.params)
                self._client.update_run(resume_id, status="RUNNING")
                return
        self.run_id = self._client.create_run(exp_id, run_name=cfg.run_name or run_dir.name).info.run_id

    def log_metrics(self, metrics: dict[str, float], step: int, prefix: str) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        batch = [Metric(_key(f"{prefix}/{k}"), float(v), now, step) for k, v in metrics.items()]
        self._client.log_batch(self.run_id, metrics=batch)

    def log_hparams(self, hparams: dict[str, Any]) -> None:
        from mlflow.entities import Param

        values = {_key(k): str(v)[:_MAX_PARAM_LEN] for k, v in _flatten(hparams).items()}
        changed = sorted(k for k, v in values.items() if self._logged_params.get(k, v) != v)
        if changed:
            _log.warning("MLflow keeps a run's parameters as first logged; the resumed run's changed %s "
                         "stay at their earlier values there (config.yaml has the new ones)", ", ".join(changed))
        params = [Param(k, v) for k, v in values.items() if k not in self._logged_params]
        self._logged_params.update((p.key, p.value) for p in params)
        for i in range(0, len(params), 100):  # MLflow accepts at most 100 params per batch
            self._client.log_batch(self.run_id, params=params[i : i + 100])

    def close(self, failed: bool = False) -> None:
        self._client.set_terminated(self.run_id, status="FAILED" if failed else "FINISHED")


def _check_server(uri: str) -> None:
    """Fail at once when the MLflow server of an http(s) `uri` does not answer: MLflow's client
    retries a request with backoff for minutes (a typo in the port, a server not started stalled
    the run's start without a word) and then fails with a traceback."""
    url = urlparse(uri)
    if url.scheme not in ("http", "https") or not url.hostname:
        return
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        socket.create_connection((url.hostname, port), timeout=_CONNECT_TIMEOUT_S).close()
    except OSError as e:
        raise InputError(f"logger.mlflow.tracking_uri={uri}: no MLflow server answers at {url.hostname}:{port} "
                         f"({e.strerror or e}); start it (`mlflow server`) or set tracking_uri=null for a local "
                         "store in the run directory") from None


def _key(name: str) -> str:
    """`name` as MLflow accepts it: other characters as `_`; its `/` parts as a normalised path
    (none empty, `.` or `..`: `env/` of an environment metric named "", or `a//b`); and past 250
    characters cut, with a hash of the whole name appended so that two long names sharing a
    beginning stay two keys. (A user's `env/<name>` metric or a key in a free-form config dict
    can be any of these; MLflow refuses the whole batch, which failed the run's setup or step.)"""
    parts = _BAD_CHARS.sub("_", name).split("/")
    key = "/".join(part if part not in (".", "..") else "_" * len(part) for part in parts if part) or "_"
    if len(key) <= _MAX_KEY_LEN:
        return key
    return f"{key[: _MAX_KEY_LEN - 9]}-{hashlib.sha1(name.encode()).hexdigest()[:8]}"


def _flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict) and v:
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out
