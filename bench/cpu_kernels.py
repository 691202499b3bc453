"""Do documented figures depend on the CPU kernels torch dispatches, and does pinning them help?

    nice -n 19 python bench/cpu_kernels.py                      # every pin below, then a table
    python bench/cpu_kernels.py --pins "ATEN_CPU_CAPABILITY=avx2 MKL_CBWR=AVX2" --out /tmp/kernels

torch picks its CPU kernels at start-up by the CPU's capability (`torch.backends.cpu.get_cpu_capability()`:
DEFAULT, AVX2, AVX512, ...); `ATEN_CPU_CAPABILITY` caps it. Matrix products are MKL's (torch's x86
wheels), which picks its own code path by CPU: `MKL_CBWR` pins that. Other kernels sum in another
order, so the same run on two machines drifts apart after a few hundred iterations (docs/RESULTS.md
"Reproducing on another machine"). This script re-runs the first evaluation of two documented
experiments, with nothing pinned and then under each pin asked for, through `mdgan experiment`
exactly as the docs run them, and prints their scores and generator hashes side by side:

- `experiments/byzantine-mlp-cpu.yaml`, "clean, mean", to its first evaluation (250 iterations);
- `experiments/compression-mlp-cpu.yaml`, "float32 (seed 0)", to its first evaluation (500).

About a CPU-minute a run, ten in all. One machine per call: compare its table with another machine's.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATA = os.path.join(os.path.dirname(REPO), "shared", "data")

# (name, the documented experiment, the run's label in it, iterations to its first evaluation)
CASES = [("byzantine clean, mean", "byzantine-mlp-cpu.yaml", "clean, mean", 250),
         ("compression float32 seed 0", "compression-mlp-cpu.yaml", "float32 (seed 0)", 500)]


def _case_yaml(source: str, label: str, iterations: int, out: str, data_root: str) -> str:
    """The documented run alone, stopped at its first evaluation (the run is the same up to there:
    nothing in training depends on the total number of iterations)."""
    import yaml

    from mdgan_app.experiment import load_config

    config = load_config(os.path.join(REPO, "experiments", source))  # (its base_from applied)
    run = next(r for r in config["runs"] if r.get("label") == label)
    base = dict(config["base"], data_root=data_root, iterations=iterations, eval_every=iterations)
    path = os.path.join(out, "experiment.yaml")
    with open(path, "w", encoding="utf-8") as fh:
        yaml.safe_dump({"name": os.path.basename(out), "out": os.path.join(out, "run"), "base": base,
                        "runs": [run], "plot": "curves"}, fh)
    return path


PINNED = ("ATEN_CPU_CAPABILITY", "MKL_CBWR", "ONEDNN_MAX_CPU_ISA")
PINS = ["", "ATEN_CPU_CAPABILITY=avx2", "ATEN_CPU_CAPABILITY=default", "ATEN_CPU_CAPABILITY=avx2 MKL_CBWR=AVX2",
        "ATEN_CPU_CAPABILITY=default MKL_CBWR=COMPATIBLE"]


def run_case(case: tuple, pin: str, out: str, data_root: str, threads: int) -> dict:
    name, source, label, iterations = case
    os.makedirs(out, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if k not in PINNED}
    env.update(OMP_NUM_THREADS=str(threads), PYTHONPATH=REPO)
    env.update(dict(item.split("=", 1) for item in pin.split()))
    path = _case_yaml(source, label, iterations, out, data_root)
    subprocess.run([sys.executable, "-m", "mdgan_app.cli", "experiment", path, "--no-progress",
                    "--threads", str(threads)], env=env, cwd=REPO, check=True, stdout=subprocess.DEVNULL)
    with open(os.path.join(out, "run", "runs.csv"), encoding="utf-8") as fh:
        row = next(csv.DictReader(fh))
    run_dir = os.path.join(out, "run", "runs", row["run"])
    with open(os.path.join(run_dir, "summary.json"), encoding="utf-8") as fh:
        summary = json.load(fh)
    return {"case": name, "pinned": pin or "(nothing)", "cpu_capability": summary["machine"]["cpu_capability"],
            "iteration": iterations, "mnist_score": round(float(row["mnist_score"]), 2),
            "fid": round(float(row["fid"]), 1), "generator_sha256": summary["generator_sha256"][:16],
            "cpu": summary["machine"]["cpu"], "torch": summary["machine"]["torch"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pins", nargs="+", default=PINS,
                        help="each a space-separated list of VAR=value to run under; '' pins nothing")
    parser.add_argument("--out", default=None, help="keep the runs here (default: a temporary folder)")
    parser.add_argument("--data-root", default=DATA)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    out = args.out or tempfile.mkdtemp(prefix="cpu-kernels-")
    rows = []
    for case_index, case in enumerate(CASES):
        for pin_index, pin in enumerate(args.pins):
            rows.append(run_case(case, pin, os.path.join(out, f"case{case_index}-pin{pin_index}"),
                                 os.path.abspath(args.data_root), args.threads))
            print(json.dumps(rows[-1]), flush=True)
    print(f"\ncpu: {rows[0]['cpu']}, torch {rows[0]['torch']}\n")
    print("| run | pinned | torch's kernels | MNIST score / FID | generator sha256 |")
    print("| --- | --- | --- | --- | --- |")
    for row in rows:
        print(f"| {row['case']} at {row['iteration']} | {row['pinned']} | {row['cpu_capability']} | "
              f"{row['mnist_score']:.2f} / {row['fid']:.0f} | {row['generator_sha256']} |")


if __name__ == "__main__":
    main()
