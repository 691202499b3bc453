"""Background swaps (--swap-lag L, mdgan/algorithms/mdgan/trainer.py): a round's discriminators are
snapshotted at boundary t and installed at exactly t + L, in one process; checkpoints never hold a round
in flight, so a resumed run goes on bit for bit; lag 0 is the paper's barrier."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os

import pytest

from mdgan.algorithms.mdgan.inprocess import build_in_process_workers
from mdgan.algorithms.mdgan.options import MDGANOptions
from mdgan.algorithms.mdgan.trainer import Trainer, TrainerHooks, TrainerPlan
from mdgan.checkpoint import CheckpointStore
from mdgan.config import ConfigError, DataConfig, TrainingConfig
from mdgan.data import load_all_shards
from mdgan.gan import GeneratorSide
from mdgan.run import EvaluationOptions
from mdgan.simulation import Durability, simulate
from procs import drop_checkpoints

QUIET = EvaluationOptions(every=-1)


def _digest(worker) -> str:
    state = worker.side.discriminator.state_dict()
    return hashlib.sha256(b"".join(state[k].numpy().tobytes() for k in sorted(state))).hexdigest()


def _trace(lag: int, iterations: int = 14, swap_every: int = 6):
    """Each worker's D after every iteration, and the swap records, of a run with this lag."""
    config = TrainingConfig(workers=3, iterations=iterations, batch_size=8, swap_every=swap_every, seed=2).validate()
    workers = build_in_process_workers(config, load_all_shards(DataConfig("synthetic", num_shards=3)))
    after: dict[int, dict[str, str]] = {}
    swaps: list[dict] = []
    trainer = Trainer(config, GeneratorSide(config), workers,
                      plan=TrainerPlan(swap_lag=lag),
                      hooks=TrainerHooks(on_swap=swaps.append, on_iteration=lambda r: after.__setitem__(
                          r.iteration, {w.worker_id: _digest(w) for w in workers})))
    result = asyncio.run(trainer.run())
    return after, swaps, result


def test_a_round_is_installed_exactly_lag_iterations_after_its_snapshot():
    lag = 3
    after, swaps, result = _trace(lag)
    assert [(s["round"], s["iteration"], s["installed"]) for s in swaps] == [(1, 6, 9), (2, 12, 14)]
    first = swaps[0]
    for sender, receiver in first["plan"].items():
        # what the receiver holds after boundary 9 is what the sender held at boundary 6 (then trained on)
        assert after[9][receiver] == after[6][sender] != after[8][receiver]
        assert first["workers"][receiver]["received"]
    # the last round starts at 12 and its boundary (15) is past the run's end: installed when the run ends
    assert result.swaps == 2 and all(w["received"] for w in swaps[1]["workers"].values())
    # lag 0 installs at the boundary itself (the paper's swap), where a lag still trains on its own D
    barrier, barrier_swaps, _ = _trace(0)
    assert "installed" not in barrier_swaps[0]
    for sender, receiver in barrier_swaps[0]["plan"].items():
        assert barrier[6][receiver] == after[6][sender]
    assert barrier[7] != after[7]


def test_a_lag_keeps_the_bytes_and_changes_the_run(tmp_path):
    config = TrainingConfig(workers=3, kappa=2, iterations=24, batch_size=8, swap_every=5, seed=1).validate()
    runs = {lag: simulate(config, DataConfig("synthetic"), str(tmp_path / f"lag{lag}"), progress=False,
                          evaluation=QUIET, options=MDGANOptions(swap_lag=lag)) for lag in (0, 2)}
    assert runs[0]["payload_bytes"] == runs[2]["payload_bytes"]  # Table III: the same rounds, the same bytes
    assert runs[0]["swaps"] == runs[2]["swaps"] == 4
    assert runs[0]["generator_sha256"] != runs[2]["generator_sha256"]
    assert runs[2]["mdgan"]["swap_lag"] == 2


def test_checkpoints_wait_for_the_round_in_flight_and_a_resumed_run_goes_on_bit_for_bit(tmp_path):
    # rounds at 6, 12, 18, 24 (and 30, the end) installed 4 later; checkpoints due at 8 (inside 6..10), 16 (the
    # install boundary of 12..16: after it) and 24 (a round starts there: 24..28)
    config = TrainingConfig(workers=3, iterations=30, batch_size=8, swap_every=6, seed=5).validate()
    data, options = DataConfig("synthetic"), MDGANOptions(swap_lag=4)
    out = str(tmp_path / "run")
    full = simulate(config, data, out, progress=False, evaluation=QUIET, options=options,
                    durability=Durability(checkpoint_every=8, keep_checkpoints=10))
    store = CheckpointStore(os.path.join(out, "checkpoints"))
    assert store.complete() == [10, 16, 28, 30]
    drop_checkpoints(store, (28, 30))  # as if the process died before checkpoint 28 completed
    os.remove(os.path.join(out, "summary.json"))
    resumed = simulate(config, data, out, progress=False, evaluation=QUIET, options=options,
                       durability=Durability(checkpoint_every=8, resume="yes"))
    assert resumed["resumed_from"] == 16 and resumed["generator_sha256"] == full["generator_sha256"]
    with open(os.path.join(out, "swaps.jsonl")) as fh:
        assert [(r["round"], r["installed"]) for r in map(json.loads, fh)] == [(1, 10), (2, 16), (3, 22), (4, 28), (5, 30)]


