"""The tables that docs/RESULTS.md shows from kept runs are the tables those runs give (never pasted and
left stale), and `experiments/tables.py --into` rewrites exactly its own block."""

import importlib.util
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


def _blocks():
    with open(RESULTS, encoding="utf-8") as fh:
        return _tables().generated_blocks(fh.read())


def test_results_has_generated_blocks():
    assert [keep for keep, _, _ in _blocks()], "docs/RESULTS.md shows no table generated from kept runs"


@pytest.mark.parametrize("keep, iterations, shown", _blocks(), ids=lambda v: v if isinstance(v, str) and "/" in v else "")
def test_every_generated_table_is_what_its_kept_runs_give(keep, iterations, shown):
    tables = _tables()
    regenerated = tables.score_block(tables.load(os.path.join(REPO, keep)), iterations)
    assert shown == regenerated, (f"docs/RESULTS.md's tables of {keep} are stale: "
                                  f"python experiments/tables.py {keep} --at {' '.join(map(str, iterations))} --into docs/RESULTS.md")


def test_into_replaces_only_the_block_of_its_keep_folder(tmp_path):
    keep = os.path.join("docs", "results", "figure3-mnist-mlp")
    document = tmp_path / "doc.md"
    other = "<!-- generated: python experiments/tables.py docs/results/elsewhere --at 5 -->\nuntouched\n<!-- /generated -->\n"
    document.write_text(f"# title\n\n<!-- generated: python experiments/tables.py {keep} --at 10000 50000 "
                        f"--into doc.md -->\nold table\n<!-- /generated -->\n\n{other}tail\n")
    subprocess.run([sys.executable, "experiments/tables.py", keep, "--at", "10000", "50000", "--into", str(document)],
                   cwd=REPO, check=True)
    text = document.read_text()
    assert "old table" not in text and text.startswith("# title\n") and text.endswith(f"\n{other}tail\n")
    (block_keep, iterations, shown), _ = _tables().generated_blocks(text)
    assert (block_keep, iterations) == (keep, [10000, 50000])
    assert "| setting | seeds | at 10,000 | at 50,000 |" in shown and "MD-GAN k=1" in shown
    # a document without a block for that folder is refused, and left as it was
    missing = subprocess.run([sys.executable, "experiments/tables.py", "docs/results/figure3-mnist-mlp-probes",
                              "--into", str(document)], cwd=REPO, capture_output=True, text=True)
    assert missing.returncode != 0 and "no block" in missing.stderr
    assert document.read_text() == text


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
