import asyncio
import dataclasses
import json
import subprocess
import sys

import pytest
import torch

from conftest import REPO
from mdgan.algorithms.pwgan import (COUNT_DTYPE, CriticSide, InProcessCritic, PotentialOrder, PWGANOptions,
                                    PWGANTrainer, RoundReply, assign_cells, build_in_process_critics,
                                    potential_step, traffic_per_iteration, transport_cost, voronoi_counts)
from mdgan.config import DataConfig, ModelSpec, TrainingConfig
from mdgan.data import load_all_shards
from mdgan.gan import GeneratorSide
from mdgan.simulation import Emulation, simulate


def brute_force_cells(real_values: list[float], generated_values: list[float], phi: list[float]) -> list[int]:
    """For each real sample, argmin_j |r_i - g_j| - phi_j by enumeration (first minimum wins)."""
    cells = []
    for r in real_values:
        best, best_j = None, None
        for j, (g, p) in enumerate(zip(generated_values, phi)):
            value = abs(r - g) - p
            if best is None or value < best:
                best, best_j = value, j
        cells.append(best_j)
    return cells


def test_potential_and_mass_step_match_a_brute_force_semi_discrete_assignment():
    rng = torch.Generator().manual_seed(7)
    n_g, eta, rounds = 4, 0.3, 6
    n_r = [7, 7, 5]  # three workers; one with a smaller real batch
    reals = [torch.randn(n, generator=rng).tolist() for n in n_r]  # D_k(x_i)
    fakes = [torch.randn(n_g, generator=rng).tolist() for _ in n_r]  # D_k(x^g_j): each worker its own critic
    phi = [0.0] * n_g
    phi_t = torch.zeros(n_g, dtype=torch.float64)
    seen_counts = set()
    for _ in range(rounds):
        counts_bf, worker_phis = [], []
        for r, g in zip(reals, fakes):
            cells = brute_force_cells(r, g, phi)
            counts = [cells.count(j) for j in range(n_g)]
            counts_bf.append(counts)
            worker_phis.append([phi[j] + eta * (1 / n_g - counts[j] / len(r)) for j in range(n_g)])
        masses_bf = [sum(c[j] / n for c, n in zip(counts_bf, n_r)) / len(n_r) for j in range(n_g)]
        phi = [sum(p[j] for p in worker_phis) / len(n_r) for j in range(n_g)]

        counts = [voronoi_counts(transport_cost(torch.tensor(r, dtype=torch.float64),
                                                torch.tensor(g, dtype=torch.float64)), phi_t) for r, g in zip(reals, fakes)]
        assert [c.tolist() for c in counts] == counts_bf
        assert all(c.dtype == COUNT_DTYPE for c in counts)
        phi_t, masses = potential_step(phi_t, counts, eta)
        torch.testing.assert_close(phi_t, torch.tensor(phi, dtype=torch.float64), rtol=0, atol=1e-12)
        torch.testing.assert_close(masses, torch.tensor(masses_bf, dtype=torch.float64), rtol=0, atol=1e-12)
        assert masses.sum().item() == pytest.approx(1.0)
        assert phi_t.sum().item() == pytest.approx(0.0, abs=1e-12)  # eq. 9's step keeps the potentials centred
        seen_counts.update(tuple(c) for c in counts_bf)
    assert len(seen_counts) > 3  # the potentials moved the cells: not a trivial case


def test_algorithm_boxs_potential_update_gives_the_same_cells():
    """Algorithm 2 writes phi^k_j = phi_j - eta' N^k_j: with eta' = eta / n_r, the same cells as eq. 9's step."""
    rng = torch.Generator().manual_seed(3)
    n_r, n_g, eta = 9, 5, 0.4
    cost = transport_cost(torch.randn(n_r, generator=rng, dtype=torch.float64),
                          torch.randn(n_g, generator=rng, dtype=torch.float64))
    ours = box = torch.zeros(n_g, dtype=torch.float64)
    for _ in range(8):
        n_ours, n_box = voronoi_counts(cost, ours), voronoi_counts(cost, box)
        assert torch.equal(n_ours, n_box)
        ours, _ = potential_step(ours, [n_ours], eta)
        box = box - (eta / n_r) * n_box.double()


def test_the_signed_cost_of_the_algorithm_box_would_put_every_real_sample_in_one_cell():
    """Why |.| (eq. 14): with c_ij = D(x_i) - D(x^g_j) the argmin over j ignores i."""
    rng = torch.Generator().manual_seed(0)
    real, fake, phi = torch.randn(50, generator=rng), torch.randn(6, generator=rng), torch.randn(6, generator=rng)
    signed = real.unsqueeze(1) - fake.unsqueeze(0)
    assert assign_cells(signed, phi).unique().numel() == 1
    assert assign_cells(transport_cost(real, fake), phi).unique().numel() > 1


def _config(**kw) -> TrainingConfig:
    base = dict(workers=3, iterations=3, batch_size=6, seed=2, model=ModelSpec(gan="gan"))
    base.update(kw)
    return TrainingConfig(**base).validate()