def test_a_stop_inside_a_round_installs_it_first_and_checkpoints(tmp_path):
    config = TrainingConfig(workers=3, iterations=30, batch_size=8, swap_every=6, seed=5).validate()
    workers = build_in_process_workers(config, load_all_shards(DataConfig("synthetic", num_shards=3)),
                                       str(tmp_path / "state"))
    saved, swaps = [], []
    trainer = Trainer(config, GeneratorSide(config), workers,
                      plan=TrainerPlan(checkpoint_every=100, swap_lag=4),
                      hooks=TrainerHooks(save_checkpoint=lambda t, ok: saved.append((t, ok)), on_swap=swaps.append))

    def on_iteration(record):
        if record.iteration == 8:
            trainer.stop_requested = True  # SIGTERM inside round 1 (6 -> 10)

    trainer.on_iteration = on_iteration
    result = asyncio.run(trainer.run())
    assert result.iterations == 8 and saved == [(8, True)] and trainer.pending is None
    assert [(s["round"], s["iteration"], s["installed"]) for s in swaps] == [(1, 6, 8)]
    assert all(w["received"] for w in swaps[0]["workers"].values())


def test_a_worker_crashing_inside_a_round_is_dropped_and_the_others_install(tmp_path):
    config = TrainingConfig(workers=4, iterations=14, batch_size=8, swap_every=6, seed=2).validate()
    workers = build_in_process_workers(config, load_all_shards(DataConfig("synthetic", num_shards=4)))
    swaps = []
    trainer = Trainer(config, GeneratorSide(config), workers,
                      plan=TrainerPlan(swap_lag=3),
                      hooks=TrainerHooks(on_swap=swaps.append))
    trainer.on_iteration = lambda r: workers[3].crash() if r.iteration == 7 else None
    result = asyncio.run(trainer.run())
    first = swaps[0]
    assert first["installed"] == 9 and result.workers_alive == 3
    # worker-3's D left at 6, before it crashed: its receiver installs it; worker-3 itself installs nothing
    assert first["workers"][first["plan"]["worker-3"]]["received"]
    assert not first["workers"]["worker-3"]["received"]


@pytest.mark.parametrize("lag, swap_every, message", [
    (-1, 6, "whole number of iterations >= 0"), (6, 6, "below the swap period S = 6"), (9, 6, "below the swap period")])
def test_a_bad_lag_is_one_line(tmp_path, lag, swap_every, message):
    config = TrainingConfig(workers=3, iterations=10, batch_size=8, swap_every=swap_every).validate()
    with pytest.raises(ConfigError, match=message):
        simulate(config, DataConfig("synthetic"), str(tmp_path / "bad"), progress=False, evaluation=QUIET,
                 options=MDGANOptions(swap_lag=lag))
    assert not os.path.exists(tmp_path / "bad" / "history.jsonl")


def test_a_lag_past_the_period_found_from_the_shards_is_refused_before_training(tmp_path):
    # no --swap-every: S = ceil(E m / b) is known only from the shards (here 0.01 * 2000 / 8 -> 3)
    config = TrainingConfig(workers=3, iterations=10, batch_size=8, swap_epochs=0.01).validate()
    workers = build_in_process_workers(config, load_all_shards(DataConfig("synthetic", num_shards=3)))
    with pytest.raises(ConfigError, match="below the swap period S = "):
        Trainer(config, GeneratorSide(config), workers, plan=TrainerPlan(swap_lag=50))


def test_no_swap_round_without_two_members_holding_a_discriminator(tmp_path):
    """A member still waiting for its copy (its donor's push failed: it waits for the next boundary) has no
    discriminator to send: with one other member, the swap boundary has no round (the server failed on a KeyError)."""
    config = TrainingConfig(workers=2, iterations=2, batch_size=8, swap_every=100, seed=1).validate()
    workers = build_in_process_workers(config, load_all_shards(DataConfig("synthetic", num_shards=2)))
    trainer = Trainer(config, GeneratorSide(config), workers, plan=TrainerPlan(), hooks=TrainerHooks())
    asyncio.run(trainer.run())
    waiting = [w for w in trainer.roster.members() if w.worker_id == "worker-1"][0]
    waiting.needs_copy = True
    trainer.swap_period = 2
    assert [w.worker_id for w in trainer.swap_rounds.participants()] == ["worker-0"]
    assert asyncio.run(trainer._swaps_after(2)).started is None and trainer.swap_rounds.swaps == 0
