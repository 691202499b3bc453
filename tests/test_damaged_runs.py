"""A run's folder that was damaged (a truncated copy, another program's file, a hand edit) is refused by the commands
that read one (`mdgan score`, `sample`, `audit`, `traffic`, `mdgan.load_run`, and `--resume` of a stopped run) in one
line naming the file, with exit status 2, never a traceback, and nothing is written into it."""

from __future__ import annotations

import os
import re
import shutil

import pytest
import torch

from mdgan.config import ConfigError
from mdgan.sampling import load_run

RUN = ["--workers", "2", "--iterations", "4", "--dataset", "synthetic", "--max-samples", "100", "--eval-every", "-1",
       "--no-progress", "--save-discriminators"]
SMALL_AUDIT = ["--members", "20", "--nonmembers", "20", "--generated", "50", "--bootstrap", "5"]


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    from mdgan_app.cli import main

    out = tmp_path_factory.mktemp("finished") / "run"
    assert main(["simulate", *RUN, "--out", str(out)]) == 0
    return out


def _truncate(path: str, keep: int = 1000) -> None:
    with open(path, "rb") as fh:
        head = fh.read(keep)
    with open(path, "wb") as fh:
        fh.write(head)


def _write(path: str, text: str) -> None:
    with open(path, "w", encoding="utf-8") as fh:
        fh.write(text)


UNREADABLE = r"checkpoint.pt: unreadable checkpoint, truncated or not written by mdgan"
DAMAGES = {  # what is damaged: (the file, how, what the refusal says)
    "checkpoint truncated": ("checkpoint", lambda run: _truncate(os.path.join(run, "checkpoint.pt")),
                             UNREADABLE + r" \(RuntimeError: "),
    "checkpoint of random bytes": ("checkpoint", lambda run: _write(os.path.join(run, "checkpoint.pt"), "garbage"),
                                   UNREADABLE + r" \(UnpicklingError\)"),
    "checkpoint of another shape": ("checkpoint", lambda run: torch.save([1, 2], os.path.join(run, "checkpoint.pt")),
                                    r"checkpoint.pt: not a run's generator checkpoint \(TypeError"),
    "summary not JSON": ("summary", lambda run: _write(os.path.join(run, "summary.json"), "{"),
                         r"summary.json: not a run's summary \(not JSON"),
    "summary without its config": ("summary", lambda run: _write(os.path.join(run, "summary.json"), "[1, 2]"),
                                   r"summary.json: not a run's summary \(no config\)"),
    "discriminators truncated": ("discriminators", lambda run: _truncate(os.path.join(run, "discriminators.pt")),
                                 r"discriminators.pt: unreadable checkpoint"),
    "discriminators of another program": (
        "discriminators", lambda run: torch.save({"x": 1}, os.path.join(run, "discriminators.pt")),
        r"discriminators.pt: not the discriminators a run keeps"),
    "a discriminator of another network": (
        "discriminators", lambda run: torch.save({"discriminators": {"worker-0": {"a": torch.zeros(2)}}},
                                                 os.path.join(run, "discriminators.pt")),
        r"worker-0's kept discriminator is not this run's network: .*Unexpected key\(s\) in state_dict: \"a\""),
    "a history line not JSON": ("history", lambda run: _append(os.path.join(run, "history.jsonl"), '{"iteration":\n'),
                                r"history.jsonl line 5: not a run's record"),
}
# which commands read which file
READERS = {"checkpoint": ["score", "sample", "audit"], "summary": ["audit", "traffic"],
           "discriminators": ["audit"], "history": ["traffic"]}
CASES = [pytest.param(damage, command, message, id=f"{command}-{damage.replace(' ', '-')}")
         for damage, (file, _, message) in DAMAGES.items() for command in READERS[file]]


def _append(path: str, text: str) -> None:
    with open(path, "a", encoding="utf-8") as fh:
        fh.write(text)


