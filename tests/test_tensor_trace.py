"""mdgan/tensor_trace.py: with MDGAN_TRACE_DIR set, a run records each network's forward outputs, gradients and
weights after each step, network by network, whatever the number of processes; two runs' records part exactly where
their computations do. Off, it hooks nothing and writes nothing."""

import copy
import os
import subprocess
import sys

import torch

from conftest import REPO
from mdgan import tensor_trace

FLAGS = ["--algorithm", "pwgan", "--workers", "2", "--iterations", "3", "--batch-size", "8", "--disc-steps", "2",
         "--gradient-penalty", "5", "--dataset", "synthetic", "--no-progress"]


def _run(command: str, out, trace, *extra: str) -> None:
    done = subprocess.run([sys.executable, "-m", "mdgan_app.cli", command, *FLAGS, *extra, "--out", str(out)],
                          cwd=REPO, capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, **{tensor_trace.ENVIRONMENT: str(trace)}))
    assert done.returncode == 0, done.stderr[-3000:]


def test_local_records_what_simulate_records_network_by_network(tmp_path):
    """P-WGAN in one process and as a server and two worker processes over gRPC with TLS: the same records of G and
    of each critic, in the same order (each process writes its own file)."""
    _run("simulate", tmp_path / "simulate", tmp_path / "simulate-trace")
    _run("local", tmp_path / "local", tmp_path / "local-trace")
    one, many = tensor_trace.read(tmp_path / "simulate-trace"), tensor_trace.read(tmp_path / "local-trace")
    assert len(os.listdir(tmp_path / "simulate-trace")) == 1 and len(os.listdir(tmp_path / "local-trace")) == 3
    assert sorted(one) == ["D0", "D1", "G"]
    assert {r["kind"] for r in one["D0"]} == {"forward", "gradient", "weight"}
    assert tensor_trace.first_differences(one, many) == {"D0": "", "D1": "", "G": ""}
    assert [r["sha256"] for r in one["D1"]] == [r["sha256"] for r in many["D1"]]


def test_two_runs_part_at_the_first_tensor_that_differs(tmp_path):
    """Only the critics' learning rate differs: each critic's records agree up to its first step's weights (its
    forward passes and gradients before it agree), and G's up to the first gradient the critics' feedback gives it."""
    _run("simulate", tmp_path / "a", tmp_path / "a-trace")
    _run("simulate", tmp_path / "b", tmp_path / "b-trace", "--disc-lr", "0.001")
    a, b = tensor_trace.read(tmp_path / "a-trace"), tensor_trace.read(tmp_path / "b-trace")
    found = tensor_trace.first_differences(a, b)
    for critic in ("D0", "D1"):
        first = next(i for i, (x, y) in enumerate(zip(a[critic], b[critic])) if x["sha256"] != y["sha256"])
        assert a[critic][first]["kind"] == "weight" and first > 0, found[critic]
        assert {r["kind"] for r in a[critic][:first]} == {"forward", "gradient"}
        assert found[critic].startswith(f"record {first + 1}: weight ")
    assert found["G"].startswith("record ") and " gradient " in found["G"], found["G"]


def test_off_it_hooks_nothing(monkeypatch):
    monkeypatch.delenv(tensor_trace.ENVIRONMENT, raising=False)
    network = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Tanh())
    tensor_trace.watch(network, "G")
    assert not any(m._forward_hooks for m in network.modules())
    assert not any(p._post_accumulate_grad_hooks for p in network.parameters())


def test_a_copy_of_a_watched_network_records_nothing(tmp_path, monkeypatch):
    """The evaluator scores snapshots of G in a thread of its own: their forward passes are not G's records."""
    monkeypatch.setenv(tensor_trace.ENVIRONMENT, str(tmp_path / "trace"))
    network = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Tanh())
    tensor_trace.watch(network, "copied")
    network(torch.ones(1, 3)).sum().backward()
    before = tensor_trace.read(tmp_path / "trace")["copied"]
    snapshot = copy.deepcopy(network)
    snapshot(torch.ones(1, 3)).sum().backward()
    assert [r["kind"] for r in before] == ["forward", "forward", "forward", "gradient", "gradient"]
    assert tensor_trace.read(tmp_path / "trace")["copied"] == before
