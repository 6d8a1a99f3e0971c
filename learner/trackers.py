"""Experiment trackers behind ``training.report_to``: TensorBoard, Weights & Biases, MLflow.

Rank 0's :class:`learner.metrics.MetricsWriter` hands every record it appends to ``metrics.jsonl``
(step, eval and end records) to each tracker as ``log(scalars, step)``: the record's finite numbers
(no lists, strings or bools) at the record's ``step``. ``metrics.jsonl`` stays the source of truth;
a tracker is a view of it.

Where each writes, and how it runs without network::

    tensorboard  {output_dir}/tensorboard/events.*          torch.utils.tensorboard (the tensorboard package)
    wandb        {output_dir}/wandb/{offline-,}run-*/       WANDB_MODE=offline: no network, no login;
                                                             `wandb sync DIR` uploads it later
    mlflow       MLFLOW_TRACKING_URI, else file:{output_dir}/mlruns   a file store: no server, no database

Steps: evaluation records arrive late (their thread finishes after later steps were logged) with an
earlier ``step``. W&B drops a ``log(step=s)`` below its last step, so every key is plotted against a
``global_step`` metric we log with it instead (``define_metric``); TensorBoard and MLflow take any
step order. A resumed run (same ``run_id``) continues the same W&B run (``id`` = run id,
``resume="allow"``) and the same MLflow run (tag ``tandem.run_id``).

Each package is imported only when its tracker is chosen (the config check refuses a chosen one that
is not installed: ``common/config/run.py``). What this module does not know: ranks, what a metric means.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

log = logging.getLogger(__name__)


class Tracker(Protocol):
    def log(self, scalars: dict[str, float], step: int) -> None: ...

    def close(self) -> None: ...


def scalars(record: dict[str, Any]) -> dict[str, float]:
    """The record's finite numbers other than ``step`` (lists, strings, bools and None are not scalars)."""
    return {k: float(v) for k, v in record.items()
            if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)}


class TensorBoard:
    def __init__(self, out: Path) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(str(out / "tensorboard"))

    def log(self, values: dict[str, float], step: int) -> None:
        for k, v in values.items():
            self.writer.add_scalar(k, v, step)

    def close(self) -> None:
        self.writer.close()


class Wandb:
    def __init__(self, out: Path, *, run_name: str, run_id: str | None, config: dict[str, Any]) -> None:
        import wandb

        (out / "wandb").mkdir(parents=True, exist_ok=True)  # wandb writes under dir/wandb/
        try:
            self.run = wandb.init(project=os.environ.get("WANDB_PROJECT", "tandem"), name=run_name, dir=str(out),
                                  id=run_id, resume="allow" if run_id else None, config=config,
                                  settings=wandb.Settings(console="off", silent=True))
        except Exception as exc:  # noqa: BLE001 - wandb raises its own error types for login and network
            raise RuntimeError(f"training.report_to: wandb could not start a run ({exc}). Fix: `wandb login`, or "
                               "WANDB_MODE=offline to write the run under output_dir/wandb and `wandb sync` it "
                               "later, or remove wandb from training.report_to") from exc
        self.run.define_metric("global_step")
        self.run.define_metric("*", step_metric="global_step")

    def log(self, values: dict[str, float], step: int) -> None:
        self.run.log({**values, "global_step": step})

    def close(self) -> None:
        self.run.finish()


class Mlflow:
    def __init__(self, out: Path, *, run_name: str, run_id: str | None, config: dict[str, Any]) -> None:
        from mlflow.tracking import MlflowClient

        uri = os.environ.get("MLFLOW_TRACKING_URI")
        if not uri:
            uri = (out / "mlruns").resolve().as_uri()
            # NOTE: MLflow 3.x refuses its file store ("maintenance mode") unless this is set; the SQL store it
            # suggests needs sqlalchemy + alembic, which mlflow-skinny leaves out. A run-local file store needs no
            # server and no database (mlflow ui --backend-store-uri reads it).
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self.client = MlflowClient(tracking_uri=uri)
        exp = self.client.get_experiment_by_name(run_name)
        exp_id = exp.experiment_id if exp is not None else self.client.create_experiment(run_name)
        found = self.client.search_runs([exp_id], f"tags.`tandem.run_id` = '{run_id}'") if run_id else []
        if found:
            self.run_id = found[0].info.run_id
        else:
            self.run_id = self.client.create_run(exp_id, run_name=run_name,
                                                 tags={"tandem.run_id": str(run_id)}).info.run_id
            self.client.log_dict(self.run_id, config, "run_config.json")

    def log(self, values: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        # MLflow keys allow letters, digits and _ - . space /; ours are <area>/<name> already.
        ms = int(time.time() * 1000)
        metrics = [Metric(k, v, ms, step) for k, v in values.items()]
        for i in range(0, len(metrics), 1000):  # log_batch takes at most 1000 metrics a call
            self.client.log_batch(self.run_id, metrics=metrics[i:i + 1000])

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


def open_trackers(names: Sequence[str], output_dir: str | Path, *, run_name: str, run_id: str | None,
                  config: dict[str, Any] | None = None) -> list[Tracker]:
    """One tracker per name in ``training.report_to``, in order; each package imported here, not before."""
    out = Path(output_dir)
    made: list[Tracker] = []
    for name in names:
        if name == "tensorboard":
            made.append(TensorBoard(out))
        elif name == "wandb":
            made.append(Wandb(out, run_name=run_name, run_id=run_id, config=config or {}))
        elif name == "mlflow":
            made.append(Mlflow(out, run_name=run_name, run_id=run_id, config=config or {}))
        else:
            raise ValueError(f"training.report_to: unknown tracker {name!r}; use tensorboard, wandb or mlflow")
        log.info("metrics also go to %s", name)
    return made