@pytest.mark.parametrize("damage, command, message", CASES)
def test_a_damaged_run_is_refused_in_one_line_and_left_as_it_was(tmp_path, capsys, finished_run, damage, command,
                                                                  message):
    from mdgan_app.cli import main

    run = str(tmp_path / "run")
    shutil.copytree(finished_run, run)
    if command == "traffic":  # (the counters `mdgan local` leaves, which traffic reads after the history)
        os.makedirs(os.path.join(run, "metrics"))
        _write(os.path.join(run, "metrics", "server.prom"), "")
    DAMAGES[damage][1](run)
    before = sorted(os.listdir(run))
    extra = {"sample": ["--out", str(tmp_path / "samples.png")], "audit": SMALL_AUDIT}.get(command, [])
    code = main([command, run, *extra])
    err = capsys.readouterr().err
    lines = [line for line in err.strip().splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, err
    assert re.search(message, lines[0]), lines[0]
    assert sorted(os.listdir(run)) == before and not os.path.exists(tmp_path / "samples.png")


def test_load_run_refuses_a_damaged_run_with_a_config_error(tmp_path, finished_run):
    run = str(tmp_path / "run")
    shutil.copytree(finished_run, run)
    assert load_run(run).config.workers == 2
    _write(os.path.join(run, "summary.json"), '{"config": {"workers": "two", "model": 5}}')
    with pytest.raises(ConfigError, match=r"summary.json: not a run's config"):
        load_run(run)


def test_a_simulated_run_records_where_its_data_is_from_anywhere(tmp_path, monkeypatch, finished_run):
    """`mdgan audit` recovers a run's members from the data it records: a relative --data-root is recorded as the
    folder it named, so that an audit from another folder finds it."""
    from mdgan_app.cli import main

    monkeypatch.chdir(tmp_path)
    os.makedirs("data")
    assert main(["simulate", *RUN, "--data-root", "data", "--out", "run"]) == 0
    summary = load_run("run").summary
    assert summary["data"]["data_root"] == str(tmp_path / "data")


def _files(folder) -> dict[str, bytes]:
    found = {}
    for root, _, names in os.walk(folder):
        for name in names:
            with open(os.path.join(root, name), "rb") as fh:
                found[os.path.relpath(os.path.join(root, name), folder)] = fh.read()
    return found


@pytest.fixture(scope="module")
def stopped_run(tmp_path_factory):
    """A run with checkpoints whose end was not recorded (its summary.json gone): what --resume continues."""
    from mdgan_app.cli import main

    out = tmp_path_factory.mktemp("stopped") / "run"
    assert main(["simulate", "--workers", "2", "--iterations", "6", "--dataset", "synthetic", "--eval-every", "-1",
                 "--no-progress", "--checkpoint-every", "2", "--out", str(out)]) == 0
    os.remove(out / "summary.json")
    return out


def _latest_server_checkpoint(run: str) -> str:
    latest = max(os.listdir(os.path.join(run, "checkpoints")))
    return os.path.join(run, "checkpoints", latest, "server.pt")


def _identity(run: str, change) -> None:
    import json

    path = os.path.join(run, "run_identity.json")
    with open(path, encoding="utf-8") as fh:
        identity = json.load(fh)
    change(identity)
    _write(path, json.dumps(identity))


def _other_runs_checkpoint(run: str) -> None:
    path = _latest_server_checkpoint(run)
    state = torch.load(path, weights_only=True)
    state["run_id"] = "another"
    torch.save(state, path)


RESUME_DAMAGES = {
    "identity not JSON": (lambda run: _write(os.path.join(run, "run_identity.json"), "{"),
                          r"run_identity.json: not a run's identity \(not JSON"),
    "identity without a run": (lambda run: _write(os.path.join(run, "run_identity.json"), "[1]"),
                               r"run_identity.json: not a run's identity \(no run_id and config\)"),
    "identity's config damaged": (lambda run: _identity(run, lambda d: d["config"].update(workers="two")),
                                  r"run_identity.json: not a run's identity \(its config: TypeError"),
    "identity's config out of range": (lambda run: _identity(run, lambda d: d["config"].update(batch_size=-3)),
                                       r"run_identity.json: not a run's identity \(its config: ConfigError: "
                                       r"batch_size must be at least 1"),
    "latest checkpoint truncated": (lambda run: _truncate(_latest_server_checkpoint(run)),
                                    r"server.pt: unreadable checkpoint, truncated or not written by mdgan \(.*\); "
                                    r"to resume from the checkpoint before "
                                    r"it, remove .*checkpoints/000000006$"),
    "latest checkpoint another run's": (_other_runs_checkpoint,
                                        r"checkpoint 6 in .* belongs to run 'another', not to this run"),
}


def test_a_stopped_run_resumes(tmp_path, stopped_run):
    from mdgan_app.cli import main

    run = str(tmp_path / "run")
    shutil.copytree(stopped_run, run)
    assert main(["simulate", "--resume", run, "--no-progress"]) == 0
    assert load_run(run).summary["iterations"] == 6


@pytest.mark.parametrize("damage", list(RESUME_DAMAGES))
def test_resuming_a_damaged_run_is_refused_in_one_line_and_leaves_it_as_it_was(tmp_path, capsys, stopped_run,
                                                                                damage):
    from mdgan_app.cli import main

    run = str(tmp_path / "run")
    shutil.copytree(stopped_run, run)
    change, message = RESUME_DAMAGES[damage]
    change(run)
    before = _files(run)
    code = main(["simulate", "--resume", run, "--no-progress"])
    err = capsys.readouterr().err
    lines = [line for line in err.strip().splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, err
    assert re.search(message, lines[0]), lines[0]
    assert _files(run) == before


def test_more_samples_than_memory_holds_are_refused_in_one_line(tmp_path, capsys, finished_run):
    """`mdgan sample --n` past what the machine can hold (a billion samples: about 3.5 TB): one line saying how
    much they need, not the allocator's traceback, and no file."""
    from mdgan_app.cli import main

    code = main(["sample", str(finished_run), "--n", "1000000000", "--out", str(tmp_path / "many.npy")])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err, err
    assert re.search(r"--n 1,000,000,000: not enough memory to draw that many samples at once \(about 3536.0 GB\)",
                     err), err
    assert not os.listdir(tmp_path)


def test_a_run_trained_on_cuda_resumes_on_a_machine_without_one(tmp_path, stopped_run):
    """The device is each process's own: a run's identity naming cuda:7 is a run's identity on any machine."""
    from mdgan.checkpoint import read_identity

    run = str(tmp_path / "run")
    shutil.copytree(stopped_run, run)
    _identity(run, lambda d: d["config"].update(device="cuda:7"))
    assert read_identity(run)["config"]["device"] == "cuda:7"
