"""The same code on CPU and CUDA: every algorithm and feature on CUDA ends within float32's spread of the
same run on the CPU (CUDA cases run where a GPU is present, CI has none: scripts/gpu_check.sh)."""

import dataclasses
import os

import pytest
import torch

from conftest import CUDA, NO_CUDA, cuda_only
from mdgan.algorithms.psgan import PSGANOptions
from mdgan.algorithms.mdgan.options import MDGANOptions
from mdgan.config import ConfigError, DataConfig, PrivacySpec, TrainingConfig
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
    ("dp-sgd", "mdgan", {"privacy": PrivacySpec(noise_multiplier=1.0)}, {}),
    ("dp-feedback", "mdgan", {"privacy": PrivacySpec(noise_multiplier=1.0, mechanism="feedback", discriminators=2),
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
    for name, tensor in cpu.items():
        torch.testing.assert_close(gpu[name], tensor, rtol=1e-3, atol=1e-4, msg=name)
    for key in ("payload_bytes", "iterations", "swaps", "swaps_refused", "workers_alive"):
        assert summaries["cpu"].get(key) == summaries["cuda"].get(key), key


@cuda_only
def test_the_same_cuda_run_twice_is_the_same_generator(tmp_path):
    """Deterministic kernels (mdgan/devices.py): the same run on the same card, bit for bit."""
    config = dataclasses.replace(BASE, device="cuda", architecture="cnn-mnist").validate()
    data = DataConfig("synthetic", num_shards=3)
    hashes = [simulate(config, data, str(tmp_path / str(i)), progress=False)["generator_sha256"] for i in range(2)]
    assert hashes[0] == hashes[1]
    assert os.environ.get("CUBLAS_WORKSPACE_CONFIG") and torch.are_deterministic_algorithms_enabled()


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
