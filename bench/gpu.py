"""CPU against CUDA, in one run: `mdgan simulate` on the CPU and on CUDA and `mdgan local` on CUDA (CNN
MNIST, b = 10, k = 1, no evaluation) at N = 10 and 50, each as seconds an iteration (the median of its
history after the first iterations), as a ratio to the CPU's, and with the share of its wall time the GPU
was busy (NVML's utilization, sampled by `nvidia-smi` every 100 ms while it trains). Each row is printed as
its run ends, with the run's generator hash: at one N the CUDA runs (simulate, local, eager) train the same
iterations and must end on the same generator, which a last line per N says.

    python bench/gpu.py                      # N = 10 and 50, MNIST under ../shared/data
    python bench/gpu.py --workers 10 --cpu-iterations 20 --gpu-iterations 300
    python bench/gpu.py --eager              # also CUDA simulate and local with every step eager, on one stream,
                                             # Adam per tensor (MDGAN_CUDA_GRAPHS=0 MDGAN_CUDA_LANES=0
                                             # MDGAN_FLAT_ADAM=0): what graphs, lanes and the flat Adam buy

On a machine without CUDA it times the CPU alone and says so. Run it on a quiet machine."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WARMUP = 5  # first iterations not counted (allocation, cuDNN's and CUDA's first launches)


class BusySampler:
    """The GPU's utilization (percent of time a kernel ran, NVML's), sampled while a run trains."""

    def __init__(self, index: int | None):
        self.index, self.samples, self._process = index, [], None  # index None: the CPU, nothing to sample

    def __enter__(self):
        if self.index is None:
            return self
        try:
            self._process = subprocess.Popen(
                ["nvidia-smi", f"--id={self.index}", "--query-gpu=utilization.gpu", "--format=csv,noheader,nounits",
                 "-lms", "100"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        except OSError:  # no nvidia-smi: the share is not known
            return self
        threading.Thread(target=self._read, daemon=True).start()
        return self

    def _read(self):
        for line in self._process.stdout:
            if line.strip().isdigit():
                self.samples.append(int(line))

    def __exit__(self, *exc):
        if self._process is not None:
            self._process.terminate()
            self._process.wait()

    def busy(self) -> float | None:
        """Mean utilization over the samples after the first second (start-up), as a fraction; None unknown."""
        kept = self.samples[10:] or self.samples
        return statistics.mean(kept) / 100 if kept else None


def time_run(command: str, device: str, workers: int, iterations: int, data_root: str, threads: int,
             eager: bool = False) -> dict:
    """One run of `mdgan COMMAND`: seconds an iteration (median after WARMUP) and the GPU's busy share."""
    with tempfile.TemporaryDirectory(prefix="mdgan-bench-gpu-") as out:
        argv = [sys.executable, "-m", "mdgan_app.cli", command, "--device", device, "--workers", str(workers),
                "--iterations", str(iterations), "--architecture", "cnn-mnist", "--batch-size", "10", "--kappa", "1",
                "--eval-every", "-1", "--data-root", data_root, "--out", out, "--no-progress", "--threads", str(threads)]
        index = int(device.partition(":")[2] or 0)
        # eager: every step eager, on one stream, Adam per tensor
        plain = {"MDGAN_CUDA_GRAPHS": "0", "MDGAN_CUDA_LANES": "0", "MDGAN_FLAT_ADAM": "0"}
        environment = {**os.environ, **(plain if eager else {})}
        started = time.perf_counter()
        with BusySampler(index if device != "cpu" else None) as sampler:
            done = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, env=environment)
        wall = time.perf_counter() - started
        if done.returncode != 0:
            raise SystemExit(f"bench/gpu.py: {' '.join(argv[2:5])} failed:\n{done.stderr[-2000:]}")
        with open(os.path.join(out, "history.jsonl"), encoding="utf-8") as fh:
            seconds = [json.loads(line)["seconds"] for line in fh if line.strip()]
        with open(os.path.join(out, "summary.json"), encoding="utf-8") as fh:
            generator = json.load(fh)["generator_sha256"]
    timed = seconds[WARMUP:] or seconds
    return {"seconds": statistics.median(timed), "wall": wall, "busy": sampler.busy(), "generator": generator}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, nargs="+", default=[10, 50])
    parser.add_argument("--cpu-iterations", type=int, default=20, help="iterations of the CPU run (slow)")
    parser.add_argument("--gpu-iterations", type=int, default=300)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--eager", action="store_true", help="also time the CUDA runs with every step eager")
    parser.add_argument("--data-root", default=os.environ.get("MDGAN_DATA_ROOT", os.path.join(REPO, "..", "shared",
                                                                                             "data")))
    args = parser.parse_args()
    import torch

    cores = len(os.sched_getaffinity(0))
    cuda = torch.cuda.is_available()
    card = torch.cuda.get_device_name(args.device) if cuda else "no CUDA device here"
    print(f"bench/gpu.py: CNN MNIST, b = 10, k = 1; CPU {cores} cores (simulate with {cores} threads, local one a "
          f"process); GPU {card}")
    print(f"{'N':>4}  {'run':<28} {'s/iteration':>12} {'x CPU simulate':>15} {'GPU busy':>9}  generator sha256",
          flush=True)
    for workers in args.workers:
        cpu = None
        hashes = {}
        runs = [("simulate, CPU", "simulate", "cpu", args.cpu_iterations, cores, False)]
        if cuda:
            runs += [(f"{command}, {args.device}", command, args.device, args.gpu_iterations, 1, False)
                     for command in ("simulate", "local")]
            if args.eager:
                runs += [(f"{command}, {args.device}, eager", command, args.device, args.gpu_iterations, 1, True)
                         for command in ("simulate", "local")]
        for name, command, device, iterations, threads, eager in runs:
            row = time_run(command, device, workers, iterations, args.data_root, threads, eager=eager)
            cpu = cpu or row
            busy = "n/a" if row["busy"] is None else f"{row['busy']:.0%}"
            print(f"{workers:>4}  {name:<28} {row['seconds']:>12.4f} {cpu['seconds'] / row['seconds']:>14.2f}x "
                  f"{busy:>9}  {row['generator'][:16]}", flush=True)
            if device != "cpu":
                hashes[name] = row["generator"]
        if hashes:
            same = len(set(hashes.values())) == 1
            print(f"{workers:>4}  CUDA runs {'on ONE generator' if same else 'on DIFFERENT generators'}: "
                  + ", ".join(f"{name} {sha[:16]}" for name, sha in hashes.items()), flush=True)
    if not cuda:
        print("no CUDA device: only the CPU was timed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
