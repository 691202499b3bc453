"""Per-iteration cost of mutual TLS: `mdgan local` (mTLS, the default) against `mdgan local --insecure`.

    python bench/tls_overhead.py --workers 4 --batch-size 10 --iterations 300 --repeats 3

Both variants run the same flags and seed, interleaved in ABBA order (mTLS, plaintext, plaintext,
mTLS, ...) so that a machine's changing load falls on both alike; the script checks that every run ends with the same
generator and prints seconds per iteration (training loop only, start-up excluded: the TLS
handshakes happen once per connection, at start) for each run, the medians and their ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(flags: list[str], out: str) -> dict:
    subprocess.run([sys.executable, "-m", "mdgan_app.cli", "local", *flags, "--out", out, "--no-progress"], cwd=REPO,
                   check=True, stdout=subprocess.DEVNULL)
    with open(os.path.join(out, "summary.json")) as fh:
        return json.load(fh)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=10)
    parser.add_argument("--iterations", type=int, default=300)
    parser.add_argument("--swap-every", type=int, default=50)
    parser.add_argument("--repeats", type=int, default=4, help="runs of each variant, interleaved")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dataset", default="mnist")
    parser.add_argument("--data-root", default=os.path.join(os.path.dirname(REPO), "shared", "data"))
    args = parser.parse_args()
    flags = ["--workers", str(args.workers), "--batch-size", str(args.batch_size), "--iterations",
             str(args.iterations), "--swap-every", str(args.swap_every), "--seed", str(args.seed),
             "--dataset", args.dataset, "--data-root", args.data_root]
    times: dict[str, list[float]] = {"mtls": [], "insecure": []}
    generators = set()
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.repeats):
            # ABBA order: a load that drifts during the benchmark, or a run slowed by the one before
            # it, weighs on both variants alike
            for variant in (list(times) if r % 2 == 0 else list(times)[::-1]):
                extra = ["--insecure"] if variant == "insecure" else []
                summary = run(flags + extra, os.path.join(tmp, f"{variant}-{r}"))
                times[variant].append(summary["seconds_per_iteration"])
                generators.add(summary["generator_sha256"])
                print(f"run {r} {variant:8s}: {1000 * summary['seconds_per_iteration']:.2f} ms/iteration, "
                      f"{summary['swaps']} swaps", flush=True)
    mtls, plain = statistics.median(times["mtls"]), statistics.median(times["insecure"])
    print(f"N={args.workers} b={args.batch_size} I={args.iterations} swap every {args.swap_every}, "
          f"{args.repeats} runs each, {os.cpu_count()} cores")
    print(f"mTLS:      {1000 * mtls:.2f} ms/iteration (median)")
    print(f"insecure:  {1000 * plain:.2f} ms/iteration (median)")
    print(f"mTLS / insecure: {mtls / plain:.3f}x")
    print(f"same generator in every run: {len(generators) == 1}")
    return 0 if len(generators) == 1 else 1


if __name__ == "__main__":
    sys.exit(main())
