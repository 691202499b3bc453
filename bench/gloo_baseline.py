"""The plain torch.distributed (gloo) program of issue 12: MD-GAN's iteration with nothing around it.

    python bench/gloo_baseline.py --workers 4 --kappa 1 --batch-size 10 --iterations 300 \\
        --swap-every 100 --dataset mnist --data-root ../shared/data --out /tmp/gloo

One process per role (rank 0 the server, rank n+1 worker n), started by this script, talking over
gloo on loopback with point-to-point sends: X_g, X_d and their labels down, F_n up, and at a swap
each worker's discriminator to the next along the run's derangement. No TLS, no validation, no
metrics, no heartbeats, no checkpoints. The arithmetic is the library's own (GeneratorSide,
DiscriminatorSide, the same seeds and shards), so the run ends with the same generator, bit for bit,
as `mdgan simulate` with the same flags (float32 wire, --sync all, no churn).

It takes the flags of `mdgan simulate` and writes, like it, OUT/history.jsonl (a line per
iteration, as it goes) and OUT/summary.json (generator_sha256, swaps), so bench/local_vs_simulate.py
samples it like the other two modes (`--gloo`).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)


def _settings(flags: list[str]):
    """(TrainingConfig, DataConfig, out dir) from `mdgan simulate` flags."""
    from mdgan_app.cli import _resolve_workers, build_parser
    from services.common.settings import data_config, training_config

    args = build_parser().parse_args(["simulate", *flags])
    _resolve_workers(args)
    config = training_config(args)
    if config.wire_dtype != "float32" or config.sync != "all" or config.swap_every is None:
        raise SystemExit("the gloo baseline sends float32, waits for every worker and needs --swap-every "
                         "(--wire-dtype float32, --sync all)")
    return config, data_config(args, config.workers), args.out, args.threads


def _state_to_vector(state: dict):
    import torch

    return torch.cat([t.reshape(-1).to(torch.float32) for t in state.values()])


def _vector_to_state(vector, layout: dict) -> dict:
    out, offset = {}, 0
    for name, (shape, dtype) in layout.items():
        n = 1
        for s in shape:
            n *= s
        out[name] = vector[offset:offset + n].reshape(shape).to(dtype)
        offset += n
    return out


def _server(config, out: str) -> None:
    import torch
    import torch.distributed as dist

    from mdgan.gan import GeneratorSide
    from mdgan.run import generator_sha256

    side = GeneratorSide(config)
    n, b, shape = config.workers, config.batch_size, config.model.sample_shape
    period = config.swap_period(0)
    feedback = [torch.empty(b, *shape) for _ in range(n)]  # F_n: (b, *shape)
    swaps = 0
    with open(os.path.join(out, "history.jsonl"), "w") as history:
        for t in range(1, config.iterations + 1):
            started = time.perf_counter()
            batches = side.generate(min(config.kappa, n))
            sent = [batches.for_worker(rank) for rank in range(n)]
            pending = []
            for rank, batch in enumerate(sent):
                for tensor in (batch.generated, batch.discriminated, batch.generated_labels, batch.discriminated_labels):
                    pending.append(dist.isend(tensor.contiguous(), rank + 1))
            pending += [dist.irecv(feedback[rank], rank + 1) for rank in range(n)]
            for request in pending:
                request.wait()
            side.update(batches, [(batch.generated_index, f) for batch, f in zip(sent, feedback)])
            if t % period == 0 and n >= 2:
                swaps += 1  # the workers swap among themselves; the server only counts
            history.write(json.dumps({"iteration": t, "seconds": time.perf_counter() - started}) + "\n")
            history.flush()
    with open(os.path.join(out, "summary.json"), "w") as fh:
        json.dump({"mode": "gloo", "iterations": config.iterations, "workers": n, "swaps": swaps,
                   "generator_sha256": generator_sha256(side.generator)}, fh, indent=2)


def _worker(config, data, index: int) -> None:
    import torch
    import torch.distributed as dist

    from mdgan.data import load_shard
    from mdgan.gan import DiscriminatorSide, WorkerBatch, derangement

    side = DiscriminatorSide(config, load_shard(data, index, config.model.sample_shape))
    n, b, shape = config.workers, config.batch_size, config.model.sample_shape
    period = config.swap_period(len(side.sampler.shard))
    ids = [f"worker-{i}" for i in range(n)]
    layout = side.state_layout()
    size = sum(_numel(s) for s, _ in layout.values())
    x_g, x_d = torch.empty(b, *shape), torch.empty(b, *shape)  # (b, *shape) float32
    y_g, y_d = torch.empty(b, dtype=torch.int64), torch.empty(b, dtype=torch.int64)  # (b,)
    swap_round = 0
    for t in range(1, config.iterations + 1):
        for request in [dist.irecv(x, 0) for x in (x_g, x_d, y_g, y_d)]:
            request.wait()
        result = side.step(WorkerBatch(x_g, y_g if config.model.conditional else None,
                                       x_d, y_d if config.model.conditional else None, 0))
        dist.send(result.feedback.contiguous(), 0)
        if t % period == 0 and n >= 2:
            swap_round += 1
            plan = derangement(ids, config.seed, swap_round)
            me = ids[index]
            source = next(s for s, d in plan.items() if d == me)
            incoming = torch.empty(size)
            requests = [dist.isend(_state_to_vector(side.export_state()), ids.index(plan[me]) + 1),
                        dist.irecv(incoming, ids.index(source) + 1)]
            for request in requests:
                request.wait()
            side.import_state(_vector_to_state(incoming, layout))


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def rank_main(rank: int, world: int, port: int, flags: list[str]) -> None:
    import torch
    import torch.distributed as dist

    config, data, out, threads = _settings(flags)
    torch.set_num_threads(max(1, threads))
    if os.environ.get("GLOO_CPU_SCHEDULING") == "batch":  # as `mdgan local --cpu-scheduling batch` runs its services
        from services.common import scheduling

        scheduling.apply("batch")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        if rank == 0:
            _server(config, out)
        else:
            _worker(config, data, rank - 1)
    finally:
        dist.destroy_process_group()


def main(flags: list[str]) -> int:
    config, _, out, _ = _settings(flags)
    os.makedirs(out, exist_ok=True)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    world = config.workers + 1
    ranks = [subprocess.Popen([sys.executable, os.path.abspath(__file__), "--rank", str(r), str(world), str(port),
                               *flags], cwd=REPO) for r in range(world)]
    codes = [p.wait() for p in ranks]
    return max(codes, key=abs)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--rank"]:
        rank_main(int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5:])
    else:
        sys.exit(main(sys.argv[1:]))
