"""The same code on CPU and CUDA (CUDA tests run where a GPU is present; CI has none)."""

import dataclasses

import pytest
import torch

from mdgan.config import ConfigError, DataConfig, TrainingConfig
from mdgan.simulation import simulate

CUDA = torch.cuda.is_available()


@pytest.mark.skipif(CUDA, reason="this machine has CUDA")
def test_asking_for_a_missing_gpu_is_a_clear_error():
    with pytest.raises(ConfigError, match="no CUDA device"):
        TrainingConfig(device="cuda").validate()
    with pytest.raises(ConfigError, match="cpu, cuda or cuda:N"):
        TrainingConfig(device="tpu").validate()


@pytest.mark.skipif(not CUDA, reason="no CUDA device")
@pytest.mark.parametrize("algorithm", ["mdgan", "flgan", "standalone"])
def test_cuda_runs_follow_the_cpu_runs(tmp_path, algorithm):
    config = TrainingConfig(workers=3, kappa=2, iterations=5, batch_size=8, swap_every=2, seed=5).validate()
    data = DataConfig("synthetic", num_shards=3)
    summaries = {}
    for device in ("cpu", "cuda"):
        summaries[device] = simulate(dataclasses.replace(config, device=device), data, str(tmp_path / device),
                                     progress=False, algorithm=algorithm)
    cpu, gpu = (torch.load(tmp_path / d / "checkpoint.pt", map_location="cpu", weights_only=True)["generator"]
                for d in ("cpu", "cuda"))
    for name, tensor in cpu.items():
        torch.testing.assert_close(gpu[name], tensor, rtol=1e-3, atol=1e-4, msg=name)
    assert summaries["cpu"]["payload_bytes"] == summaries["cuda"]["payload_bytes"]
