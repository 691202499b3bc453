"""Where `mdgan simulate` on CUDA waits for the GPU: every host synchronisation of a short run, by the line of
the project that asked for it, and a profile of the same run (kernel time against wall time, launches and
copies an iteration, the ops that cost the host most).

    python bench/gpu_syncs.py                          # CNN MNIST, N = 10, b = 10, k = 1, 30 iterations
    python bench/gpu_syncs.py --workers 50 --iterations 20 --trace /tmp/trace.json.gz -- --kappa 2

A synchronisation is what PyTorch's sync debug mode reports (`.item()`, `float(t)`, a copy to the host, a
data-dependent shape); a line that asks for one every iteration shows a count of at least --iterations.
Extra `mdgan simulate` flags go after `--`. Needs CUDA."""

from __future__ import annotations

import argparse
import collections
import os
import sys
import tempfile
import time
import traceback
import warnings

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)


def simulate_argv(args, out: str, iterations: int) -> list[str]:
    return ["simulate", "--device", args.device, "--workers", str(args.workers), "--iterations", str(iterations),
            "--architecture", "cnn-mnist", "--batch-size", "10", "--kappa", "1", "--eval-every", "-1",
            "--data-root", args.data_root, "--out", out, "--no-progress", "--threads", "1", *args.extra]


def project_frame(stack) -> str:
    """The innermost frame of the stack in the project (not torch's, not this file's)."""
    for frame in reversed(stack):
        path = os.path.abspath(frame.filename)
        if path.startswith(REPO) and path != os.path.abspath(__file__):
            return f"{os.path.relpath(path, REPO)}:{frame.lineno} {frame.name}: {(frame.line or '').strip()}"
    return "(outside the project)"


def count_syncs(args) -> collections.Counter:
    import torch

    from mdgan_app.cli import main

    sites: collections.Counter = collections.Counter()

    def record(message, category, filename, lineno, file=None, line=None):
        if "synchroniz" in str(message).lower():  # ("called a synchronizing CUDA operation")
            sites[project_frame(traceback.extract_stack()[:-1])] += 1

    with tempfile.TemporaryDirectory(prefix="mdgan-syncs-") as out:
        shown = warnings.showwarning
        warnings.showwarning = record
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            code = main(simulate_argv(args, os.path.join(out, "run"), args.iterations))
        finally:
            torch.cuda.set_sync_debug_mode("default")
            warnings.showwarning = shown
            warnings.resetwarnings()
    if code:
        raise SystemExit(f"bench/gpu_syncs.py: simulate failed ({code})")
    return sites


def profile(args) -> None:
    import torch
    from torch.profiler import ProfilerActivity, profile as torch_profile

    from mdgan_app.cli import main

    with tempfile.TemporaryDirectory(prefix="mdgan-profile-") as out:
        main(simulate_argv(args, os.path.join(out, "warm"), 3))  # cuDNN, cuBLAS and the allocator warmed
        torch.cuda.synchronize()
        started = time.perf_counter()
        with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            code = main(simulate_argv(args, os.path.join(out, "run"), args.iterations))
            torch.cuda.synchronize()
        wall = time.perf_counter() - started
    if code:
        raise SystemExit(f"bench/gpu_syncs.py: simulate failed ({code})")
    events = prof.key_averages()
    kernel_us = sum(e.self_device_time_total for e in events if e.device_type == torch.autograd.DeviceType.CUDA)
    calls = {e.key: e.count for e in events}
    n = args.iterations
    print(f"\nprofile: {n} iterations in {wall:.2f} s wall (start-up, data loading and outputs included); "
          f"GPU kernels {kernel_us / 1e6:.3f} s = {kernel_us / 1e6 / wall:.1%} of wall")
    for name in ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cudaMemcpyAsync",
                 "cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "aten::item", "aten::_local_scalar_dense",
                 "aten::to", "aten::copy_", "aten::nonzero"):
        if name in calls:
            print(f"  {name:<28} {calls[name]:>8} calls, {calls[name] / n:>8.1f} an iteration")
    print(events.table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=60))
    print(events.table(sort_by="self_device_time_total", row_limit=15, max_name_column_width=60))
    if args.trace:
        prof.export_chrome_trace(args.trace)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, default=10)
    parser.add_argument("--iterations", type=int, default=30)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--trace", help="also write the profile's Chrome trace here (.json or .json.gz)")
    parser.add_argument("--no-profile", action="store_true", help="count the synchronisations only")
    parser.add_argument("--data-root", default=os.environ.get("MDGAN_DATA_ROOT", os.path.join(REPO, "..", "shared",
                                                                                             "data")))
    parser.add_argument("extra", nargs="*", help="more `mdgan simulate` flags, after --")
    args = parser.parse_args()
    import torch

    if not torch.cuda.is_available():
        print("bench/gpu_syncs.py: no CUDA device here")
        return 1
    print(f"bench/gpu_syncs.py on {torch.cuda.get_device_name(args.device)}, torch {torch.__version__}: CNN MNIST, "
          f"N = {args.workers}, b = 10, {args.iterations} iterations {' '.join(args.extra)}")
    sites = count_syncs(args)
    print(f"host synchronisations: {sum(sites.values())} in all, {sum(sites.values()) / args.iterations:.1f} an "
          f"iteration; by the project's line that asked (count, then the line):")
    for site, count in sites.most_common():
        print(f"  {count:>6}  {site}")
    if not args.no_profile:
        profile(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
