"""The privacy-utility table (docs/RESULTS.md, docs/PRIVACY.md): runs an experiment of DP and non-DP
MD-GAN runs (experiments/privacy-utility-mlp.yaml), audits every run and prints one table.

    nice -n 5 python bench/privacy_utility.py experiments/privacy-utility-mlp.yaml

Columns: epsilon spent (the largest over the sites), MNIST score and FID at the last iteration, the
downstream accuracy (when the experiment asks for it: eval_downstream), the mean over sites of the
discriminator attack's AUC (d_class_loss, the stronger of the two D attacks here; the largest in
brackets) and of the generator attack's (g_distance), each attack's mean TPR at 0.1% FPR, and seconds
per iteration as a ratio to the run without DP of the same invocation (the cost of the DP mechanism).
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

        def tpr(attack: str) -> float | None:  # the mean over the sites of its TPR at 0.1% FPR
            values = [s["attacks"][attack]["tpr_at_0.001_fpr"] for s in report["sites"].values()
                      if attack in s["attacks"]]
            return sum(values) / len(values) if values else None

        rows.append({"run": run["label"], "epsilon": (summary.get("privacy") or {}).get("epsilon_max"),
                     "mechanism": (summary.get("privacy") or {}).get("mechanism"),
                     "mnist_score": scores.get("mnist_score"), "fid": scores.get("fid"),
                     "downstream_accuracy": scores.get("downstream_accuracy"),
                     "d_auc": report["summary"].get("d_class_loss", {}).get("auc_mean"),
                     "d_auc_max": report["summary"].get("d_class_loss", {}).get("auc_max"),
                     "g_auc": report["summary"]["g_distance"]["auc_mean"],
                     "d_tpr_at_0.001_fpr": tpr("d_class_loss"), "g_tpr_at_0.001_fpr": tpr("g_distance"),
                     "seconds_per_iteration": summary["seconds_per_iteration"]})
    base = next((r["seconds_per_iteration"] for r in rows if r["epsilon"] is None), None)

    def number(value, form: str) -> str:
        return "-" if value is None else format(value, form)

    print(f"{'run':24} {'epsilon':>8} {'score':>6} {'FID':>7} {'down':>6} {'D AUC':>6} {'(max)':>6} {'G AUC':>6} "
          f"{'D TPR':>6} {'G TPR':>6} {'time x':>7}")
    for r in rows:
        eps = "inf" if r["epsilon"] is None else f"{r['epsilon']:.2f}"
        ratio = r["seconds_per_iteration"] / base if base else float("nan")
        print(f"{r['run']:24} {eps:>8} {r['mnist_score']:6.2f} {r['fid']:7.1f} {number(r['downstream_accuracy'], '6.3f')} "
              f"{number(r['d_auc'], '6.3f')} {number(r['d_auc_max'], '6.3f')} {r['g_auc']:6.3f} "
              f"{number(r['d_tpr_at_0.001_fpr'], '6.3f')} {number(r['g_tpr_at_0.001_fpr'], '6.3f')} {ratio:7.2f}")
    with open(os.path.join(out, "privacy_utility.json"), "w") as fh:
        json.dump(rows, fh, indent=2)


if __name__ == "__main__":
    main()
