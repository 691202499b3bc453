"""How big the state an exact resume of each of an experiment's runs needs, against what a GPU loan can carry.

    python bench/loan_state.py                                   # experiments/figure3-mnist-cnn.yaml
    python bench/loan_state.py experiments/figure3-cifar10-cnn.yaml --json

A figure grown loan by loan would have to send each unfinished run's checkpoint to the next loan (the working tree
that travels) and bring it back (the files from $OUT). Each run is built from its experiment settings on synthetic
data of its shape (the sizes do not depend on the data): an MD-GAN run writes its real checkpoint (`mdgan simulate`,
two iterations, a checkpoint at each: the server's file and every worker's); the standalone GAN and FL-GAN, which
have no checkpoint, are measured as the state one would hold (each G's and each D's `state_dict`: weights, Adam's
moments, the noise and sampler states; FL-GAN: every site's pair, whose Adam stays with the site across rounds, and
the server's averages), written as a checkpoint is written. Printed: each run's bytes, and gzip's, against the limits
of docs/GPU.md (16 MiB a file back, 64 MiB back, 64 MiB of tree out, less the tree tracked now and the 25 MB
gpu_prepare.sh sends with it).
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

MIB = 1 << 20
FILE_BACK = 16 * MIB  # the device tool's limits (/work/.library/device/README.md, docs/GPU.md)
ALL_BACK = 64 * MIB
TREE_OUT = 64 * MIB
PREPARED = 25_000_000  # .whl and .gpudata, as ../shared/tools/gpu_prepare.sh says it makes them


def folder_bytes(root: str) -> tuple[int, int]:
    """Bytes of every file under root, and of each gzipped (level 6)."""
    raw = packed = 0
    for folder, _, names in os.walk(root):
        for name in names:
            with open(os.path.join(folder, name), "rb") as fh:
                data = fh.read()
            raw += len(data)
            packed += len(gzip.compress(data, 6))
    return raw, packed


def mdgan_state(run: dict, scratch: str) -> str:
    """An MD-GAN run's real checkpoint: the folder of one complete checkpoint, server and workers."""
    out = os.path.join(scratch, "run")
    flags = ["--dataset", "synthetic", "--architecture", run["architecture"], "--gan", run["gan"], "--workers",
             str(run["workers"]), "--batch-size", str(run["batch_size"]), "--kappa", str(run["kappa"]),
             "--iterations", "2", "--checkpoint-every", "1", "--eval-every", "-1", "--out", out, "--no-progress"]
    subprocess.run([sys.executable, "-m", "mdgan_app.cli", "simulate", *flags], cwd=REPO, check=True,
                   capture_output=True)
    state = os.path.join(scratch, "state")
    os.makedirs(state)
    for folder, _, names in os.walk(out):  # checkpoint 1: the server's folder and each worker's
        if os.path.basename(folder) == "000000001":
            for name in names:
                os.link(os.path.join(folder, name), os.path.join(state, f"{len(os.listdir(state))}-{name}"))
    return state


def local_pairs_state(run: dict, scratch: str, sites: int) -> str:
    """The state of `sites` G-and-D pairs after a step (standalone: one; FL-GAN: one a site, plus the server's
    averaged G and D), each written as a checkpoint writes it."""
    import torch

    from mdgan.algorithms.standalone import LocalGAN
    from mdgan.checkpoint import atomic_save
    from mdgan.data import Shard, make_synthetic
    from mdgan_app.experiment import run_spec

    spec = run_spec({**run, "dataset": "synthetic", "iterations": 2, "eval_every": -1})
    images, labels = make_synthetic(size=max(spec.config.batch_size * 2, 64))
    shard = Shard(images.view(len(images), *spec.config.model.sample_shape), labels, 0, 1)
    state = os.path.join(scratch, "state")
    os.makedirs(state)
    pair = LocalGAN(spec.config, shard)
    pair.step()  # Adam's moments exist from the first step on
    for site in range(sites):
        atomic_save({"generator_side": pair.g.state_dict(), "discriminator_side": pair.d.state_dict()},
                    os.path.join(state, f"site-{site}.pt"))
    if sites > 1:  # the server's averages
        atomic_save({"generator": pair.g.generator.state_dict(), "discriminator": pair.d.discriminator.state_dict(),
                     "torch_rng": torch.get_rng_state()}, os.path.join(state, "server.pt"))
    return state


def tracked_tree_bytes() -> int:
    names = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, check=True, capture_output=True).stdout.split(b"\0")
    return sum(os.path.getsize(os.path.join(REPO, n.decode())) for n in names if n and
               os.path.isfile(os.path.join(REPO, n.decode())))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("config", nargs="?", default=os.path.join(REPO, "experiments", "figure3-mnist-cnn.yaml"))
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    from mdgan_app.experiment import expand, load_config

    runs = expand(load_config(args.config))
    rows = []
    for run in runs:
        with tempfile.TemporaryDirectory(prefix="loan-state-") as scratch:
            if run["algorithm"] == "mdgan":
                state = mdgan_state(run, scratch)
            elif run["algorithm"] in ("standalone", "flgan"):
                state = local_pairs_state(run, scratch, 1 if run["algorithm"] == "standalone" else run["workers"])
            else:
                continue
            raw, packed = folder_bytes(state)
            largest = max(os.path.getsize(os.path.join(state, n)) for n in os.listdir(state))
        rows.append({"run": run["name"], "algorithm": run["algorithm"], "bytes": raw, "gzip_bytes": packed,
                     "largest_file": largest})
        if not args.json:
            print(f"{run['name']:<28} {raw / 1e6:8.1f} MB  gzip {packed / 1e6:8.1f} MB  largest file "
                  f"{largest / 1e6:6.1f} MB", flush=True)
    tree = tracked_tree_bytes()
    room = TREE_OUT - tree - PREPARED
    total = sum(r["bytes"] for r in rows)
    report = {"config": os.path.relpath(args.config, REPO), "runs": rows, "all_bytes": total,
              "tracked_tree_bytes": tree, "tree_room_bytes": room, "back_bytes": ALL_BACK, "back_file_bytes": FILE_BACK}
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    print(f"{'all':<28} {total / 1e6:8.1f} MB")
    print(f"a loan: back at most {ALL_BACK / 1e6:.1f} MB ({FILE_BACK / 1e6:.1f} MB a file); out, the tree: "
          f"{TREE_OUT / 1e6:.1f} MB less {tree / 1e6:.1f} MB tracked now and {PREPARED / 1e6:.0f} MB of wheels and "
          f"data = {room / 1e6:.1f} MB of room")
    fits = [r["run"] for r in rows if r["bytes"] <= min(room, ALL_BACK)]
    print(f"runs whose state would fit both ways: {', '.join(fits) or 'none'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
