"""`mdgan simulate`: a whole run of any algorithm in this process, every worker an object, ending where
the same run over the gRPC services ends, bit for bit. The algorithm comes from the one registry
(mdgan/algorithms/__init__.py); this module loads the data, opens the run directory, and writes the
outputs every algorithm shares (mdgan/run.py)."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import replace

from mdgan import algorithms, checkpoint, devices
from mdgan.algorithms.base import Emulation, InProcessRun
from mdgan.checkpoint import CheckpointError
from mdgan.config import DataConfig, TrainingConfig
from mdgan.data import load_all_shards
from mdgan.gan import GeneratorSide
from mdgan.run import (EvaluationOptions, RunRecorder, RunStart, check_out_dir, make_evaluator, plan_run, start_run,
                       write_outputs)
from mdgan.run_spec import Durability, Outputs, RunSpec, SiteFolders
from mdgan.sites import RunClasses, site_shards

DISCRIMINATORS_FILE = "discriminators.pt"  # --save-discriminators: worker id -> its final D (mdgan audit)


def simulate(config: TrainingConfig, data: DataConfig, out_dir: str, progress: bool = True,
             evaluation: EvaluationOptions = EvaluationOptions(), algorithm: str = "mdgan", options=None, *,
             durability: Durability = Durability(), emulation: Emulation = Emulation(),
             sites: SiteFolders = SiteFolders(), outputs: Outputs = Outputs(), stop_after: int | None = None,
             before_writing=None) -> dict:
    """`train` of the RunSpec these parts make (mdgan/run_spec.py says what each is)."""
    return train(RunSpec(config, data, algorithm, options, evaluation, durability, emulation, sites, outputs,
                       stop_after), out_dir, progress, before_writing)


def train(spec: RunSpec, out_dir: str, progress: bool = True, before_writing=None) -> dict:
    """The whole run in this process: MD-GAN with every worker an object (the same loop as over
    gRPC), or one of the baselines on the same models, seeds and data.

    Worker i's data: shard i of the spec's dataset (emulation), or its site folder (spec.sites).
    before_writing: called once every setting is accepted, before anything is written to out_dir.
    Every refusal comes before it: a refused run leaves out_dir as it was.
    """
    spec = spec.validate()
    entry = algorithms.get(spec.algorithm)
    d, sites, outputs = spec.durability, spec.sites, spec.outputs
    devices.deterministic(spec.config.device)
    if entry.resumable:
        run = plan_run(out_dir, spec.config, d.resume, d.run_id, d.overwrite)
    else:
        check_out_dir(out_dir, d.resume, d.overwrite)
        run = RunStart(d.run_id or "", spec.config)
    config = run.config  # (a resumed run's own)
    if run.state is not None and run.state.get("algorithm", "mdgan") != spec.algorithm:  # (MD-GAN's names none)
        raise CheckpointError(f"{out_dir}: its checkpoint at iteration {run.resumed_from} is a "
                              f"{run.state.get('algorithm', 'mdgan')} run's, not {spec.algorithm}'s: resume it as that")
    options = None if spec.options is None else spec.options.check(config)
    if sites.site_dirs:
        run_classes = RunClasses(sites.classes, config.model.num_classes, config.model.conditional)
        shards = site_shards(sites.site_dirs, spec.data.dataset, config.workers, config.model.sample_shape,
                             run_classes, sites.bad_images)
    else:
        shards = load_all_shards(spec.data, config.model.sample_shape)
    if config.privacy.enabled:  # (before anything is written or spent)
        from mdgan import privacy

        privacy.check_run(config, [len(s) for s in shards])
    if before_writing is not None:
        before_writing()
    start_run(out_dir, run)
    generator_side = GeneratorSide(config)
    e = spec.evaluation
    evaluator = make_evaluator(generator_side, e.data_root, e.every, e.samples, e.reference, e.large_every,
                               e.large_samples)
    from mdgan.tracking import Tracking

    tracking = Tracking.open(run.run_id or spec.algorithm, outputs.tensorboard, outputs.mlflow)
    recorder = RunRecorder(out_dir, spec.stop_after or config.iterations, progress, spec.algorithm, evaluator,
                           resume_at=run.resumed_from, tracking=tracking)
    result = None
    discriminators = {} if outputs.save_discriminators else None
    try:
        result = entry.run_in_process(InProcessRun(
            config, shards, generator_side, recorder, out_dir, run, options, spec.emulation, d.checkpoint_every,
            d.keep_checkpoints, discriminators, spec.stop_after))
    finally:
        wall = recorder.close(result.iterations if result else None)
    if discriminators:
        checkpoint.atomic_save({"discriminators": discriminators, "config": config.to_dict()},
                               os.path.join(out_dir, DISCRIMINATORS_FILE))
    extra = _record(spec, config, run, shards)
    if options is not None:  # the options its traffic formula (`mdgan traffic`) and its record need
        extra[spec.algorithm] = options.summary(config)
    return write_outputs(out_dir, config, generator_side, result, wall, "simulate", extra, scores=recorder.scores,
                         tracking=tracking)


def _record(spec: RunSpec, config: TrainingConfig, run: RunStart, shards) -> dict:
    """What summary.json records of the run beyond its config: algorithm, emulation, ids, where its data was."""
    data, site_dirs, emulation = spec.data, spec.sites.site_dirs, spec.emulation
    extra = {"algorithm": spec.algorithm, "crash_every": emulation.crash_every, "run_id": run.run_id or None,
             "resumed_from": run.resumed_from, "byzantine": emulation.byzantine, "attack": emulation.attack,
             "worker_sizes": {f"worker-{s.index}": len(s) for s in shards},
             # what `mdgan audit` needs to recover each worker's members, from wherever it is run
             "data": None if site_dirs else dataclasses.asdict(replace(
                 data, num_shards=config.workers,
                 data_root=None if data.data_root is None else os.path.abspath(data.data_root))),
             "site_dirs": os.path.abspath(site_dirs) if site_dirs else None}
    if spec.stop_after is not None:
        extra["stop_after"] = spec.stop_after
    return extra
