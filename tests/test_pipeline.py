"""--pipeline-depth D (mdgan/algorithms/mdgan/pipeline.py): G's update at iteration t uses the feedback on
the batches of iteration t - D, exactly; over gRPC as in one process; checkpoints and resume exact; a
crash, a departure and a rejoin handled; depth 0 the paper's iteration."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os

import pytest
import torch

from procs import drop_checkpoints, mdgan
from mdgan.algorithms.mdgan.inprocess import build_in_process_workers
from mdgan.algorithms.mdgan.options import MAX_PIPELINE_DEPTH, MDGANOptions
from mdgan.algorithms.mdgan.trainer import Trainer, TrainerHooks, TrainerPlan
from mdgan.checkpoint import CheckpointStore
from mdgan.config import ConfigError, DataConfig, TrainingConfig
from mdgan.data import load_all_shards
from mdgan.gan import GeneratorSide
from mdgan.run import EvaluationOptions
from mdgan.simulation import Durability, Emulation, simulate

QUIET = EvaluationOptions(every=-1)


def _generator_digest(side: GeneratorSide) -> str:
    state = side.generator.state_dict()
    return hashlib.sha256(b"".join(state[k].numpy().tobytes() for k in sorted(state))).hexdigest()


def _config(**overrides) -> TrainingConfig:
    settings = dict(workers=3, iterations=12, batch_size=8, swap_every=100, seed=3)
    return TrainingConfig(**{**settings, **overrides}).validate()


def _trainer_run(config: TrainingConfig, depth: int):
    workers = build_in_process_workers(config, load_all_shards(DataConfig("synthetic", num_shards=config.workers)))
    generator = GeneratorSide(config)
    records = []
    trainer = Trainer(config, generator, workers, plan=TrainerPlan(pipeline_depth=depth),
                      hooks=TrainerHooks(on_iteration=records.append))
    result = asyncio.run(trainer.run())
    return generator, workers, records, result


def _reference(config: TrainingConfig, depth: int) -> str:
    """The definition, written out: batches of t from the current G to every worker (each answers at once),
    and from t = D + 1 on, G updated with the feedback on the batches of t - D, their noise through the
    current G, summed in rank order."""
    workers = build_in_process_workers(config, load_all_shards(DataConfig("synthetic", num_shards=config.workers)))
    generator = GeneratorSide(config)
    in_flight = []
    for t in range(1, config.iterations + 1):
        with torch.no_grad():
            batches = generator.generate(min(config.kappa, len(workers)))
        answers = []
        for rank, worker in enumerate(workers):
            batch = batches.for_worker(rank)
            answers.append((batch.generated_index, asyncio.run(worker.step(t, batch)).feedback))
        in_flight.append((batches, answers))
        if t > depth:
            old, feedback = in_flight.pop(0)
            generator.update(generator.regenerate(old), feedback)
    return _generator_digest(generator)


@pytest.mark.parametrize("depth", [1, 3])
def test_the_update_at_t_uses_the_feedback_on_the_batches_of_t_minus_d(depth):
    config = _config()
    generator, _, records, _ = _trainer_run(config, depth)
    assert _generator_digest(generator) == _reference(config, depth)
    assert _generator_digest(generator) != _reference(config, depth + 1)  # (the depth is the one asked)
    # the pipeline fills for D iterations (no feedback used), then every worker's answer moves G
    assert [r.answered for r in records] == [0] * depth + [config.workers] * (config.iterations - depth)
    assert all(r.active_workers == config.workers for r in records)


def test_a_depth_keeps_the_bytes_and_the_swaps_and_changes_the_run(tmp_path):
    config = _config(iterations=16, swap_every=5, kappa=2)
    runs = {depth: simulate(config, DataConfig("synthetic"), str(tmp_path / f"d{depth}"), progress=False,
                            evaluation=QUIET, options=MDGANOptions(pipeline_depth=depth)) for depth in (0, 2)}
    # every batch is answered and counted, those of the last D iterations too (they train the discriminators)
    assert runs[0]["payload_bytes"] == runs[2]["payload_bytes"] and runs[0]["swaps"] == runs[2]["swaps"] == 3
    assert runs[0]["generator_sha256"] != runs[2]["generator_sha256"]
    assert runs[2]["mdgan"]["pipeline_depth"] == 2 and runs[0]["mdgan"]["pipeline_depth"] == 0


def test_a_checkpoint_holds_the_answers_in_flight_and_a_resumed_run_goes_on_bit_for_bit(tmp_path):
    config = _config(iterations=30, swap_every=6)
    data, options = DataConfig("synthetic"), MDGANOptions(pipeline_depth=3, swap_lag=2)
    out = str(tmp_path / "run")
    full = simulate(config, data, out, progress=False, evaluation=QUIET, options=options,
                    durability=Durability(checkpoint_every=8, keep_checkpoints=10))
    store = CheckpointStore(os.path.join(out, "checkpoints"))
    assert 16 in store.complete()
    state = store.load(16, "server")
    flights = state["trainer"]["pipeline"]
    assert [f["iteration"] for f in flights] == [14, 15, 16]  # used at 17, 18 and 19
    assert all(len(f["answers"]) == 3 and all("result" in a for a in f["answers"]) for f in flights)
    drop_checkpoints(store, [i for i in store.complete() if i > 16])  # as if the process died after 16
    os.remove(os.path.join(out, "summary.json"))
    resumed = simulate(config, data, out, progress=False, evaluation=QUIET, options=options,
                       durability=Durability(checkpoint_every=8, resume="yes"))
    assert resumed["resumed_from"] == 16 and resumed["generator_sha256"] == full["generator_sha256"]


def test_a_checkpoint_without_a_pipeline_is_refused_by_a_pipelined_resume(tmp_path):
    config = _config(iterations=20, swap_every=6)
    out = str(tmp_path / "run")
    simulate(config, DataConfig("synthetic"), out, progress=False, evaluation=QUIET,
             durability=Durability(checkpoint_every=8))
    os.remove(os.path.join(out, "summary.json"))
    with pytest.raises((ConfigError, ValueError), match="without --pipeline-depth"):
        simulate(config, DataConfig("synthetic"), out, progress=False, evaluation=QUIET,
                 options=MDGANOptions(pipeline_depth=2), durability=Durability(checkpoint_every=8, resume="yes"))


def test_a_stop_waits_for_the_answers_out_and_checkpoints_them(tmp_path):
    config = _config(iterations=30)
    workers = build_in_process_workers(config, load_all_shards(DataConfig("synthetic", num_shards=3)),
                                       str(tmp_path / "state"))
    saved = []
    trainer = Trainer(config, GeneratorSide(config), workers,
                      plan=TrainerPlan(checkpoint_every=100, pipeline_depth=2),
                      hooks=TrainerHooks(save_checkpoint=lambda t, ok: saved.append(
                          (t, ok, trainer.state_dict()["pipeline"]))))

    def on_iteration(record):
        if record.iteration == 9:
            trainer.stop_requested = True  # SIGTERM

    trainer.on_iteration = on_iteration
    result = asyncio.run(trainer.run())
    assert result.iterations == 9 and [(t, ok) for t, ok, _ in saved] == [(9, True)]
    assert [f["iteration"] for f in saved[0][2]] == [8, 9]


def test_a_worker_crashing_or_leaving_with_batches_in_flight_is_dropped_and_the_run_goes_on(tmp_path):
    config = _config(workers=4, iterations=20, swap_every=6)
    workers = build_in_process_workers(config, load_all_shards(DataConfig("synthetic", num_shards=4)))
    records = []
    trainer = Trainer(config, GeneratorSide(config), workers, plan=TrainerPlan(pipeline_depth=2))
    trainer.on_iteration = lambda r: (records.append(r), workers[3].crash() if r.iteration == 7 else None)
    result = asyncio.run(trainer.run())
    assert result.iterations == 20 and result.workers_alive == 3 and result.stopped_early is None
    by_t = {r.iteration: r for r in records}
    # its answers on the batches of 6 and 7 were in before it crashed: they count at 8 and 9; the batches of 8
    # found it gone (lost at once), and from 10 on three workers answer
    assert [by_t[t].answered for t in (8, 9, 10, 11)] == [4, 4, 3, 3] and by_t[8].lost == 1
    # churn in one process: a worker leaves and comes back (a copy of a peer's D) with batches in flight
    churned = simulate(config, DataConfig("synthetic"), str(tmp_path / "churn"), progress=False, evaluation=QUIET,
                       options=MDGANOptions(pipeline_depth=2),
                       emulation=Emulation(churn=[(5, "leave", 1), (11, "join", 1)]))
    assert churned["iterations"] == 20 and churned["workers_alive"] == 4


@pytest.mark.parametrize("depth, sync, message", [
    (-1, "all", "from 0 to 64"), (MAX_PIPELINE_DEPTH + 1, "all", "from 0 to 64"), (True, "all", "whole number"),
    (2, "async", "needs sync all"), (2, "quorum", "needs sync all"), (12, "all", "below iterations 12")])
def test_a_bad_depth_is_one_line_and_nothing_is_written(tmp_path, depth, sync, message):
    config = _config(sync=sync, quorum=2) if sync == "quorum" else _config(sync=sync)
    with pytest.raises(ConfigError, match=message):
        simulate(config, DataConfig("synthetic"), str(tmp_path / "bad"), progress=False, evaluation=QUIET,
                 options=MDGANOptions(pipeline_depth=depth))
    assert not os.path.exists(tmp_path / "bad")


@pytest.mark.parametrize("command", ["simulate", "local"])
@pytest.mark.parametrize("flags, message", [
    (["--algorithm", "flgan", "--pipeline-depth", "2"], "--pipeline-depth is an option of --algorithm mdgan, not of "
                                                        "--algorithm flgan"),
    (["--algorithm", "psgan", "--swap-lag", "3"], "--swap-lag is an option of --algorithm mdgan"),
    (["--potential-rounds", "3"], "--potential-rounds is an option of --algorithm pwgan, not of --algorithm mdgan"),
    (["--pipeline-depth", "2", "--sync", "async"], "needs --sync all"),
    (["--pipeline-depth", "65"], "from 0 to 64")])
def test_a_bad_or_foreign_option_is_one_line_before_anything_starts(tmp_path, capsys, command, flags, message):
    """Another algorithm's option is refused, not ignored; a depth the run cannot have, too."""
    from mdgan_app.cli import main

    out = tmp_path / "run"
    code = main([command, "--dataset", "synthetic", "--workers", "2", "--iterations", "5", "--no-progress",
                 "--out", str(out), *flags])
    stderr = capsys.readouterr().err
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and message in lines[0], stderr
    assert not out.exists()


