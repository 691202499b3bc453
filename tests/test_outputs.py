"""docs/OUTPUTS.md against a real run: every field summary.json and history.jsonl write is listed, and
every field listed is written by some run."""

from __future__ import annotations

import json
import os
import re

from conftest import REPO


def documented(section: str) -> set[str]:
    with open(os.path.join(REPO, "docs", "OUTPUTS.md")) as fh:
        text = fh.read()
    body = text.split(f"## {section}")[1].split("\n## ")[0]
    names = set()
    for row in body.splitlines():
        if row.startswith("| `"):
            names |= set(re.findall(r"`([a-z_0-9]+)`", row.split(" | ")[0]))
    return names


def test_every_field_a_run_writes_is_documented(tmp_path):
    from mdgan.config import DataConfig, TrainingConfig
    from mdgan.run import EvaluationOptions
    from mdgan.simulation import Durability, simulate

    config = TrainingConfig(workers=2, iterations=4, batch_size=8, swap_every=2).validate()
    summary = simulate(config, DataConfig("synthetic"), str(tmp_path), progress=False,
                       evaluation=EvaluationOptions(every=-1), durability=Durability(checkpoint_every=2))
    with open(tmp_path / "history.jsonl") as fh:
        history = [json.loads(line) for line in fh]
    assert set(summary) - documented("summary.json") == set()
    assert set().union(*history) - documented("history.jsonl (one line per iteration)") == set()
    with open(os.path.join(REPO, "docs", "OUTPUTS.md")) as fh:
        files = fh.read().split("## Files")[1].split("\n## ")[0]
    for name in os.listdir(tmp_path):  # every file or folder the run left, in the table of files
        assert f"| `{name}`" in files or f"| `{name}/" in files, name
    # what the services add: message_bytes, exit_codes (mdgan local); what scores add: eval fields
    assert {"message_bytes", "exit_codes", "pwgan", "psgan"} <= documented("summary.json")
    assert {"eval_iteration", "mnist_score", "fid", "evaluations"} <= documented("history.jsonl (one line per iteration)")
