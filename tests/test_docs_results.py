"""The tables that docs/RESULTS.md shows from kept runs are the tables those runs give (never pasted and
left stale), and `experiments/tables.py --into` rewrites exactly its own block."""

import importlib.util
import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(REPO, "docs", "RESULTS.md")


def _tables():
    spec = importlib.util.spec_from_file_location("tables", os.path.join(REPO, "experiments", "tables.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _documents() -> list[str]:
    """docs/RESULTS.md and the README of every experiment's folder in docs/results/."""
    import glob

    return [RESULTS, *sorted(glob.glob(os.path.join(REPO, "docs", "results", "**", "README.md"), recursive=True))]


def _blocks():
    found = []
    for path in _documents():
        with open(path, encoding="utf-8") as fh:
            found += [(argv, shown, os.path.relpath(path, REPO)) for argv, shown in _tables().generated_blocks(fh.read())]
    return found


def test_results_has_generated_blocks():
    assert _blocks(), "docs/RESULTS.md and docs/results/ show no table generated from kept runs"


@pytest.mark.parametrize("argv, shown, document", _blocks(),
                         ids=lambda v: " ".join(v) if isinstance(v, list) else "")
def test_every_generated_table_is_what_its_command_gives(argv, shown, document):
    tables = _tables()
    args = tables.parser().parse_args(argv)
    assert args.into == document, f"{document}: a block whose command writes into {args.into}"
    args.keep = os.path.join(REPO, args.keep)
    assert shown == tables.render(args), f"{document}'s tables are stale: python experiments/tables.py {' '.join(argv)}"


def test_into_replaces_only_its_own_block(tmp_path):
    keep = os.path.join("docs", "results", "figure3-mnist-mlp")
    document = tmp_path / "doc.md"
    mine = f"{keep} --at 10000 50000 --tables scores runs --compare 'MD-GAN k=1|standalone b=10' --into {document}"
    # the same folder with other arguments is another block, left alone
    other = f"<!-- generated: python experiments/tables.py {keep} --tables runs --into {document} -->\nuntouched\n<!-- /generated -->\n"
    document.write_text(f"# title\n\n<!-- generated: python experiments/tables.py {mine} -->\nold table\n"
                        f"<!-- /generated -->\n\n{other}tail\n")
    subprocess.run([sys.executable, "experiments/tables.py", keep, "--at", "10000", "50000", "--tables", "scores",
                    "runs", "--compare", "MD-GAN k=1|standalone b=10", "--into", str(document)], cwd=REPO, check=True)
    text = document.read_text()
    assert "old table" not in text and text.startswith("# title\n") and text.endswith(f"\n{other}tail\n")
    (argv, shown), _ = _tables().generated_blocks(text)
    assert argv[:3] == [keep, "--at", "10000"]
    assert "| setting | seeds | at 10,000 | at 50,000 |" in shown and "| mdgan-N10-b10-k1-seed0 | MD-GAN k=1 |" in shown
    assert "FID on 500 samples minus" not in shown  # not asked for
    # a command without its block in the document is refused, and the document left as it was
    missing = subprocess.run([sys.executable, "experiments/tables.py", keep, "--into", str(document)],
                             cwd=REPO, capture_output=True, text=True)
    assert missing.returncode != 0 and "no block" in missing.stderr
    assert document.read_text() == text
    # --refresh renders every block again by its own command
    document.write_text(text.replace("| MD-GAN k=1 |", "| stale |", 1))
    subprocess.run([sys.executable, "experiments/tables.py", "--refresh", str(document)], cwd=REPO, check=True)
    refreshed = _tables().generated_blocks(document.read_text())
    assert refreshed[0][1] == shown and "untouched" not in refreshed[1][1] and "| run | label |" in refreshed[1][1]


def test_compare_counts_where_one_setting_leads_over_the_means_of_its_seeds():
    def run(label, seed, fids):
        return {"run": {"label": label, "seed": seed}, "evaluations": {
            1000 * (i + 1): {"fid": fid, "mnist_score": 10 - fid / 100} for i, fid in enumerate(fids)}}

    # A's seeds average 100, 60, 40, 30; B's one seed 90, 80, 35, 20; a seed of A without 4,000 leaves it out
    runs = [run("A", 0, [110, 50, 30, 30]), run("A", 1, [90, 70, 50, 30]), run("B", 0, [90, 80, 35, 20])]
    table = _tables().compare_table(runs, [("A", "B"), ("B", "A")], last=2)
    rows = [line.split(" | ") for line in table.splitlines()[2:]]
    assert rows[0][2:4] == ["1 of 4", "1 of 4"]  # ahead at 2,000 only, not at the end
    assert rows[0][4] == "35.0, 27.5" and rows[0][5].startswith("9.65, 9.7")  # B's: 9.725
    assert rows[1][2] == "3 of 4 (all from 3,000 on)"
    runs[1]["evaluations"].pop(4000)
    assert _tables().compare_table(runs, [("A", "B")], last=2).splitlines()[2].split(" | ")[2] == "1 of 3"


def test_time_to_a_fid_averages_the_seeds_and_names_a_seed_that_never_reached_it():
    def run(label, seed, fids):
        return {"run": {"label": label, "seed": seed}, "evaluations": {
            1000 * (i + 1): {"fid": fid, "train_seconds": 60.0 * (i + 1)} for i, fid in enumerate(fids)}}

    runs = [run("A", 0, [90, 40, 20]), run("A", 1, [45, 30, 30]), run("B", 0, [80, 60, 45])]
    table = _tables().time_to_fid(runs, [50, 25], {"A": 0.5}, {"A": 120.0})
    a, b = (line.split(" | ") for line in table.splitlines()[2:])
    # A reaches 50 at 2,000 and 1,000: 1,500 at 120 ms = 3 min; one seed never reaches 25
    assert a[2] == "1,500 (2,000, 1,000): 3 min at 120 ms, 2 min as services"
    assert a[3] == "not reached (seed 1) |"
    assert b[2] == "3,000: 3 min measured"  # its own training time to that evaluation


def test_scores_show_the_spread_over_seeds_and_a_single_seed_as_its_value():
    def run(label, seed, fid):
        return {"run": {"label": label, "seed": seed, "eval_samples": 500},
                "evaluations": {1000: {"fid": fid, "mnist_score": 9.0 + seed}}}

    tables = _tables()
    runs = [run("A", 0, 30.0), run("A", 1, 34.0), run("B", 0, 50.0)]
    block = tables.score_block(runs, [1000])
    a, b = (line for line in block.splitlines() if line.startswith(("| A ", "| B ")))
    assert a == "| A | 0, 1 | 9.50 +- 0.71 (9.00, 10.00) / 32.0 +- 2.8 (30.0, 34.0) |"
    assert b == "| B | 0 | 9.00 / 50.0 |"
    assert "mean +- std over the seeds" in block
    assert "mean +- std" not in tables.score_block(runs[2:], [1000])  # one seed each: no spread to speak of


def _kept_folders():
    """(kept folder, the experiment config that keeps into it) for every docs/results folder with kept runs."""
    from mdgan_app.experiment import load_config

    configs = {}
    for name in sorted(os.listdir(os.path.join(REPO, "experiments"))):
        if name.endswith(".yaml"):
            configs[load_config(os.path.join(REPO, "experiments", name))["name"]] = name
    results = os.path.join(REPO, "docs", "results")
    return [(folder, configs.get(folder)) for folder in sorted(os.listdir(results))
            if os.path.isdir(os.path.join(results, folder, "runs"))]


@pytest.mark.parametrize("folder, config", _kept_folders(), ids=lambda v: v or "")
def test_every_kept_run_is_a_run_of_its_experiment_with_its_settings(folder, config):
    """What `--keep` restores: a kept run the config no longer gives, or gives other settings, would be
    refused (or left out of the tables) when someone resumes the experiment from the docs."""
    from mdgan_app.experiment import _trained, expand, load_config

    assert config, f"docs/results/{folder} keeps runs, but no experiments/*.yaml is named {folder}"
    runs = {run["name"]: run for run in expand(load_config(os.path.join(REPO, "experiments", config)))}
    kept = os.path.join(REPO, "docs", "results", folder, "runs")
    for name in sorted(os.listdir(kept)):
        assert name in runs, f"docs/results/{folder}/runs/{name} is not a run of experiments/{config}"
        with open(os.path.join(kept, name, "run.json"), encoding="utf-8") as fh:
            assert _trained(json.load(fh)) == _trained(runs[name]), f"{folder}/{name} has other settings"
        assert os.path.exists(os.path.join(kept, name, "summary.json")), f"{folder}/{name} is not finished"