@pytest.mark.slow
@pytest.mark.parametrize("wire", ["float32", "int8"])  # the wide-area table's pipelines (bench/wide_area_table.py)
def test_mdgan_local_with_a_pipeline_ends_with_simulates_generator(tmp_path, wire):
    """Over gRPC with mutual TLS, each worker its own process, batches D iterations ahead of the feedback,
    swaps in the background, a checkpoint: the generator of `mdgan simulate`, bit for bit."""
    flags = ["--dataset", "synthetic", "--workers", "3", "--iterations", "26", "--batch-size", "8",
             "--swap-every", "6", "--swap-lag", "2", "--pipeline-depth", "3", "--checkpoint-every", "10",
             "--eval-every", "-1", "--seed", "4", "--wire-dtype", wire]
    mdgan("local", *flags, "--out", str(tmp_path / "local"))
    mdgan("simulate", *flags, "--out", str(tmp_path / "simulate"))
    summaries = [json.loads((tmp_path / run / "summary.json").read_text()) for run in ("local", "simulate")]
    assert summaries[0]["generator_sha256"] == summaries[1]["generator_sha256"]
    assert summaries[0]["payload_bytes"] == summaries[1]["payload_bytes"]
    assert summaries[0]["mdgan"]["pipeline_depth"] == 3
