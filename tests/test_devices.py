"""The same code on CPU and CUDA: every algorithm and feature on CUDA ends within float32's spread of the
same run on the CPU (CUDA cases run where a GPU is present, CI has none: scripts/gpu_check.sh)."""

import contextlib
import dataclasses
import os

import pytest
import torch

from conftest import CUDA, NO_CUDA, cuda_only
from mdgan import adam, cuda_graphs, cuda_lanes
from mdgan.algorithms.psgan import PSGANOptions
from mdgan.algorithms.mdgan.options import MDGANOptions
from mdgan.config import ConfigError, DataConfig, PrivacySpec, TrainingConfig
from mdgan.gan import derive_seed
from mdgan.models import build_generator
from mdgan.simulation import Emulation, simulate


@pytest.mark.skipif(CUDA, reason="this machine has CUDA")
def test_asking_for_a_missing_gpu_is_a_clear_error():
    with pytest.raises(ConfigError, match="no CUDA device"):
        TrainingConfig(device="cuda").validate()
    with pytest.raises(ConfigError, match="cpu, cuda or cuda:N"):
        TrainingConfig(device="tpu").validate()


@cuda_only
def test_a_cuda_index_beyond_the_machines_is_a_clear_error():
    with pytest.raises(ConfigError, match="this machine has CUDA devices 0 to"):
        TrainingConfig(device=f"cuda:{torch.cuda.device_count()}").validate()
    with pytest.raises(ConfigError, match="this machine has CUDA devices 0 to"):
        TrainingConfig(device="cuda:x").validate()
    TrainingConfig(device=f"cuda:{torch.cuda.device_count() - 1}").validate()


BASE = TrainingConfig(workers=3, kappa=2, iterations=6, batch_size=8, swap_every=2, seed=5)
# (case, algorithm, config changes, simulate's other arguments)
FEATURES = [
    ("mdgan", "mdgan", {}, {}),
    ("flgan", "flgan", {}, {}),
    ("standalone", "standalone", {}, {}),
    ("pwgan", "pwgan", {"kappa": 1, "wire_dtype": "float32"}, {}),
    ("psgan", "psgan", {"kappa": 1}, {"options": PSGANOptions(threshold=2)}),
    ("dp-sgd", "mdgan", {"privacy": PrivacySpec(noise_multiplier=1.0, fixed_noise=1)}, {}),
    ("dp-feedback", "mdgan", {"privacy": PrivacySpec(noise_multiplier=1.0, mechanism="feedback", discriminators=2,
                                                     fixed_noise=1),
                              "swap_every": None}, {}),
    ("checked-swaps", "mdgan", {}, {"emulation": Emulation(byzantine=1, attack="swap-sign-flip")}),
    ("int8-wire", "mdgan", {"wire_dtype": "int8"}, {}),
    ("median", "mdgan", {"aggregation": "median", "kappa": 1}, {}),
    ("trimmed-mean", "mdgan", {"aggregation": "trimmed-mean", "kappa": 1}, {}),
    ("norm-clip", "mdgan", {"aggregation": "norm-clip", "clip_norm": 0.05, "kappa": 1}, {}),
    ("background-swaps", "mdgan", {"iterations": 7}, {"options": MDGANOptions(swap_lag=1)}),
    ("crashes", "mdgan", {}, {"emulation": Emulation(crash_every=2)}),
]


@pytest.mark.parametrize("case, algorithm, changes, extra", FEATURES, ids=[f[0] for f in FEATURES])
@cuda_only
def test_cuda_runs_follow_the_cpu_runs(tmp_path, case, algorithm, changes, extra):
    config = dataclasses.replace(BASE, **changes).validate()
    data = DataConfig("synthetic", num_shards=3)
    summaries = {}
    for device in ("cpu", "cuda"):
        summaries[device] = simulate(dataclasses.replace(config, device=device), data, str(tmp_path / device),
                                     progress=False, algorithm=algorithm, **extra)
    cpu, gpu = (torch.load(tmp_path / d / "checkpoint.pt", map_location="cpu", weights_only=True)["generator"]
                for d in ("cpu", "cuda"))
    if config.wire_dtype == "int8":
        # A value that lands near a rounding boundary of the int8 wire goes one level up on one device and down on
        # the other: the runs stay together measured against how far G moved, not element by element.
        start = build_generator(config.model, derive_seed(config.seed, "generator-init")).state_dict()
        apart = sum(float((gpu[n] - t).square().sum()) for n, t in cpu.items()) ** 0.5
        moved = sum(float((t - start[n]).square().sum()) for n, t in cpu.items()) ** 0.5
        assert apart < 0.1 * moved, f"CUDA's G is {apart:.3g} from the CPU's, which moved {moved:.3g} from the start"
    else:
        for name, tensor in cpu.items():
            torch.testing.assert_close(gpu[name], tensor, rtol=1e-3, atol=1e-4, msg=name)
    for key in ("payload_bytes", "iterations", "swaps", "swaps_refused", "workers_alive"):
        assert summaries["cpu"].get(key) == summaries["cuda"].get(key), key


