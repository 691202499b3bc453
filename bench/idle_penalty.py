"""What a pause before a step costs on this machine: the same discriminator step (MNIST MLP ACGAN's
D, b=10, one torch thread, Adam), run back to back and then after sleeps of 1, 5 and 20 ms.

    python bench/idle_penalty.py
    python bench/idle_penalty.py --steps 500 --neighbours 2   # with 2 busy processes beside it

Any program that splits an iteration across processes (`mdgan local`, the gloo baseline) makes each
process wait for its peers between steps; `mdgan simulate` never waits. On a virtual machine whose
idle core is lent to others, a step after a wait finds its caches cold and costs more CPU: this
prints that cost as a ratio to the back-to-back step, measured in the same run.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from mdgan.config import TrainingConfig  # noqa: E402
from mdgan.gan import make_adam  # noqa: E402
from mdgan.models import build_discriminator  # noqa: E402


def busy(seconds: float) -> None:
    torch.set_num_threads(1)
    a, w = torch.randn(256, 784), torch.randn(784, 512)
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        (a @ w).relu_()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--neighbours", type=int, default=0, help="busy processes running beside the steps")
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    config = TrainingConfig()
    spec = config.model
    disc = build_discriminator(spec, seed=0)
    adam = make_adam(disc, config.discriminator_optimizer)
    x = torch.randn(config.batch_size, *spec.sample_shape)

    def step() -> None:
        adam.zero_grad()
        disc(x).square().mean().backward()
        adam.step()

    pauses = (0.0, 0.001, 0.005, 0.02)
    neighbours = [multiprocessing.Process(target=busy, args=(60.0 * len(pauses),), daemon=True)
                  for _ in range(args.neighbours)]
    for process in neighbours:
        process.start()
    for _ in range(50):
        step()
    base = None
    print(f"{os.cpu_count()} cores, {args.neighbours} busy neighbours, {args.steps} steps per pause")
    for pause in pauses:
        cpu = 0.0
        for _ in range(args.steps):
            if pause:
                time.sleep(pause)
            started = time.thread_time()
            step()
            cpu += time.thread_time() - started
        per_step = 1e6 * cpu / args.steps
        base = base or per_step
        print(f"  pause {1000 * pause:4.0f} ms before each step: {per_step:6.0f} us CPU per step, "
              f"{per_step / base:.2f}x back to back", flush=True)
    for process in neighbours:
        process.terminate()
    return 0


if __name__ == "__main__":
    sys.exit(main())
