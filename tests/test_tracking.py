"""Experiment tracking, read back with TensorBoard's own reader and MLflow's own client: the scalars,
the scores and a sample grid at every evaluation, the parameters and the final samples and generator;
the same generator as without tracking; a tracking server that is not there never stops a run."""

from __future__ import annotations

import glob
import os
import socket
import subprocess
import sys

import pytest

from conftest import REPO

pytest.importorskip("tensorboard")
pytest.importorskip("mlflow")

TRAINING = ["--workers", "2", "--iterations", "12", "--batch-size", "8", "--swap-every", "5", "--eval-every", "6",
            "--eval-samples", "100", "--eval-reference", "200", "--no-progress"]


def mdgan(*argv: str, env: dict | None = None) -> subprocess.CompletedProcess:
    result = subprocess.run([sys.executable, "-m", "mdgan_app.cli", *argv], cwd=REPO, capture_output=True, text=True,
                            timeout=600, env={**os.environ, **(env or {})})
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def read_back(tensorboard: str, mlflow: str):
    from mlflow.tracking import MlflowClient
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    [events] = glob.glob(os.path.join(tensorboard, "*"))
    board = EventAccumulator(events, size_guidance={"images": 0, "scalars": 0})
    board.Reload()
    os.environ["MLFLOW_ALLOW_FILE_STORE"] = "true"
    client = MlflowClient(f"file://{os.path.abspath(mlflow)}")
    [run] = client.search_runs([client.get_experiment_by_name("mdgan").experiment_id])
    return board, client, run


def check(board, client, run, iterations: int) -> None:
    scalars = board.Tags()["scalars"]
    for tag in ("loss/generator", "loss/discriminator", "accuracy/real", "workers/active", "swaps/round",
                "score/mnist_score", "score/fid", "bytes/worker_to_worker"):
        assert tag in scalars, tag
    assert [e.step for e in board.Scalars("loss/generator")] == list(range(1, iterations + 1))
    assert {e.step for e in board.Scalars("score/fid")} >= {6, 12}
    assert board.Tags()["images"] == ["samples"] and len(board.Images("samples")) >= 2
    assert run.info.status == "FINISHED"
    assert {"loss/generator", "score/mnist_score", "bytes/server_to_worker"} <= set(run.data.metrics)
    assert run.data.params["workers"] == "2" and run.data.params["algorithm"] == "mdgan"
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {"samples.png", "checkpoint.pt", "summary.json", "samples"} <= artifacts
    assert len(client.list_artifacts(run.info.run_id, "samples")) >= 2  # a grid at every evaluation


@pytest.mark.slow
def test_simulate_tracks_to_tensorboard_and_mlflow_and_trains_the_same_generator(tmp_path, mnist_root):
    common = ["simulate", "--dataset", "mnist", "--data-root", mnist_root, *TRAINING]
    mdgan(*common, "--out", str(tmp_path / "plain"))
    mdgan(*common, "--out", str(tmp_path / "tracked"), "--tensorboard", str(tmp_path / "tb"), "--mlflow",
          str(tmp_path / "mlruns"))
    board, client, run = read_back(str(tmp_path / "tb"), str(tmp_path / "mlruns"))
    check(board, client, run, 12)
    import json

    sha = [json.load(open(tmp_path / name / "summary.json"))["generator_sha256"] for name in ("plain", "tracked")]
    assert sha[0] == sha[1]


@pytest.mark.slow
def test_mdgan_local_tracks_from_the_server(tmp_path, mnist_root):
    mdgan("local", "--dataset", "mnist", "--data-root", mnist_root, *TRAINING, "--out", str(tmp_path / "run"),
          "--tensorboard", str(tmp_path / "tb"), "--mlflow", str(tmp_path / "mlruns"))
    board, client, run = read_back(str(tmp_path / "tb"), str(tmp_path / "mlruns"))
    check(board, client, run, 12)


@pytest.mark.slow
def test_a_tracking_server_that_is_not_there_never_stops_the_run(tmp_path):
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        nowhere = f"http://127.0.0.1:{closed.getsockname()[1]}"
    result = mdgan("simulate", "--dataset", "synthetic", "--workers", "2", "--iterations", "5", "--batch-size", "8",
                   "--eval-every", "-1", "--no-progress", "--out", str(tmp_path / "run"), "--mlflow", nowhere,
                   env={"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0", "MLFLOW_HTTP_REQUEST_TIMEOUT": "2"})
    assert "5 iterations" in result.stdout
    said = [line for line in result.stderr.splitlines() if nowhere in line]
    assert len(said) == 1 and "training goes on without it" in said[0], result.stderr
    assert "Traceback" not in result.stderr


def test_a_missing_package_is_said_before_anything_runs(tmp_path, monkeypatch):
    import importlib.util

    from mdgan.config import ConfigError
    from mdgan.tracking import Tracking

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "mlflow" else real(name, *a))
    with pytest.raises(ConfigError, match=r"pip install 'mdgan\[tracking\]'"):
        Tracking.open("run", mlflow=str(tmp_path))