@cuda_only
def test_the_same_cuda_run_twice_is_the_same_generator(tmp_path):
    """Deterministic kernels (mdgan/devices.py): the same run on the same card, bit for bit."""
    config = dataclasses.replace(BASE, device="cuda", model=dataclasses.replace(BASE.model, architecture="cnn-mnist"))
    config = config.validate()
    data = DataConfig("synthetic", num_shards=3)
    hashes = [simulate(config, data, str(tmp_path / str(i)), progress=False)["generator_sha256"] for i in range(2)]
    assert hashes[0] == hashes[1]
    assert os.environ.get("CUBLAS_WORKSPACE_CONFIG") and torch.are_deterministic_algorithms_enabled()


CNN = dataclasses.replace(BASE.model, architecture="cnn-mnist")
GRAPHED = FEATURES + [("cnn-two-d-steps", "mdgan", {"model": CNN, "disc_steps": 2}, {}),
                      ("plain-gan", "mdgan", {"model": dataclasses.replace(BASE.model, gan="gan")}, {}),
                      # batches made again inside an iteration: each generation's steps wait for their own batches
                      ("async", "mdgan", {"sync": "async", "max_staleness": 4}, {})]
# the cases whose workers take MD-GAN's plain step (DP-SGD's steps and the other algorithms run eagerly)
USES_GRAPHS = {"mdgan", "dp-feedback", "checked-swaps", "int8-wire", "median", "trimmed-mean", "norm-clip",
               "background-swaps", "crashes", "cnn-two-d-steps", "plain-gan", "async"}


@pytest.mark.parametrize("case, algorithm, changes, extra", GRAPHED, ids=[f[0] for f in GRAPHED])
@cuda_only
def test_cuda_graphs_leave_what_a_run_computes_as_it_was(tmp_path, monkeypatch, case, algorithm, changes, extra):
    """mdgan/cuda_graphs.py, mdgan/cuda_lanes.py and mdgan/adam.py's flat form: a run with its workers' steps
    replayed from CUDA graphs, each worker on a stream of its own, every Adam over its parameters laid end to end,
    ends with the generator of the same run stepped eagerly one worker after the other on one stream with Adam's
    per-tensor loop, bit for bit."""
    config = dataclasses.replace(BASE, device="cuda", **changes).validate()
    replays = []
    replay = cuda_graphs.GraphedStep.disc_steps
    monkeypatch.setattr(cuda_graphs.GraphedStep, "disc_steps", lambda self, *a: replays.append(1) or replay(self, *a))
    hashes = {}
    for graphs in ("0", "1"):
        monkeypatch.setenv(cuda_graphs.ENVIRONMENT, graphs)
        monkeypatch.setenv(cuda_lanes.ENVIRONMENT, graphs)
        monkeypatch.setenv(adam.ENVIRONMENT, graphs)
        hashes[graphs] = simulate(config, DataConfig("synthetic", num_shards=3), str(tmp_path / graphs),
                                  progress=False, algorithm=algorithm, **extra)["generator_sha256"]
        if graphs == "0":
            assert not replays
    assert hashes["0"] == hashes["1"]
    assert bool(replays) == (case in USES_GRAPHS), f"{len(replays)} graphed steps"


def test_each_call_of_the_generator_makes_batches_of_a_generation_of_their_own():
    """--sync async makes batches again inside an iteration; a lane's step must wait for the batches it is given,
    not for those the iteration's first step found: the gate is keyed by the batches' generation."""
    from mdgan.gan import GeneratorSide

    side = GeneratorSide(dataclasses.replace(BASE, kappa=2).validate())
    first, second = side.generate(2), side.generate(2)
    again = side.regenerate(first)
    assert len({first.generation, second.generation, again.generation}) == 3 and 0 not in {first.generation}
    assert {first.for_worker(r).generation for r in range(3)} == {first.generation}
    assert second.for_worker(0).generation == second.generation  # (the CUDA case "async" above runs the lanes)


class EmulatedGraph:
    """A CUDA graph's contract, on the CPU: capture hands back the work's outputs; each replay runs the work again
    and writes its results into those same tensors, D's gradients included (a real replay's kernels write there)."""

    def __init__(self):
        self.work = self.outputs = None

    def pool(self):
        return None

    def capture(self, work):
        self.work, self.outputs = work, work()
        return self.outputs

    def replay(self):
        parameters = self.work.__self__.parameters
        captured = [p.grad for p in parameters]
        for p in parameters:
            p.grad = None
        fresh = self.work()
        for old, new in zip(torch.utils._pytree.tree_leaves(self.outputs), torch.utils._pytree.tree_leaves(fresh)):
            old.copy_(new)
        for p, grad in zip(parameters, captured):
            if grad is not None and p.grad is not None:
                grad.copy_(p.grad)
            p.grad = grad