def test_feedback_is_zero_on_generated_points_no_real_sample_is_transported_to():
    """The coupling is the plan averaged over the T rounds' cells: a generated point that no real
    sample visited in any round gets no gradient; the visited ones get one."""
    config = _config(workers=1)
    (shard,) = load_all_shards(DataConfig("synthetic", num_shards=1))
    side = CriticSide(config, shard, PWGANOptions(potential_rounds=3, potential_lr=0.05))
    generated = torch.randn(6, 784, generator=torch.Generator().manual_seed(1))
    phi, visited = torch.zeros(6), torch.zeros(6, dtype=torch.bool)
    for r in (1, 2, 3):
        reply = side.handle(PotentialOrder(1, r, phi, generated if r == 1 else None, None, last=r == 3))
        assert reply.counts.sum().item() == 6
        visited |= reply.counts > 0
        phi, _ = potential_step(phi, [reply.counts], 0.05)
    assert (~visited).any()  # a small eta: some generated points were never anyone's cell
    feedback = reply.result.feedback
    assert torch.count_nonzero(feedback[~visited]) == 0
    # a cell's pull is the sum of sign(D(x_i) - D(x^g_j)) over its reals: it may cancel, but not everywhere
    assert (feedback[visited].abs().sum(dim=1) > 0).any()


def test_a_round_out_of_protocol_is_refused():
    config = _config(workers=1)
    (shard,) = load_all_shards(DataConfig("synthetic", num_shards=1))
    side = CriticSide(config, shard, PWGANOptions())
    with pytest.raises(ValueError, match="round 1"):
        side.handle(PotentialOrder(1, 1, torch.zeros(6)))  # no generated batch
    with pytest.raises(ValueError, match="generated batch of shape"):
        side.handle(PotentialOrder(1, 1, torch.zeros(6), torch.randn(5, 784)))
    with pytest.raises(ValueError, match="generated batch of shape"):
        side.handle(PotentialOrder(1, 1, torch.zeros(6), torch.full((6, 784), float("nan"))))
    with pytest.raises(ValueError, match="without its round 1"):
        side.handle(PotentialOrder(1, 2, torch.zeros(6)))
    side.handle(PotentialOrder(1, 1, torch.zeros(6), torch.randn(6, 784)))
    with pytest.raises(ValueError, match="rounds before it"):
        side.handle(PotentialOrder(1, 3, torch.zeros(6)))  # round 2 skipped
    with pytest.raises(ValueError, match="potentials of shape"):
        side.handle(PotentialOrder(1, 2, torch.zeros(5)))
    with pytest.raises(ValueError, match="finite"):
        side.handle(PotentialOrder(1, 2, torch.full((6,), float("inf"))))
    acgan = CriticSide(_config(workers=1, model=ModelSpec(gan="acgan")), shard, PWGANOptions())
    with pytest.raises(ValueError, match="integer labels"):
        acgan.handle(PotentialOrder(1, 1, torch.zeros(6), torch.randn(6, 784), torch.full((6,), 10)))


@pytest.mark.parametrize("gan", ["gan", "acgan"])
def test_simulate_is_deterministic_and_its_traffic_is_the_formula(tmp_path, gan):
    config = _config(model=ModelSpec(gan=gan))
    options = PWGANOptions(potential_rounds=3)
    runs = [simulate(config, DataConfig("synthetic"), str(tmp_path / f"run{i}"), progress=False, algorithm="pwgan",
                     options=options) for i in range(2)]
    assert runs[0]["generator_sha256"] == runs[1]["generator_sha256"]
    assert runs[0]["generator_sha256"] != simulate(
        dataclasses.replace(config, iterations=0), DataConfig("synthetic"), str(tmp_path / "untrained"),
        progress=False, algorithm="pwgan", options=options)["generator_sha256"]
    formula = traffic_per_iteration(config, options, workers=3)
    assert formula["server_to_worker"] == 3 * (4 * 6 * 784 + 4 * 3 * 6)
    for direction in ("server_to_worker", "worker_to_server", "worker_to_worker"):
        assert runs[0]["payload_bytes"][direction] == config.iterations * formula[direction]
    assert runs[0]["label_bytes"] == config.iterations * formula["label_bytes"]
    assert runs[0]["workers_alive"] == 3 and runs[0]["stopped_early"] is None


def test_goes_on_with_the_remaining_workers_when_workers_crash(tmp_path):
    config = _config(iterations=5)
    summary = simulate(config, DataConfig("synthetic"), str(tmp_path), progress=False, algorithm="pwgan",
                       options=PWGANOptions(potential_rounds=2), emulation=Emulation(crash_every=2))
    assert summary["iterations"] == 5 and summary["stopped_early"] is None
    assert summary["workers_alive"] == 1  # one lost after iteration 2, one after iteration 4
    lines = (tmp_path / "history.jsonl").read_text().splitlines()
    answered = [json.loads(line)["answered"] for line in lines]
    assert answered == [3, 3, 2, 2, 1]


