"""The privacy-utility table (docs/RESULTS.md, docs/PRIVACY.md): runs an experiment of DP and non-DP
MD-GAN runs (experiments/privacy-utility-mlp.yaml), audits every run and prints one table.

    nice -n 5 python bench/privacy_utility.py experiments/privacy-utility-mlp.yaml

Columns: epsilon spent (the largest over the sites), MNIST score and FID at the last iteration, the
downstream accuracy (when the experiment asks for it: eval_downstream), the mean over sites of the
discriminator attack's AUC (d_class_loss, the stronger of the two D attacks here; the largest in
brackets) and of the generator attack's (g_distance), each attack's mean TPR at 0.1% FPR, and seconds
per iteration as a ratio to the run without DP of the same invocation (the cost of the DP mechanism).
Runs sharing a label (seeds) are one line: the seeds, and each column's mean +- its standard deviation.

    nice -n 19 python bench/privacy_utility.py CONFIG --jobs 2 --keep docs/results/NAME \
        --with docs/results/OTHER/privacy_utility.json    # and the rows of another table (seed 0)
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main() -> None:
    from mdgan.audit import AuditSettings, audit, write_report
    from mdgan_app.experiment import run_experiment

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("config", nargs="?", default="experiments/privacy-utility-mlp.yaml")
    parser.add_argument("--members", type=int, default=500)
    parser.add_argument("--generated", type=int, default=5000)
    parser.add_argument("--jobs", type=int, default=1, help="runs at once (each in its own process, one thread)")
    parser.add_argument("--keep", help="the experiment's --keep folder (and this table's json copied into it)")
    parser.add_argument("--with", dest="others", action="append", default=[],
                        help="another run of this table (its privacy_utility.json): its rows join these by label")
    args = parser.parse_args()
    from services.common.settings import configure_compute

    configure_compute(1)  # one torch thread, as `mdgan experiment` (more oversubscribe a busy machine badly)
    result = run_experiment(args.config, progress=False, jobs=args.jobs, threads=1, keep=args.keep)
    out = result["out"]
    with open(os.path.join(out, "experiment.json")) as fh:
        runs = json.load(fh)["runs"]
    kept_rows = {}  # a resumed experiment's runs that finished before: kept records only, their rows kept too
    if args.keep and os.path.exists(os.path.join(args.keep, "privacy_utility.json")):
        with open(os.path.join(args.keep, "privacy_utility.json")) as fh:
            kept_rows = {(r["run"], r["seed"]): r for r in json.load(fh)}
    rows = []
    for run in runs:
        folder = os.path.join(out, "runs", run["name"])
        with open(os.path.join(folder, "summary.json")) as fh:
            summary = json.load(fh)
        report_path = os.path.join(folder, "audit", "audit.json")
        kept = kept_rows.get((run["label"], summary["config"]["seed"]))
        if kept is not None and not os.path.exists(report_path) \
                and not os.path.exists(os.path.join(folder, "checkpoint.pt")):
            rows.append(kept)  # (its generator is not kept: the audit it had then)
            continue
        if os.path.exists(report_path):
            with open(report_path) as fh:
                report = json.load(fh)
        else:
            report = audit(folder, AuditSettings(members=args.members, generated=args.generated))
            write_report(report, os.path.join(folder, "audit"))
        scores = summary.get("scores") or {}

        def tpr(attack: str) -> float | None:  # the mean over the sites of its TPR at 0.1% FPR
            values = [s["attacks"][attack]["tpr_at_0.001_fpr"] for s in report["sites"].values()
                      if attack in s["attacks"]]
            return sum(values) / len(values) if values else None

        rows.append({"run": run["label"], "seed": summary["config"]["seed"], "epsilon": (summary.get("privacy") or {}).get("epsilon_max"),
                     "mechanism": (summary.get("privacy") or {}).get("mechanism"),
                     "mnist_score": scores.get("mnist_score"), "fid": scores.get("fid"),
                     "downstream_accuracy": scores.get("downstream_accuracy"),
                     "d_auc": report["summary"].get("d_class_loss", {}).get("auc_mean"),
                     "d_auc_max": report["summary"].get("d_class_loss", {}).get("auc_max"),
                     "g_auc": report["summary"]["g_distance"]["auc_mean"],
                     "d_tpr_at_0.001_fpr": tpr("d_class_loss"), "g_tpr_at_0.001_fpr": tpr("g_distance"),
                     "seconds_per_iteration": summary["seconds_per_iteration"]})
    with open(os.path.join(out, "privacy_utility.json"), "w") as fh:
        json.dump(rows, fh, indent=2)
    if args.keep:
        shutil.copy(os.path.join(out, "privacy_utility.json"), os.path.join(args.keep, "privacy_utility.json"))
    for other in args.others:
        with open(other) as fh:
            rows += [dict(r, seed=r.get("seed", 0)) for r in json.load(fh)]  # (a table of one seed: seed 0)
    print_table(rows)


COLUMNS = ("epsilon", "mnist_score", "fid", "downstream_accuracy", "d_auc", "d_auc_max", "g_auc",
           "d_tpr_at_0.001_fpr", "g_tpr_at_0.001_fpr", "seconds_per_iteration")


def print_table(rows: list[dict]) -> None:
    """One line a label: each column's mean over its runs, +- their standard deviation where there are
    several; time as a ratio to the label without DP (its mean)."""
    labels = list(dict.fromkeys(r["run"] for r in rows))
    lines = {}
    for label in labels:
        runs = [r for r in rows if r["run"] == label]
        line = {"run": label, "seeds": sorted(r["seed"] for r in runs)}
        for column in COLUMNS:
            values = [r[column] for r in runs if r.get(column) is not None]
            line[column] = (statistics.mean(values), statistics.stdev(values) if len(values) > 1 else None) \
                if values else None
        lines[label] = line
    base = next((line["seconds_per_iteration"][0] for line in lines.values() if line["epsilon"] is None), None)

    def cell(value, form: str, scale: float = 1.0) -> str:
        if value is None:
            return "-"
        mean, sd = value
        return format(mean / scale, form) + ("" if sd is None else " +- " + format(sd / scale, form))

    print("| run | seeds | epsilon | MNIST score | FID | downstream accuracy | D AUC | D AUC max | G AUC | "
          "D TPR at 0.1% FPR | G TPR at 0.1% FPR | time x |")
    print("| --- " * 12 + "|")
    for line in lines.values():
        eps = "infinity" if line["epsilon"] is None else cell(line["epsilon"], ".3g")
        print(f"| {line['run']} | {', '.join(map(str, line['seeds']))} | {eps} | {cell(line['mnist_score'], '.2f')} | "
              f"{cell(line['fid'], '.1f')} | {cell(line['downstream_accuracy'], '.3f')} | {cell(line['d_auc'], '.3f')} | "
              f"{cell(line['d_auc_max'], '.3f')} | {cell(line['g_auc'], '.3f')} | "
              f"{cell(line['d_tpr_at_0.001_fpr'], '.3f')} | {cell(line['g_tpr_at_0.001_fpr'], '.3f')} | "
              f"{cell(line['seconds_per_iteration'], '.2f', base) if base else '-'} |")


if __name__ == "__main__":
    main()
