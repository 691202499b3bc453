"""Wire compression over real processes: the same generator as in one process, and the bytes it saves."""

from __future__ import annotations

import json

import pytest

from procs import read_json
from test_e2e import D, THETA, mdgan, table_iii

pytestmark = pytest.mark.slow

FLAGS = ["--workers", "3", "--kappa", "2", "--iterations", "6", "--batch-size", "10", "--swap-every", "3",
         "--seed", "4", "--eval-every", "-1", "--no-progress"]


def _local_and_simulated(tmp_path, mnist_root, wire: str, *extra: str) -> tuple[dict, dict]:
    flags = [*FLAGS, "--data-root", mnist_root, "--wire-dtype", wire, *extra]
    mdgan("local", *flags, "--out", str(tmp_path / "local"))
    mdgan("simulate", *flags, "--out", str(tmp_path / "simulate"))
    return read_json(tmp_path / "local" / "summary.json"), read_json(tmp_path / "simulate" / "summary.json")


def test_float16_halves_table_iii_and_local_equals_simulate(tmp_path, mnist_root):
    local, simulated = _local_and_simulated(tmp_path, mnist_root, "float16")
    assert local["generator_sha256"] == simulated["generator_sha256"]
    assert local["swaps"] == simulated["swaps"] == 2
    fp32 = table_iii(6, 3, 10, swaps=2)
    half = {direction: nbytes // 2 for direction, nbytes in fp32.items()}
    assert 2 * half["worker_to_worker"] == fp32["worker_to_worker"]  # |theta| floats, every one halved
    assert local["payload_bytes"] == simulated["payload_bytes"] == half
    # every process's Prometheus counters say the same, at both ends of every direction
    report = json.loads(mdgan("traffic", str(tmp_path / "local"), "--json").stdout)
    assert report["wire_dtype"] == "float16"
    for row in report["rows"]:
        assert row["payload_bytes"] == half[row["direction"]] == row["formula_bytes"], row
        assert row["ratio_to_fp32"] == 0.5


def test_int8_local_equals_simulate_at_a_quarter_of_the_bytes(tmp_path, mnist_root):
    # with an emulated attacker (mdgan-worker --attack) and a robust rule on the way: both transports
    # still agree bit for bit (the attacker's noise is seeded, the median is summed in rank order)
    local, simulated = _local_and_simulated(tmp_path, mnist_root, "int8", "--aggregation", "median",
                                            "--byzantine", "1", "--attack", "noise")
    assert local["generator_sha256"] == simulated["generator_sha256"]
    assert "emulating a Byzantine worker" in (tmp_path / "local" / "logs" / "worker-2.log").read_text()
    b = 10
    per_tensor = b * D + 4 * b  # one byte a value, one float32 scale per sample
    assert local["payload_bytes"]["server_to_worker"] == 6 * 3 * 2 * per_tensor
    assert local["payload_bytes"]["worker_to_server"] == 6 * 3 * per_tensor
    assert local["payload_bytes"] == simulated["payload_bytes"]
    fp32 = table_iii(6, 3, 10, swaps=2)
    for direction, nbytes in local["payload_bytes"].items():
        assert nbytes <= 0.26 * fp32[direction], direction
    assert local["payload_bytes"]["worker_to_worker"] > 2 * 3 * THETA  # at least a byte a weight
    report = json.loads(mdgan("traffic", str(tmp_path / "local"), "--json").stdout)
    assert all(row["payload_matches_formula"] for row in report["rows"]), report["rows"]
