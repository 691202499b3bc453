"""bench/wide_area_table.py's report: a configuration's time to an FID is the iterations its seeds' runs
needed, divided by its rate over the link, and the kept table in docs/results/wide-area-latency is the one
its kept rates and scores give (never pasted and left stale)."""

from __future__ import annotations

import argparse
import csv
import json
import os
import subprocess
import sys

import pytest

from conftest import REPO

sys.path.insert(0, os.path.join(REPO, "bench"))
import wide_area_table  # noqa: E402

KEPT = os.path.join(REPO, "docs", "results", "wide-area-latency")


def write_scores(folder, curves: dict[str, dict[int, list[tuple[int, float]]]]) -> None:
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "results.csv"), "w", newline="") as fh:
        out = csv.DictWriter(fh, ["run", "label", "seed", "iteration", "fid"])
        out.writeheader()
        for label, seeds in curves.items():
            for seed, curve in seeds.items():
                for iteration, fid in curve:
                    out.writerow({"run": f"{label}-{seed}", "label": label, "seed": seed, "iteration": iteration,
                                  "fid": fid})


def rate(updates_per_second: float) -> dict:
    return {"updates_per_second": updates_per_second, "load": [0.5, 1.5]}


def report(tmp_path, rates: dict, curves: dict, fids=(100.0, 50.0)) -> list[str]:
    write_scores(tmp_path / "scores", curves)
    (tmp_path / "rates.json").write_text(json.dumps({"setting": {"depth": 4}, "rates": rates}))
    args = argparse.Namespace(out=str(tmp_path), scores=[str(tmp_path / "scores")], fids=list(fids))
    return wide_area_table.report(args).splitlines()


def row(lines: list[str], label: str, rtt: str) -> list[str]:
    found = [line.strip("| ").split(" | ") for line in lines if line.startswith(f"| {label} | {rtt} |")]
    assert len(found) == 1, lines
    return found[0]


def test_time_to_an_fid_is_the_seeds_iterations_over_the_rate_over_that_link(tmp_path):
    curves = {
        # seed 0 reaches FID 100 at 6,000, seed 1 at 3,000; neither reaches 50
        "MD-GAN all": {0: [(3000, 180.0), (6000, 95.0)], 1: [(3000, 100.0), (6000, 70.0)]},
        # one seed of two reaches 100 (at 6,000), and 50 (at 9,000)
        "MD-GAN depth 4": {0: [(3000, 400.0), (6000, 90.0), (9000, 50.0)], 1: [(3000, 500.0), (9000, 120.0)]},
    }
    rates = {"100mbit 0ms": {"mdgan-all": rate(20.0), "mdgan-pipeline": rate(25.0), "mdgan-quorum": rate(10.0)},
             "100mbit 80ms": {"mdgan-all": rate(5.0), "mdgan-pipeline": rate(20.0)}}
    # a check over the 80 ms link: seed 0 reached FID 100 at 6,000 in 1,150 s, against 6,000 / 5 = 1,200 predicted
    (tmp_path / "checks").mkdir()
    (tmp_path / "checks" / "mdgan-all.json").write_text(json.dumps(
        {"config": "mdgan-all", "cell": "100mbit 80ms", "seed": 0, "fid": 100.0, "predicted_iteration": 6000,
         "iteration": 6000, "seconds": 1150.4, "fids_as_scored": [True] * 12}))
    lines = report(tmp_path, rates, curves)
    assert row(lines, "mdgan-all", "100mbit 80ms") == ["mdgan-all", "100mbit 80ms", "0", "100.0", "6000 (6000)",
                                                       "1150", "1200", "yes (12)"]
    # 4,500 iterations on average: 225 s at 20/s, 900 s at 5/s; the seeds' 300 and 150 s, 1,200 and 600 s
    assert row(lines, "mdgan-all", "0ms")[2:7] == ["20.00", "1.00", "1.00", "3.8 min (+- 1.8 min, 2 of 2)", "-"]
    assert row(lines, "mdgan-all", "80ms")[2:6] == ["5.00", "0.25", "0.25", "15.0 min (+- 7.1 min, 2 of 2)"]
    # against its own rate without delay, and the paper's protocol's
    assert row(lines, "mdgan-pipeline", "80ms")[2:7] == ["20.00", "0.80", "1.00", "5.0 min (1 of 2)",
                                                         "7.5 min (1 of 2)"]
    # quorum's iterations are all's: an estimate, so marked, and never "first"
    assert row(lines, "mdgan-quorum", "0ms")[5].startswith("~7.5 min")
    first = "of the configurations whose every seed reaches it"
    assert f"- first to FID 100 at 0ms: mdgan-all (3.8 min; {first})" in lines
    assert f"- first to FID 100 at 80ms: mdgan-all (15.0 min; {first})" in lines
    assert not any(line.startswith("- first to FID 50") for line in lines)  # no configuration's every seed got there
    assert "- MD-GAN depth 4 (scores, to 9,000): FID 100: 6000, -; FID 50: 9000, -" in lines