class Misbehaving(InProcessCritic):
    """Answers with counts that do not sum to n_r."""

    async def round(self, order):
        reply = await super().round(order)
        return RoundReply(torch.zeros_like(reply.counts), reply.result)


def test_a_bad_reply_is_rejected_and_the_iteration_goes_on_without_it():
    config = _config(iterations=2)
    shards = load_all_shards(DataConfig("synthetic", num_shards=3))
    options = PWGANOptions(potential_rounds=2)
    workers = build_in_process_critics(config, options, shards)
    workers[1] = Misbehaving(workers[1].side)
    records = []
    result = asyncio.run(PWGANTrainer(config, options, GeneratorSide(config), workers,
                                      on_iteration=records.append).run())
    assert result.rejections == 2 and result.workers_alive == 3
    assert [r.answered for r in records] == [2, 2] and [r.rejected for r in records] == [1, 1]


def test_the_cli_runs_both_and_refuses_a_psgan_threshold_above_the_workers(tmp_path, monkeypatch, capsys):
    from mdgan_app.cli import main

    common = ["--dataset", "synthetic", "--workers", "2", "--iterations", "2", "--batch-size", "4",
              "--eval-every", "-1", "--no-progress"]
    monkeypatch.setenv("MDGAN_SIMULATE_POTENTIAL_ROUNDS", "2")  # every flag is also a variable of its command
    assert main(["simulate", "--algorithm", "pwgan", *common, "--out", str(tmp_path / "p")]) == 0
    summary = json.loads((tmp_path / "p" / "summary.json").read_text())
    assert summary["algorithm"] == "pwgan"
    assert summary["payload_bytes"]["worker_to_server"] == 2 * 2 * (4 * 4 * 784 + 4 * 2 * 4)
    # a P-WGAN setting left in the environment is another algorithm's option for the runs below: refused
    assert main(["simulate", "--algorithm", "psgan", *common, "--out", str(tmp_path / "d")]) == 2
    assert "--potential-rounds is an option of --algorithm pwgan" in capsys.readouterr().err
    monkeypatch.delenv("MDGAN_SIMULATE_POTENTIAL_ROUNDS")
    assert main(["simulate", "--algorithm", "psgan", "--ps-threshold", "1", *common, "--out", str(tmp_path / "d")]) == 0
    capsys.readouterr()
    for mode in ("simulate", "local"):  # over gRPC: test_pwgan_services, test_psgan_grpc
        code = main([mode, "--algorithm", "psgan", "--ps-threshold", "3", *common, "--out", str(tmp_path / "x")])
        assert code == 2 and "ps-threshold" in capsys.readouterr().err


class LostInRound2(InProcessCritic):
    """Answers round 1 of iteration 2, then is gone."""

    async def round(self, order):
        if (order.iteration, order.round) >= (2, 2):
            self.crash()
        return await super().round(order)


def test_a_worker_lost_between_rounds_leaves_and_the_iteration_ends_with_the_others():
    config = _config(iterations=3)
    shards = load_all_shards(DataConfig("synthetic", num_shards=3))
    options = PWGANOptions(potential_rounds=3)
    workers = build_in_process_critics(config, options, shards)
    workers[0] = LostInRound2(workers[0].side)
    records = []
    trainer = PWGANTrainer(config, options, GeneratorSide(config), workers, on_iteration=records.append)
    result = asyncio.run(trainer.run())
    assert [(r.active_workers, r.answered, r.lost) for r in records] == [(3, 3, 0), (3, 2, 1), (2, 2, 0)]
    assert result.workers_alive == 2 and result.stopped_early is None
    assert trainer.masses.sum().item() == pytest.approx(1.0)
    # iteration 2: rounds 1 and 2 were sent to 3 workers (the lost one failed on round 2), round 3 to 2
    n_g, d = 6, 784
    expected_down = (3 + 3 + 2) * 4 * n_g * d + 4 * n_g * (3 * 3 + (3 + 3 + 2) + 2 * 3)
    assert result.traffic.payload_bytes["server_to_worker"] == expected_down


def test_experiments_name_runs_by_their_pwgan_and_psgan_settings():
    from mdgan_app.experiment import expand

    runs = expand({"grid": {"algorithm": ["pwgan"], "potential_rounds": [1, 5]},
                   "runs": [{"algorithm": "psgan", "ps_threshold": 2}]})
    assert [r["name"] for r in runs] == ["pwgan-T1", "pwgan-T5", "psgan-T5-Q2"]


def test_the_algorithms_never_import_grpc_or_prometheus():
    code = ("import sys, mdgan.algorithms.pwgan, mdgan.algorithms.psgan, mdgan.algorithms; "
            "bad = [m for m in sys.modules if m.split('.')[0] in ('grpc', 'prometheus_client', 'services')]; "
            "print(bad); sys.exit(1 if bad else 0)")
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
