"""The privacy-utility table (docs/RESULTS.md, docs/PRIVACY.md): runs an experiment of DP and non-DP
MD-GAN runs (experiments/privacy-utility-mlp.yaml), audits every run and prints one table.

    nice -n 5 python bench/privacy_utility.py experiments/privacy-utility-mlp.yaml

Columns: epsilon spent (the largest over the sites), MNIST score and FID at the last iteration, the
mean over sites of the discriminator attack's AUC (d_class_loss, the stronger of the two D attacks
here) and of the generator attack's (g_distance), and seconds per iteration as a ratio to the run
without DP of the same invocation (the cost of per-sample gradients, clipping and noise).
"""

from __future__ import annotations

import argparse
import json
import os
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
    args = parser.parse_args()
    from services.common.settings import configure_compute

    configure_compute(1)  # one torch thread, as `mdgan experiment` (more oversubscribe a busy machine badly)
    result = run_experiment(args.config, progress=False, jobs=args.jobs, threads=1)
    out = result["out"]
    with open(os.path.join(out, "experiment.json")) as fh:
        runs = json.load(fh)["runs"]
    rows = []
    for run in runs:
        folder = os.path.join(out, "runs", run["name"])
        with open(os.path.join(folder, "summary.json")) as fh:
            summary = json.load(fh)
        report_path = os.path.join(folder, "audit", "audit.json")
        if os.path.exists(report_path):
            with open(report_path) as fh:
                report = json.load(fh)
        else:
            report = audit(folder, AuditSettings(members=args.members, generated=args.generated))
            write_report(report, os.path.join(folder, "audit"))
        scores = summary.get("scores") or {}
        rows.append({"run": run["label"], "epsilon": (summary.get("privacy") or {}).get("epsilon_max"),
                     "mnist_score": scores.get("mnist_score"), "fid": scores.get("fid"),
                     "d_auc": report["summary"].get("d_class_loss", {}).get("auc_mean"),
                     "d_auc_max": report["summary"].get("d_class_loss", {}).get("auc_max"),
                     "g_auc": report["summary"]["g_distance"]["auc_mean"],
                     "seconds_per_iteration": summary["seconds_per_iteration"]})
    base = next((r["seconds_per_iteration"] for r in rows if r["epsilon"] is None), None)
    print(f"{'run':12} {'epsilon':>8} {'score':>6} {'FID':>7} {'D AUC':>6} {'(max)':>6} {'G AUC':>6} {'time x':>7}")
    for r in rows:
        eps = "inf" if r["epsilon"] is None else f"{r['epsilon']:.2f}"
        ratio = r["seconds_per_iteration"] / base if base else float("nan")
        print(f"{r['run']:12} {eps:>8} {r['mnist_score']:6.2f} {r['fid']:7.1f} {r['d_auc']:6.3f} {r['d_auc_max']:6.3f} "
              f"{r['g_auc']:6.3f} {ratio:7.2f}")
    with open(os.path.join(out, "privacy_utility.json"), "w") as fh:
        json.dump(rows, fh, indent=2)


if __name__ == "__main__":
    main()