@pytest.mark.parametrize("changes", [{}, {"disc_steps": 3, "kappa": 1},
                                     {"model": dataclasses.replace(BASE.model, gan="gan")}],
                         ids=["acgan", "three-d-steps", "plain-gan"])
def test_a_graphed_step_is_the_eager_step_with_graphs_emulated_on_the_cpu(tmp_path, monkeypatch, changes):
    """mdgan/cuda_graphs.py's bookkeeping (inputs into the captured buffers, L replays each followed by Adam, the
    gradients D's optimizer reads, the outputs copied out) with graphs that keep a CUDA graph's contract on the CPU:
    the run ends where the eager run ends (on CUDA: test_cuda_graphs_leave_what_a_run_computes_as_it_was)."""
    config = dataclasses.replace(BASE, **changes).validate()
    data = DataConfig("synthetic", num_shards=3)
    eager = simulate(config, data, str(tmp_path / "eager"), progress=False)["generator_sha256"]
    monkeypatch.setattr(cuda_graphs, "wanted", lambda device: True)
    monkeypatch.setattr(cuda_graphs.GraphedStep, "_record", lambda self, graph, work, pool=None: graph.capture(work))
    monkeypatch.setattr(torch.cuda, "CUDAGraph", EmulatedGraph)
    stream = type("Stream", (), {"__init__": lambda self, device=None: None, "wait_stream": lambda self, other: None})
    monkeypatch.setattr(torch.cuda, "Stream", stream)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "current_stream", stream)
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    replays = []
    replay = cuda_graphs.GraphedStep.disc_steps
    monkeypatch.setattr(cuda_graphs.GraphedStep, "disc_steps", lambda self, *a: replays.append(1) or replay(self, *a))
    graphed = simulate(config, data, str(tmp_path / "graphed"), progress=False)["generator_sha256"]
    assert len(replays) == config.iterations * config.workers
    assert graphed == eager


ON_CUDA = [pytest.mark.cuda, pytest.mark.skipif(not CUDA, reason=NO_CUDA)]


@pytest.mark.parametrize("server, workers", [("cpu", "cpu"), pytest.param("cuda", "cpu", marks=ON_CUDA),
                                             pytest.param("cpu", "cuda", marks=ON_CUDA)])
def test_a_server_and_workers_on_different_devices_train_as_one_device_does(tmp_path, server, workers):
    """The bare services, the server on one device and its workers on another: what crosses the wire is the
    same whatever the devices, so the run follows the all-CPU simulate within float32's spread (all on the
    CPU: bit for bit)."""
    import asyncio

    from test_faults import WORKERS, _run_cluster

    async def run():
        return await _run_cluster(str(tmp_path / "mixed"), ["--device", server], worker_flags=["--device", workers])

    server_code, worker_codes, _ = asyncio.run(run())
    assert server_code == 0 and worker_codes == [0] * WORKERS
    config = TrainingConfig(workers=WORKERS, iterations=12, swap_every=4).validate()
    simulate(config, DataConfig("synthetic", num_shards=WORKERS), str(tmp_path / "cpu"), progress=False)
    mixed, cpu = (torch.load(tmp_path / d / "checkpoint.pt", map_location="cpu", weights_only=True)["generator"]
                  for d in ("mixed", "cpu"))
    if server == workers == "cpu":
        assert all(torch.equal(mixed[name], tensor) for name, tensor in cpu.items())
    for name, tensor in cpu.items():
        torch.testing.assert_close(mixed[name], tensor, rtol=1e-3, atol=1e-4, msg=name)


def test_a_tensor_already_on_its_device_is_not_copied():
    """devices.resolve names `cuda` by its index, as every tensor's device is named, so to_device (and
    WorkerBatch.to) find a tensor already there by plain equality and return it as it is."""
    from mdgan.data import load_shard
    from mdgan.devices import resolve, to_device
    from mdgan.gan import DiscriminatorSide

    cpu = torch.ones(3)
    assert resolve("cpu") == torch.device("cpu") and to_device(cpu, resolve("cpu")) is cpu
    assert resolve("cuda:1") == torch.device("cuda", 1)  # an index given is kept (no CUDA asked)
    if CUDA:  # `cuda` is the current device
        here = resolve("cuda")
        assert here == torch.device("cuda", torch.cuda.current_device())
        on_card = torch.ones(3, device="cuda")
        assert on_card.device == here and to_device(on_card, here) is on_card
        moved = to_device(cpu, here)
        assert moved.device == here and torch.equal(moved.cpu(), cpu)
        side = DiscriminatorSide(TrainingConfig(device="cuda", workers=2, batch_size=4).validate(),
                                 load_shard(DataConfig("synthetic", num_shards=2), 0))
        assert side.device == here
