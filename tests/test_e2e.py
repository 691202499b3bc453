"""Real processes talking real gRPC on loopback."""

from __future__ import annotations

import json
import os
import signal

import pytest

from procs import mdgan, read_json, read_jsonl, start_server, start_worker, wait_for_iterations

pytestmark = pytest.mark.slow

D = 784  # MNIST sample size
THETA = 670_219  # |theta| of the paper's MLP discriminator


def table_iii(iterations: int, workers: int, b: int, swaps: int) -> dict:
    """The paper's Table III, in bytes at fp32, for a run without failures."""
    return {"server_to_worker": iterations * workers * 2 * b * D * 4,
            "worker_to_server": iterations * workers * b * D * 4,
            "worker_to_worker": swaps * workers * THETA * 4}


def test_local_cluster_and_simulation_end_with_the_same_generator(tmp_path, mnist_root, device):
    flags = ["--workers", "3", "--kappa", "2", "--iterations", "12", "--batch-size", "10", "--disc-steps", "2",
             "--swap-every", "5", "--seed", "4", "--data-root", mnist_root, "--no-progress", "--device", device]
    # workers 0 and 1 share a process, worker 2 has one of its own: a swap crosses both kinds of boundary
    mdgan("local", *flags, "--workers-per-process", "2", "--out", str(tmp_path / "local"))
    mdgan("simulate", *flags, "--out", str(tmp_path / "simulate"))
    local, simulated = read_json(tmp_path / "local" / "summary.json"), read_json(tmp_path / "simulate" / "summary.json")

    assert local["mode"] == "local" and simulated["mode"] == "simulate"
    assert local["exit_codes"] == {"server": 0, "worker-0": 0, "worker-1": 0, "worker-2": 0}
    for name in ("worker-0", "worker-1", "worker-2"):  # each worker its own log, shared process or not
        text = (tmp_path / "local" / "logs" / f"{name}.log").read_text()
        assert f"as {name}:" in text and "finished: run finished" in text
        assert not [w for w in ("worker-0", "worker-1", "worker-2") if w != name and f"as {w}:" in text]
    assert (tmp_path / "local" / "logs" / "workers-0-1.log").exists()
    assert local["swaps"] == simulated["swaps"] == 2
    assert local["generator_sha256"] == simulated["generator_sha256"]
    assert local["iterations"] == 12 and local["workers"] == local["workers_alive"] == 3

    # The payload counted on the wire is the paper's Table III, exactly.
    expected = table_iii(12, 3, 10, swaps=2)
    assert local["payload_bytes"] == expected
    assert simulated["payload_bytes"] == expected
    assert local["label_bytes"] == 12 * 3 * 2 * 10 * 8  # ACGAN labels ride along, counted apart

    # Every swap round over gRPC: each worker sent one D and received one, from another worker.
    swaps = read_jsonl(tmp_path / "local" / "swaps.jsonl")
    assert [s["iteration"] for s in swaps] == [5, 10]
    for record in swaps:
        plan = record["plan"]
        assert sorted(plan) == sorted(plan.values()) == ["worker-0", "worker-1", "worker-2"]
        assert all(src != dst for src, dst in plan.items())
        assert all(w["sent"] and w["received"] and w["sent_bytes"] == THETA * 4 for w in record["workers"].values())

    # Serialized messages carry the payload plus a little framing and control.
    for direction in ("server_to_worker", "worker_to_server", "worker_to_worker"):
        assert local["message_bytes"][direction] > local["payload_bytes"][direction]
    for name in ("history.jsonl", "samples.png", "checkpoint.pt"):
        assert (tmp_path / "local" / name).stat().st_size > 0
    assert len(read_jsonl(tmp_path / "local" / "history.jsonl")) == 12

    # The Prometheus counters of every process, saved at the end, reproduce Table III at both ends
    # of every direction; serialized messages add under 2% at b = 10 on MNIST.
    assert sorted(os.listdir(tmp_path / "local" / "metrics")) == ["server.prom", "worker-0.prom", "worker-1.prom",
                                                                  "worker-2.prom"]
    report = json.loads(mdgan("traffic", str(tmp_path / "local"), "--json").stdout)
    assert len(report["rows"]) == 6
    for row in report["rows"]:
        assert row["payload_bytes"] == expected[row["direction"]] == row["formula_bytes"], row
        assert 0 < row["overhead"] < 0.02, row
    table = mdgan("traffic", str(tmp_path / "local")).stdout
    assert "C->W" in table and "W->W" in table and "NO" not in table