def test_the_summary_has_a_row_per_link_and_brackets_a_time_only_some_seeds_reach(tmp_path):
    curves = {"MD-GAN all": {0: [(3000, 180.0), (6000, 95.0)], 1: [(3000, 100.0), (6000, 70.0)]},
              "parameter-server GAN": {0: [(3000, 120.0), (9000, 90.0)]}}
    write_scores(tmp_path / "scores", curves)
    (tmp_path / "rates.json").write_text(json.dumps({"setting": {"depth": 4}, "rates": {
        "100mbit 0ms": {"mdgan-all": rate(20.0), "flgan": rate(30.0), "psgan": rate(0.5)},
        "10mbit 80ms": {"mdgan-all": rate(5.0)}}}))
    args = argparse.Namespace(out=str(tmp_path), scores=[str(tmp_path / "scores")], fids=[100.0, 80.0])
    lines = wide_area_table.summary(args).splitlines()
    assert lines[2] == ("| every site at | round trip | MD-GAN `all` | MD-GAN, `--pipeline-depth 4` "
                        "| the same, int8 wire | FL-GAN | parameter-server GAN |")
    # all: FID 100 at 6,000 and 3,000 (both seeds: 225 s at 20/s), FID 80 by seed 1 only (6,000: 300 s)
    # psgan: FID 100 at 9,000, 18,000 s at 0.5/s, so the cell is in hours; FID 80 never; FL-GAN: a rate, no runs
    assert lines[4] == "| 100 Mbit/s | 0 ms | 20.0/s; 3.8, (5.0) min | - | - | 30.0/s; not scored | 0.5/s; 5.0, - h |"
    assert lines[5] == "| 10 Mbit/s | 80 ms | 5.0/s; 15.0, (20.0) min | - | - | - | - |"
    assert len(lines) == 6


def test_the_first_scored_iteration_at_or_below_the_threshold_counts():
    curve = [(1000, 300.0), (500, 400.0), (1500, 100.0), (2000, 99.0)]
    assert wide_area_table.first_at(curve, 100.0) == 1500
    assert wide_area_table.first_at(curve, 50.0) is None


@pytest.mark.parametrize("document", [os.path.join(KEPT, "README.md"), os.path.join(KEPT + "-reno", "README.md"),
                                      os.path.join(REPO, "docs", "results", "wide-area-race", "README.md")],
                         ids=["bbr", "reno", "race"])
def test_the_kept_table_is_what_its_kept_rates_and_scores_give(document):
    with open(document, encoding="utf-8") as fh:
        blocks = wide_area_table.BLOCK.findall(fh.read())
    assert blocks, f"{document} shows no generated table"
    for command, shown in blocks:
        given = subprocess.run([sys.executable, *command.split()[1:]], cwd=REPO, capture_output=True, text=True,
                               check=True).stdout
        assert shown.strip("\n") == given.strip("\n"), f"the kept table is stale: {command}"


def test_scores_kept_in_two_experiments_are_read_together_and_a_label_comes_from_the_first_that_scores_it(tmp_path):
    write_scores(tmp_path / "float32", {"MD-GAN depth 4": {0: [(3000, 90.0)]}})
    write_scores(tmp_path / "int8", {"MD-GAN depth 4, int8": {0: [(3000, 200.0), (6000, 80.0)]}})
    (tmp_path / "rates.json").write_text(json.dumps({"setting": {"depth": 4}, "rates": {
        "10mbit 0ms": {"mdgan-pipeline": rate(10.0),
                       "mdgan-pipeline-int8": {**rate(20.0), "training_seconds": 40.0, "swap_seconds": 1.0},
                       "mdgan-pipeline-int8-lag": rate(21.0)}}}))
    args = argparse.Namespace(out=str(tmp_path), scores=[str(tmp_path / "float32"), str(tmp_path / "int8")],
                              fids=[100.0])
    lines = wide_area_table.report(args).splitlines()
    assert row(lines, "mdgan-pipeline", "0ms")[5] == "5.0 min (1 of 1)"  # 3,000 at 10/s
    assert row(lines, "mdgan-pipeline-int8", "0ms")[2:6] == ["20.00", "1.00", "-", "5.0 min (1 of 1)"]  # 6,000 at 20/s
    assert row(lines, "mdgan-pipeline-int8-lag", "0ms")[2:6] == ["21.00", "1.00", "-", "not scored"]  # no runs
    assert "- mdgan-pipeline-int8: share of its training time in swap rounds, the most --swap-lag could hide: " \
           "2.5% at 0ms" in lines
    assert not any(line.startswith("- mdgan-pipeline:") for line in lines)  # not measured: no line
    # a label scored again, by longer runs listed first: every seed of it from those, none from the others
    write_scores(tmp_path / "longer", {"MD-GAN depth 4": {1: [(3000, 300.0), (9000, 95.0)], 2: [(9000, 99.0)]}})
    args.scores.insert(0, str(tmp_path / "longer"))
    lines = wide_area_table.report(args).splitlines()
    assert row(lines, "mdgan-pipeline", "0ms")[5] == "15.0 min (+- 0.0 min, 2 of 2)"  # 9,000 at 10/s, seed 0 left out
    assert "- MD-GAN depth 4 (longer, to 9,000): FID 100: 9000, 9000" in lines
    assert "- MD-GAN depth 4, int8 (int8, to 6,000): FID 100: 6000" in lines


def test_a_rate_leaves_out_the_start_and_the_warm_up_and_counts_the_seconds_in_swaps(tmp_path):
    rows = [{"iteration": i, "seconds": 0.5, "swap_seconds": 0.25 if i % 4 == 0 else 0.0} for i in range(1, 13)]
    (tmp_path / "history.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    got = wide_area_table.steady(str(tmp_path), "mdgan-pipeline", warm_up=1.0)
    # iteration 1 holds the start; 2 and 3 fill the warm-up; 4..12 count: 9 rows of 0.5 s, swaps at 4, 8, 12
    assert got == {"updates_per_second": 2.0, "iterations": 9, "training_seconds": 4.5, "warm_up": 1.0,
                   "swap_seconds": 0.75}
