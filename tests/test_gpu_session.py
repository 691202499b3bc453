"""bench/gpu_session.sh, dry-run on this CPU (MDGAN_GPU=cpu): what a GPU loan's commands bring back is one archive at
the top of $OUT, whole even when a command runs out of time, and each step prints as it goes."""

from __future__ import annotations

import os
import pathlib
import re
import shutil
import subprocess
import sys
import tarfile

import pytest

from conftest import DATA_ROOT, REPO


def _session(out, *argv: str, **extra: str) -> str:
    env = dict(os.environ, MDGAN_GPU="cpu", OUT=str(out), PYTHON=sys.executable, MDGAN_DATA_ROOT=DATA_ROOT, **extra)
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


    printed = _session(tmp_path / "short", "checks", "30")  # too short for all: what ran, and what did not
    said = _members(tmp_path / "short" / "gpu-session-checks.tar.gz")["gpu-session/checks/steps.txt"].decode()
    assert "skip divergence_pwgan_traced (no time left)" in said and "skip divergence_pwgan_traced" in printed


def _keep(archive, results) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "bench/gpu_keep.sh", str(archive), str(results)], cwd=REPO, capture_output=True,
                          text=True, timeout=60)


def _tree(folder) -> dict[str, bytes]:
    return {str(path.relative_to(folder)): path.read_bytes() for path in pathlib.Path(folder).rglob("*")
            if path.is_file()}


@pytest.mark.slow
def test_a_figure_grows_loan_by_loan_from_what_was_committed(tmp_path):
    """A loan's figure3 archive, put into the results folder (bench/gpu_keep.sh) and committed, is where the next
    loan starts: its runs are not run again, the others are, and the folder records each loan."""
    results, name = tmp_path / "results", "figure3-mnist-cnn-5k"
    printed = _session(tmp_path / "first", "figure3", "240")
    assert os.listdir(tmp_path / "first") == ["gpu-session-figure3.tar.gz"]
    members = _members(tmp_path / "first" / "gpu-session-figure3.tar.gz")
    inside = f"gpu-session/figure3/{name}"
    assert f"{inside}/runs.csv" in members and f"{inside}/loans.txt" in members
    assert len([m for m in members if re.fullmatch(rf"{inside}/runs/[^/]+/summary\.json", m)]) == 5
    assert re.search(r"^done figure3 in \d+ s", members["gpu-session/figure3/steps.txt"].decode(), re.M)
    assert "mdgan experiment: probed flgan-N10-b10-k1: " in printed  # each run's estimate, then what starts
    kept = _keep(tmp_path / "first" / "gpu-session-figure3.tar.gz", results)
    assert kept.returncode == 0 and "5 runs in" in kept.stdout, kept.stderr
    figure = results / name
    # as if the first loan had ended before two of its runs: only three were committed
    for run in ("flgan-N10-b10-k1", "mdgan-N10-b10-k3"):
        shutil.rmtree(figure / "runs" / run)
    before = _tree(figure / "runs")
    (figure / "large.bin").write_bytes(os.urandom(17 << 20))  # an archive too large to come back is said so
    env = {"MDGAN_FIGURE_KEPT": str(figure)}
    printed = _session(tmp_path / "second", "figure3", "240", **env)
    assert "figure3: 3 runs kept by earlier loans" in printed
    assert re.search(r"WARNING: \S+gpu-session-figure3.tar.gz is \d+ bytes, over the 16777216 a file", printed)
    assert sorted(re.findall(r"^mdgan experiment: start (\S+):", printed, re.M)) == ["flgan-N10-b10-k1",
                                                                                     "mdgan-N10-b10-k3"]
    assert _keep(tmp_path / "second" / "gpu-session-figure3.tar.gz", results).returncode == 0
    after = _tree(figure / "runs")
    assert {k: after[k] for k in before} == before  # the committed runs, byte for byte
    assert len([p for p in after if p.endswith("summary.json")]) == 5
    loans = (figure / "loans.txt").read_text().splitlines()
    assert len(loans) == 2 and all(re.search(r"done figure3 in \d+ s .*; 5 runs kept$", line) for line in loans)
    assert any(n.endswith("-figure3.txt") for n in os.listdir(figure / "loans"))
    # an archive that is not a figure's is refused, and the results are left as they were
    other = tmp_path / "gpu-session-checks.tar.gz"
    with tarfile.open(other, "w:gz") as archive:
        archive.add(tmp_path / "first", arcname="gpu-session/checks")
    refused = _keep(other, results)
    assert refused.returncode == 2 and "not the archive of a figure3 loan" in refused.stderr
    assert _tree(figure / "runs") == after


def test_the_tree_a_loan_sends_leaves_room_for_what_gpu_prepare_adds():
    """A loan sends the tracked tree and the wheels and MNIST of ../shared/tools/gpu_prepare.sh (25 MB, it says), 64
    MiB at most (docs/GPU.md): a tree that grew past the rest would start no loan at all."""
    sys.path.insert(0, os.path.join(REPO, "bench"))
    from loan_state import PREPARED, TREE_OUT, tracked_tree_bytes

    assert tracked_tree_bytes() + PREPARED < TREE_OUT
