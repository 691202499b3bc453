"""bench/gpu_session.sh, dry-run on this CPU (MDGAN_GPU=cpu): what a GPU loan's commands bring back is one archive at
the top of $OUT, whole even when a command runs out of time, and each step prints as it goes."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tarfile

import pytest

from conftest import DATA_ROOT, REPO


def _session(out, *argv: str) -> str:
    env = dict(os.environ, MDGAN_GPU="cpu", OUT=str(out), PYTHON=sys.executable, MDGAN_DATA_ROOT=DATA_ROOT)
    done = subprocess.run(["bash", "bench/gpu_session.sh", *argv], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


def _members(path) -> dict[str, bytes]:
    with tarfile.open(path) as archive:
        return {m.name: archive.extractfile(m).read() for m in archive.getmembers() if m.isfile()}


@pytest.mark.slow
def test_a_loans_commands_each_bring_back_one_archive_and_print_as_they_go(tmp_path):
    printed = _session(tmp_path / "checks", "checks", "400")
    assert os.listdir(tmp_path / "checks") == ["gpu-session-checks.tar.gz"]  # one file, at the top
    members = _members(tmp_path / "checks" / "gpu-session-checks.tar.gz")
    steps = ("cuda_tests", "bench", "divergence_pwgan_traced")
    assert {f"gpu-session/checks/{n}.txt" for n in ("card", "commit", "steps", *steps)} <= set(members)
    said = members["gpu-session/checks/steps.txt"].decode()
    assert all(re.search(rf"^done {step} in \d+ s", said, re.M) for step in steps), said
    # each step's lines come while it runs, between its start and its end: a bench row (with its run's generator
    # hash), each divergence run's line
    bench = printed[printed.index("start bench"):printed.index("done bench")]
    assert re.search(r"simulate, CPU .* [0-9a-f]{16}$", bench, re.M), bench
    divergence = printed[printed.index("start divergence_pwgan_traced"):printed.index("done divergence_pwgan_traced")]
    assert re.search(r"^  local again +[0-9a-f]{16} ", divergence, re.M), divergence
    assert members["gpu-session/checks/bench.txt"].decode() in printed

    printed = _session(tmp_path / "figure3", "figure3", "240")
    members = _members(tmp_path / "figure3" / "gpu-session-figure3.tar.gz")
    kept = "gpu-session/figure3/figure3-mnist-cnn-5k"
    assert f"{kept}/runs.csv" in members
    assert len([m for m in members if re.fullmatch(rf"{kept}/runs/[^/]+/summary\.json", m)]) == 5

    printed = _session(tmp_path / "short", "checks", "30")  # too short for all: what ran, and what did not
    said = _members(tmp_path / "short" / "gpu-session-checks.tar.gz")["gpu-session/checks/steps.txt"].decode()
    assert "skip divergence_pwgan_traced (no time left)" in said and "skip divergence_pwgan_traced" in printed