def test_a_narrower_discriminator_is_the_workers_own_and_swaps_at_its_size(tmp_path, mnist_root):
    # --disc-width reaches the workers in the TrainingSpec: they build, train and swap D of that width
    flags = ["--workers", "2", "--iterations", "6", "--batch-size", "10", "--swap-every", "3", "--seed", "2",
             "--disc-width", "32", "--data-root", mnist_root, "--no-progress"]
    mdgan("local", *flags, "--out", str(tmp_path / "local"))
    mdgan("simulate", *flags, "--out", str(tmp_path / "simulate"))
    local, simulated = read_json(tmp_path / "local" / "summary.json"), read_json(tmp_path / "simulate" / "summary.json")
    assert local["generator_sha256"] == simulated["generator_sha256"]
    narrow = D * 32 + 32 + 32 * 32 + 32 + 32 * 11 + 11  # two hidden layers of 32, 1 + 10 outputs
    assert local["payload_bytes"]["worker_to_worker"] == simulated["payload_bytes"]["worker_to_worker"] \
        == 2 * 2 * narrow * 4  # 2 swaps, 2 workers, float32
    report = json.loads(mdgan("traffic", str(tmp_path / "local"), "--json").stdout)
    assert report["discriminator_bytes"] == narrow * 4  # the formula knows the width too
    assert all(row["payload_bytes"] == row["formula_bytes"] for row in report["rows"]), report["rows"]


def test_background_swaps_over_grpc_equal_the_in_process_run_refusals_included(tmp_path, mnist_root, device):
    """--swap-lag 3: the discriminators of a round leave at its boundary and are installed 3 iterations later,
    on both transports at the same points; a member pushing a sign-flipped D is refused at the install, by
    the same check; Table III's bytes are those of the barrier's rounds."""
    flags = ["--workers", "3", "--iterations", "13", "--batch-size", "10", "--swap-every", "5", "--seed", "4",
             "--swap-lag", "3", "--byzantine", "1", "--attack", "swap-sign-flip", "--data-root", mnist_root,
             "--no-progress", "--device", device]
    mdgan("local", *flags, "--out", str(tmp_path / "local"))
    mdgan("simulate", *flags, "--out", str(tmp_path / "simulate"))
    local, simulated = read_json(tmp_path / "local" / "summary.json"), read_json(tmp_path / "simulate" / "summary.json")
    assert local["generator_sha256"] == simulated["generator_sha256"]
    assert local["mdgan"]["swap_lag"] == simulated["mdgan"]["swap_lag"] == 3
    assert local["payload_bytes"] == simulated["payload_bytes"] == table_iii(13, 3, 10, swaps=2)
    swaps = read_jsonl(tmp_path / "local" / "swaps.jsonl")
    assert [(s["iteration"], s["installed"]) for s in swaps] == [(5, 8), (10, 13)]
    for record in swaps:
        poisoned = record["workers"][record["plan"]["worker-2"]]  # the attacker's receiver
        assert not poisoned["received"] and poisoned["refused"].startswith("its weights point away")
        assert sum(w["received"] for w in record["workers"].values()) == 2
    assert local["swaps_refused"] == simulated["swaps_refused"] == 2
    receivers = {f"worker-{i}": 0 for i in range(3)}
    for record in swaps:
        receivers[record["plan"]["worker-2"]] += 1
    for name, refused in receivers.items():  # counted by the worker that refused it
        text = (tmp_path / "local" / "metrics" / f"{name}.prom").read_text()
        counted = [float(line.split()[-1]) for line in text.splitlines()
                   if line.startswith('mdgan_rejected_inputs_total{') and 'reason="discriminator"' in line]
        assert sum(counted) == refused, (name, counted)


