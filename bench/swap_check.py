"""What the swap check (mdgan/algorithms/mdgan/swapcheck.py) sees and costs over a long honest run, and
what it does to the swap attacks.

    nice -n 19 python bench/swap_check.py --workers 10 --iterations 20000 --out /tmp/swapcheck
    python bench/swap_check.py --workers 4 --iterations 600 --swap-every 50 --attacks

An MD-GAN run in one process (mdgan simulate) on MNIST with every verdict recorded: per swap, the
incoming D's weight-norm ratio and cosine to the receiver's own, its check-set loss against
max(own, all-zero D), whether it was refused, and the seconds the check took. Prints the range of
each over the run (the margins the defaults leave), the honest refusals (there must be none) and,
with --attacks, how each --attack swap-* run fared (every poisoned D refused, the honest ones not).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from mdgan.algorithms.mdgan import inprocess, swapcheck  # noqa: E402
from mdgan.attacks import SWAP_ATTACKS  # noqa: E402


def run(args, out: str, attack: str | None) -> list[dict]:
    from mdgan_app.cli import main

    verdicts: list[dict] = []
    original = swapcheck.check_incoming

    def spy(side, state, check):
        started = time.perf_counter()
        verdict = original(side, state, check)
        verdicts.append({"receiver": side.shard_index, "seconds": time.perf_counter() - started,
                         "norm_ratio": verdict.norm_ratio, "cosine": verdict.cosine,
                         "loss_ratio": verdict.loss / max(verdict.own_loss, verdict.zero_loss),
                         "refused": verdict.refused})
        return verdict

    inprocess.check_incoming = spy
    try:
        flags = ["simulate", "--dataset", "mnist", "--data-root", args.data_root, "--workers", str(args.workers),
                 "--iterations", str(args.iterations), "--batch-size", str(args.batch_size), "--seed", str(args.seed),
                 "--eval-every", "-1", "--no-progress", "--out", out]
        if args.swap_every:
            flags += ["--swap-every", str(args.swap_every)]
        if attack:
            flags += ["--byzantine", "1", "--attack", attack]
        code = main(flags)
        if code:
            raise SystemExit(f"mdgan simulate exited {code}")
    finally:
        inprocess.check_incoming = original
    return verdicts


def describe(verdicts: list[dict]) -> dict:
    """How many checks, how many refused, and the range of each figure over them."""
    def span(key):
        values = [v[key] for v in verdicts]
        return [min(values), max(values)] if values else None

    return {"checks": len(verdicts), "refused": sum(1 for v in verdicts if v["refused"]),
            "norm_ratio": span("norm_ratio"), "cosine": span("cosine"), "loss_ratio": span("loss_ratio"),
            "check_ms_median": 1000 * statistics.median(v["seconds"] for v in verdicts) if verdicts else None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, default=10)
    parser.add_argument("--iterations", type=int, default=20000)
    parser.add_argument("--batch-size", type=int, default=10)
    parser.add_argument("--swap-every", type=int, default=0, help="0: the paper's ceil(E m / b)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--data-root", default=os.path.join(os.path.dirname(__file__), "..", "..", "shared", "data"))
    parser.add_argument("--attacks", action="store_true", help="also one run per swap attack")
    parser.add_argument("--out", default="/tmp/mdgan-swapcheck")
    args = parser.parse_args()
    report = {"honest": describe(run(args, os.path.join(args.out, "honest"), None))}
    if args.attacks:
        for attack in SWAP_ATTACKS:
            out = os.path.join(args.out, attack)
            verdicts = run(args, out, attack)
            attacker = f"worker-{args.workers - 1}"
            with open(os.path.join(out, "swaps.jsonl")) as fh:
                rounds = [json.loads(line) for line in fh]
            poisoned = [s["workers"][s["plan"][attacker]] for s in rounds if attacker in s["plan"]]
            honest = [w for s in rounds for sender, receiver in s["plan"].items() if sender != attacker
                      for w in [s["workers"][receiver]]]
            report[attack] = {"poisoned": len(poisoned), "poisoned_refused": sum(1 for w in poisoned if w.get("refused")),
                              "honest": len(honest), "honest_refused": sum(1 for w in honest if w.get("refused")),
                              "checks": len(verdicts)}
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
