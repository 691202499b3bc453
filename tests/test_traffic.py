"""`mdgan traffic`: the formula of each algorithm, alone and against a run's counters.

The run directories here are those `simulate` writes (summary.json, history.jsonl), plus the
metrics/*.prom expositions a `mdgan local` run leaves, written by the services' own Telemetry with
the bytes the library counted: what the pwgan/psgan transports must count on the wire. The
real-gRPC checks (counters of real processes against these formulas) come with those transports.
"""

import json
import os

import pytest

from mdgan.algorithms import psgan, pwgan
from mdgan_app.cli import main
from mdgan.config import DataConfig, ModelSpec, TrainingConfig
from mdgan.models import build_discriminator, build_generator
from mdgan.simulation import Emulation, simulate
from services.common.telemetry import Telemetry
from mdgan_app.traffic import traffic_report

ENDS = {"server_to_worker": ("server", "workers"), "worker_to_server": ("workers", "server")}


class _Message:
    """What Telemetry.count needs of a protobuf message."""

    def __init__(self, size: int):
        self.size = size

    def ByteSize(self) -> int:
        return self.size


def write_expositions(run_dir: str, workers: int, payload: dict[str, int]) -> None:
    """metrics/server.prom and metrics/worker-K.prom, each end of each direction counting `payload`
    (the workers' share split between them, as each counts its own messages)."""
    server, peers = Telemetry("server"), [Telemetry("worker") for _ in range(workers)]
    for direction, (sender, receiver) in ENDS.items():
        total = payload[direction]
        for side, group in (("sender", sender), ("receiver", receiver)):
            if group == "server":
                server.count(direction, "batches", side, _Message(total + 64), total)
            else:
                shares = [total // workers] * workers
                shares[0] += total - sum(shares)
                for peer, share in zip(peers, shares):
                    peer.count(direction, "batches", side, _Message(share + 16), share)
    server.dump(os.path.join(run_dir, "metrics", "server.prom"))
    for k, peer in enumerate(peers):
        peer.dump(os.path.join(run_dir, "metrics", f"worker-{k}.prom"))


def _config(**overrides) -> TrainingConfig:
    base = dict(workers=3, iterations=4, batch_size=6, model=ModelSpec(gan="gan"))
    return TrainingConfig(**{**base, **overrides}).validate()


def _run(tmp_path, algorithm: str, crash_every: int | None = None, **options) -> tuple[str, dict]:
    out = str(tmp_path / algorithm)
    summary = simulate(_config(), DataConfig("synthetic"), out, progress=False, algorithm=algorithm, **options,
                       emulation=Emulation(crash_every=crash_every))
    return out, summary


def _traffic(capsys, *argv: str) -> tuple[int, str]:
    code = main(["traffic", *argv])
    return code, capsys.readouterr().out


@pytest.mark.parametrize("algorithm", ["pwgan", "psgan"])
def test_a_run_is_held_to_its_own_algorithms_formula(tmp_path, capsys, algorithm):
    config = _config()
    options = {"options": pwgan.PWGANOptions(potential_rounds=2)} if algorithm == "pwgan" else {}
    run_dir, summary = _run(tmp_path, algorithm, **options)
    per_iteration = (pwgan.traffic_per_iteration(config, options["options"], 3) if algorithm == "pwgan"
                     else psgan.traffic_per_iteration(config, 3))
    write_expositions(run_dir, 3, summary["payload_bytes"])

    report = traffic_report(run_dir)
    assert report["algorithm"] == algorithm
    assert len(report["rows"]) == 6
    for row in report["rows"]:
        expected = config.iterations * per_iteration[row["direction"]]
        assert row["formula_bytes"] == row["formula_min_bytes"] == expected == row["payload_bytes"], row
        assert row["payload_matches_formula"], row
    code, table = _traffic(capsys, run_dir)
    assert code == 0 and f"({algorithm})" in table and "NO" not in table

    # a byte more than the formula, at one end of one direction, is a mismatch: exit status 1
    off = dict(summary["payload_bytes"], worker_to_server=summary["payload_bytes"]["worker_to_server"] + 1)
    write_expositions(run_dir, 3, off)
    code, table = _traffic(capsys, run_dir)
    assert code == 1 and "NO" in table


def test_pwgan_formula_reads_the_runs_own_potential_rounds(tmp_path):
    run_dir, summary = _run(tmp_path, "pwgan", options=pwgan.PWGANOptions(potential_rounds=4))
    write_expositions(run_dir, 3, summary["payload_bytes"])
    with open(os.path.join(run_dir, "summary.json")) as fh:
        assert json.load(fh)["pwgan"]["potential_rounds"] == 4
    assert all(r["payload_matches_formula"] for r in traffic_report(run_dir)["rows"])

    # a summary without T cannot be held to the formula: said so, not guessed
    with open(os.path.join(run_dir, "summary.json")) as fh:
        bare = json.load(fh)
    del bare["pwgan"]
    with open(os.path.join(run_dir, "summary.json"), "w") as fh:
        json.dump(bare, fh)
    with pytest.raises(ValueError, match="potential_rounds"):
        traffic_report(run_dir)


@pytest.mark.parametrize("algorithm", ["pwgan", "psgan"])
def test_iterations_with_a_lost_worker_are_bounded_by_the_workers_that_answered_and_those_asked(
        tmp_path, algorithm):
    options = {"options": pwgan.PWGANOptions(potential_rounds=3) if algorithm == "pwgan"
               else psgan.PSGANOptions(threshold=1)}
    run_dir, summary = _run(tmp_path, algorithm, crash_every=2, **options)
    with open(os.path.join(run_dir, "history.jsonl")) as fh:
        history = [json.loads(line) for line in fh]
    assert [r["lost"] for r in history] == [0, 0, 1, 0]  # the crash after iteration 2 shows in iteration 3
    write_expositions(run_dir, 3, summary["payload_bytes"])
    rows = {r["direction"]: r for r in traffic_report(run_dir)["rows"] if r["side"] == "sender"}
    for direction in ("server_to_worker", "worker_to_server"):
        row = rows[direction]
        assert row["formula_min_bytes"] < row["formula_bytes"], row  # iteration 3 is a range
        assert row["formula_min_bytes"] <= row["payload_bytes"] <= row["formula_bytes"], row
        assert row["payload_matches_formula"]

    # more than every asked worker could have moved is a mismatch even so
    too_much = dict(summary["payload_bytes"], server_to_worker=rows["server_to_worker"]["formula_bytes"] + 1)
    write_expositions(run_dir, 3, too_much)
    assert not all(r["payload_matches_formula"] for r in traffic_report(run_dir)["rows"])


def test_an_algorithm_without_a_formula_is_refused_clearly(tmp_path):
    run_dir, summary = _run(tmp_path, "standalone")
    write_expositions(run_dir, 1, summary["payload_bytes"])
    with pytest.raises(ValueError, match="no traffic formula for algorithm 'standalone'"):
        traffic_report(run_dir)


def test_formula_only_mode_prints_each_algorithms_bytes_per_iteration(capsys):
    code, out = _traffic(capsys, "--json", "--workers", "10", "--batch-size", "10")
    assert code == 0
    report = json.loads(out)
    rows = {r["algorithm"]: r for r in report["rows"]}
    assert list(rows) == ["mdgan", "flgan", "pwgan", "psgan"]
    spec = ModelSpec(sample_shape=(784,))  # MNIST MLP ACGAN
    theta_d = 4 * sum(p.numel() for p in build_discriminator(spec, 0).parameters())
    theta_g = 4 * sum(p.numel() for p in build_generator(spec, 0).parameters())
    assert theta_d == 4 * 670_219 and theta_g == 4 * 717_560  # docs/ALGORITHMS.md
    period = 600  # ceil(E m / b), m = 60,000 / 10
    assert report["shard_size"] == 6000 and report["period"] == period
    assert rows["mdgan"]["per_worker"] == {"server_to_worker": 2 * 10 * 784 * 4, "worker_to_server": 10 * 784 * 4,
                                           "worker_to_worker": pytest.approx(theta_d / period)}
    assert rows["flgan"]["per_worker"] == {"server_to_worker": pytest.approx((theta_d + theta_g) / period),
                                           "worker_to_server": pytest.approx((theta_d + theta_g) / period),
                                           "worker_to_worker": 0}
    assert rows["pwgan"]["per_worker"] == {"server_to_worker": 31_560, "worker_to_server": 31_560,
                                           "worker_to_worker": 0}
    assert rows["psgan"]["per_worker"] == {"server_to_worker": theta_g + theta_d,
                                           "worker_to_server": theta_g + theta_d, "worker_to_worker": 0}
    assert rows["mdgan"]["x_mdgan"] == 1.0
    assert rows["psgan"]["all_workers"] == 10 * 2 * (theta_g + theta_d)

    # one algorithm, its own settings; and the table as text
    code, out = _traffic(capsys, "--algorithm", "pwgan", "--workers", "4", "--potential-rounds", "3")
    assert code == 0
    lines = out.strip().splitlines()
    assert "N=4" in lines[0] and "T=3" in lines[0] and len(lines) == 3
    assert lines[2].split()[:4] == ["pwgan", "31,480", "31,480", "0"]  # 4 b d + 4 T b, b = 10


def test_formula_only_mode_needs_a_shard_size_where_the_dataset_has_none(capsys):
    assert main(["traffic", "--dataset", "synthetic"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("mdgan traffic: error: ") and "--shard-size" in err
    code, out = _traffic(capsys, "--dataset", "synthetic", "--shard-size", "200", "--algorithm", "mdgan")
    assert code == 0 and "m=200" in out and "S=20" in out