def test_a_worker_killed_mid_run_costs_at_most_one_deadline(tmp_path):
    out = str(tmp_path)
    step_timeout = 20.0
    server, port = start_server(out, "--workers", "3", "--iterations", "150", "--swap-every", "20",
                                "--step-timeout", str(step_timeout), "--gan", "gan")
    workers = [start_worker(out, port, i, 3, "--dataset", "synthetic") for i in range(3)]
    try:
        history = os.path.join(out, "history.jsonl")
        wait_for_iterations(server, out, 30)
        workers[1].popen.send_signal(signal.SIGKILL)
        assert server.wait(180) == 0, server.log()
        summary = read_json(os.path.join(out, "summary.json"))
        records = read_jsonl(history)
    finally:
        for p in [server, *workers]:
            p.kill()
    assert summary["iterations"] == 150 and len(records) == 150
    assert summary["workers"] == 3 and summary["workers_alive"] == 2
    assert records[0]["active_workers"] == 3 and records[-1]["active_workers"] == 2
    lost_at = [r for r in records if r["lost"]]
    assert len(lost_at) == 1
    assert lost_at[0]["seconds"] < step_timeout + 5  # one deadline at most, never a hang
    # lost in a step (that iteration goes on with 2) or in a swap (after 3 answered): 2 from then on
    assert lost_at[0]["answered"] in (2, 3)
    assert all(r["answered"] == 2 for r in records[records.index(lost_at[0]) + 1:])
    for p in (workers[0], workers[2]):
        assert p.popen.returncode == 0, p.log()


def test_workers_can_take_shards_the_server_assigns(tmp_path):
    out = str(tmp_path / "grpc")
    flags = ["--workers", "2", "--iterations", "6", "--swap-every", "3", "--seed", "8", "--gan", "gan"]
    server, port = start_server(out, *flags)
    from services.common.healthcheck import main as healthcheck
    assert healthcheck([f"127.0.0.1:{port}", "--service", "mdgan.v1.Coordinator", "--insecure"]) == 0
    workers = [start_worker(out, port, "assign", 1, "--dataset", "synthetic") for _ in range(2)]
    try:
        assert server.wait(120) == 0, server.log()
    finally:
        for p in [server, *workers]:
            p.kill()
    mdgan("simulate", *flags, "--dataset", "synthetic", "--no-progress", "--out", str(tmp_path / "sim"))
    grpc_summary, sim_summary = read_json(os.path.join(out, "summary.json")), read_json(tmp_path / "sim" / "summary.json")
    assert grpc_summary["workers_alive"] == 2
    assert grpc_summary["generator_sha256"] == sim_summary["generator_sha256"]
    assert "assigned shard" in workers[0].log() + workers[1].log()


def test_flgan_over_grpc_equals_flgan_in_process_and_table_iii(tmp_path, device):
    flags = ["--algorithm", "flgan", "--workers", "3", "--iterations", "10", "--swap-every", "4", "--seed", "2",
             "--dataset", "synthetic", "--no-progress", "--device", device]
    mdgan("local", *flags, "--workers-per-process", "1", "--out", str(tmp_path / "local"))  # a process each
    mdgan("simulate", *flags, "--out", str(tmp_path / "simulate"))
    local, simulated = read_json(tmp_path / "local" / "summary.json"), read_json(tmp_path / "simulate" / "summary.json")
    assert local["algorithm"] == simulated["algorithm"] == "flgan"
    assert local["generator_sha256"] == simulated["generator_sha256"]
    assert local["swaps"] == 3  # averaging rounds after iterations 4, 8 and 10
    model = (716_560 + 1000 + THETA) * 4  # G (with its class embedding) and D, fp32
    expected = {"server_to_worker": 3 * 3 * model, "worker_to_server": 3 * 3 * model, "worker_to_worker": 0}
    assert local["payload_bytes"] == simulated["payload_bytes"] == expected
    report = json.loads(mdgan("traffic", str(tmp_path / "local"), "--json").stdout)
    assert all(row["payload_bytes"] == expected[row["direction"]] for row in report["rows"])
