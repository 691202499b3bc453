"""Experiment tracking: a run's scalars, scores and sample grids in TensorBoard and MLflow, where GAN
researchers look (as NVFlare streams them from its server).

    --tensorboard DIR   event files under DIR/<run id> (TensorBoard's SummaryWriter)
    --mlflow URI        an MLflow run in the tracking store at URI (a ./mlruns folder, file:///path, or
                        http(s)://a tracking server): parameters, metrics, the final samples and generator

The recorder of every run (mdgan/run.py's RunRecorder, so simulate and the server alike) hands what it
records to a Tracking, which writes from a thread of its own through a bounded queue: a slow or absent
tracking server never slows or stops training. A writer that fails is said once in the log and
dropped; what the queue cannot hold is dropped too (and counted in that line).

The packages are an extra: `pip install 'mdgan[tracking]'` (tensorboard, mlflow-skinny).
"""

from __future__ import annotations

import io
import logging
import os
import queue
import threading

from mdgan.config import ConfigError

log = logging.getLogger("mdgan.tracking")

QUEUE_LIMIT = 10_000  # items waiting for a slow writer; beyond, new ones are dropped (and counted)


def _missing(package: str, flag: str) -> ConfigError:
    return ConfigError(f"{flag} needs the {package} package: pip install 'mdgan[tracking]'")


class TensorBoardWriter:
    def __init__(self, folder: str, run_id: str):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise _missing("tensorboard", "--tensorboard") from None
        self.writer = SummaryWriter(os.path.join(folder, run_id or "run"))

    def params(self, values: dict) -> None:
        self.writer.add_text("params", "\n".join(f"    {k}: {v}" for k, v in sorted(values.items())), 0)

    def metrics(self, step: int, values: dict) -> None:
        for name, value in values.items():
            self.writer.add_scalar(name, value, step)

    def image(self, step: int, name: str, png: bytes) -> None:
        import numpy as np
        from PIL import Image

        pixels = np.asarray(Image.open(io.BytesIO(png)).convert("RGB"))  # (H, W, 3)
        self.writer.add_image(name, pixels, step, dataformats="HWC")

    def artifact(self, path: str) -> None:
        return None  # TensorBoard keeps scalars and images; the files stay in the run folder

    def close(self) -> None:
        self.writer.close()


class MLflowWriter:
    def __init__(self, uri: str, run_id: str, experiment: str = "mdgan"):
        try:
            from mlflow.tracking import MlflowClient
        except ImportError:
            raise _missing("mlflow (mlflow-skinny)", "--mlflow") from None
        if "://" not in uri:  # a plain folder is a file store
            uri = "file://" + os.path.abspath(uri)
        if uri.startswith("file:"):  # asked for by name: MLflow 3 refuses a file store unless allowed
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self.client = MlflowClient(tracking_uri=uri)
        found = self.client.get_experiment_by_name(experiment)
        experiment_id = found.experiment_id if found else self.client.create_experiment(experiment)
        self.run_id = self.client.create_run(experiment_id, run_name=run_id or None,
                                             tags={"mdgan.run_id": run_id}).info.run_id

    def params(self, values: dict) -> None:
        from mlflow.entities import Param

        self.client.log_batch(self.run_id, params=[Param(k, str(v)[:500]) for k, v in sorted(values.items())])

    def metrics(self, step: int, values: dict) -> None:
        import time

        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(k, float(v), now, step) for k, v in values.items()])

    def image(self, step: int, name: str, png: bytes) -> None:
        import tempfile

        with tempfile.TemporaryDirectory() as folder:
            path = os.path.join(folder, f"{name.replace('/', '_')}-{step:09d}.png")
            with open(path, "wb") as fh:
                fh.write(png)
            self.client.log_artifact(self.run_id, path, artifact_path="samples")

    def artifact(self, path: str) -> None:
        self.client.log_artifact(self.run_id, path)

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


def _require(module: str, package: str, flag: str) -> None:
    import importlib.util

    if importlib.util.find_spec(module) is None:
        raise _missing(package, flag)


class Tracking:
    """Every writer of a run, made and fed from a thread of its own (see the module's docstring): even
    connecting to a tracking server happens there, never in training's way."""

    def __init__(self, makers: list[tuple[str, str, object]]):
        self._makers = makers  # (flag, target, () -> writer)
        self.writers: list = []
        self._queue: queue.Queue = queue.Queue(QUEUE_LIMIT)
        self._dropped = 0
        self._thread = threading.Thread(target=self._drain, name="mdgan-tracking", daemon=True)
        self._thread.start()

    @classmethod
    def open(cls, run_id: str, tensorboard: str | None = None, mlflow: str | None = None) -> "Tracking | None":
        """The run's tracking, or None when neither is asked; a missing package is a ConfigError, said
        before training starts. A store that cannot be reached is said in the log, and training goes on."""
        makers = []
        if tensorboard:
            _require("tensorboard", "tensorboard", "--tensorboard")
            makers.append(("--tensorboard", tensorboard, lambda: TensorBoardWriter(tensorboard, run_id)))
        if mlflow:
            _require("mlflow", "mlflow (mlflow-skinny)", "--mlflow")
            makers.append(("--mlflow", mlflow, lambda: MLflowWriter(mlflow, run_id)))
        return cls(makers) if makers else None

    def _put(self, item: tuple) -> None:
        try:
            self._queue.put_nowait(item)
        except queue.Full:
            self._dropped += 1

    def params(self, values: dict) -> None:
        self._put(("params", values))

    def metrics(self, step: int, values: dict) -> None:
        self._put(("metrics", step, values))

    def image(self, step: int, name: str, png: bytes) -> None:
        self._put(("image", step, name, png))

    def artifact(self, path: str) -> None:
        self._put(("artifact", path))

    def _drain(self) -> None:
        for flag, target, make in self._makers:
            try:
                self.writers.append(make())
            except Exception as exc:  # an unreachable server, a folder it cannot write: training goes on
                log.warning("%s %s: cannot track this run there (%s: %s); training goes on without it", flag,
                            target, type(exc).__name__, exc)
        while True:
            item = self._queue.get()
            if item is None:
                return
            for writer in list(self.writers):
                try:
                    getattr(writer, item[0])(*item[1:])
                except Exception as exc:
                    self.writers.remove(writer)
                    log.warning("tracking to %s failed (%s: %s): it gets nothing more of this run",
                                type(writer).__name__, type(exc).__name__, exc)

    def close(self, timeout: float = 10.0) -> None:
        """Writes what is queued (for up to `timeout` s: a hung server does not keep the run from ending)."""
        self._queue.put(None)
        self._thread.join(timeout)
        if self._thread.is_alive():
            log.warning("tracking: gave up after %.0f s with %d items unwritten", timeout, self._queue.qsize())
        for writer in self.writers:
            try:
                writer.close()
            except Exception as exc:
                log.warning("tracking: closing %s failed (%s)", type(writer).__name__, exc)
        if self._dropped:
            log.warning("tracking: %d items dropped (the writers could not keep up)", self._dropped)
