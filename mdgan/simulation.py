"""`mdgan simulate`: a whole run of any algorithm in this process, every worker an object, ending where
the same run over the gRPC services ends, bit for bit. The algorithm comes from the one registry
(mdgan/algorithms/__init__.py); this module loads the data, opens the run directory, and writes the
outputs every algorithm shares (mdgan/run.py)."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, replace

from mdgan import algorithms, checkpoint, devices
from mdgan.algorithms.base import Emulation, InProcessRun
from mdgan.config import ConfigError, DataConfig, TrainingConfig
from mdgan.data import load_all_shards
from mdgan.gan import GeneratorSide
from mdgan.run import (EvaluationOptions, RunRecorder, RunStart, check_out_dir, make_evaluator, plan_run, start_run,
                       write_outputs)
from mdgan.sites import RunClasses, site_shards

DISCRIMINATORS_FILE = "discriminators.pt"  # --save-discriminators: worker id -> its final D (mdgan audit)


@dataclass(frozen=True)
class Durability:
    """Checkpoints and resume (the durable algorithms): as for the server; each worker keeps its state in
    OUT/workers/worker-K. overwrite: a finished run in out_dir is replaced by this one (without it: a
    RunFinished error)."""

    checkpoint_every: int = 0
    keep_checkpoints: int = 3
    resume: str = "no"  # no | yes | auto
    run_id: str | None = None
    overwrite: bool = False


@dataclass(frozen=True)
class SiteFolders:
    """Worker i's data from SITE_DIRS/site-i in the data.dataset format, loaded, checked and shaped as a
    worker does it (mdgan.sites; classes: the run's class names, as the server's --classes)."""

    site_dirs: str | None = None
    bad_images: str = "refuse"
    classes: tuple[str, ...] | None = None


@dataclass(frozen=True)
class Outputs:
    """What a run writes beyond its run folder's usual files: TensorBoard and MLflow tracking
    (mdgan/tracking.py), and OUT/discriminators.pt, every worker's final discriminator (what `mdgan audit`
    attacks; MD-GAN, FL-GAN and the standalone GAN)."""

    tensorboard: str | None = None
    mlflow: str | None = None
    save_discriminators: bool = False


def simulate(config: TrainingConfig, data: DataConfig, out_dir: str, progress: bool = True,
             evaluation: EvaluationOptions = EvaluationOptions(), algorithm: str = "mdgan", options=None, *,
             durability: Durability = Durability(), emulation: Emulation = Emulation(),
             sites: SiteFolders = SiteFolders(), outputs: Outputs = Outputs(), stop_after: int | None = None,
             before_writing=None) -> dict:
    """The whole run in this process: MD-GAN with every worker an object (the same loop as over
    gRPC), or one of the baselines on the same models, seeds and data.

    Worker i's data: shard i of data's dataset (emulation), or its site folder (sites).
    options: the algorithm's own options (its registry entry's `options`: PWGANOptions, ...; None: the
    defaults).
    stop_after: train only the run's first this many iterations, as the whole run of config.iterations
    trains them (its rounds, crash schedule and records are the whole run's; experiments/replay.py), and
    write the outputs of the G it holds there. Not with checkpoints: a stopped run is not resumed.
    before_writing: called once every setting is accepted, before anything is written to out_dir.
    Every refusal comes before it: a refused run leaves out_dir as it was.
    """
    checkpoint_every, keep_checkpoints, resume = (durability.checkpoint_every, durability.keep_checkpoints,
                                                  durability.resume)
    run_id, overwrite = durability.run_id, durability.overwrite
    crash_every, churn, byzantine, attack = (emulation.crash_every, emulation.churn, emulation.byzantine,
                                             emulation.attack)
    site_dirs, bad_images, classes = sites.site_dirs, sites.bad_images, sites.classes
    entry = algorithms.get(algorithm)
    algorithms.refuse(entry, checkpoint_every=checkpoint_every, resume=resume != "no", churn=bool(churn),
                      byzantine=byzantine, crash_every=crash_every, site_dirs=site_dirs,
                      private=config.privacy.active_mechanism)
    if stop_after is not None and (checkpoint_every or resume != "no"):
        raise ConfigError("stop_after trains a run's first iterations once: not with checkpoints or --resume")
    if bool(byzantine) != bool(attack):
        raise ConfigError("--byzantine K and --attack go together")
    if byzantine:
        from mdgan.attacks import ATTACKS, attackers

        attackers(config.workers, byzantine)  # refuses K outside [0, N)
        if attack not in ATTACKS:
            raise ConfigError(f"unknown attack {attack!r}; choose from {ATTACKS}")
    if entry.whole_dataset:  # one G, one D, the whole dataset
        config = replace(config, workers=1, kappa=1)
    config.validate()
    devices.deterministic(config.device)
    if stop_after is not None and not 0 < stop_after <= config.iterations:
        raise ConfigError(f"stop_after must be in 1..{config.iterations} (the run's iterations), not {stop_after!r}")
    if entry.durable:
        run = plan_run(out_dir, config, resume, run_id, overwrite)
    else:
        check_out_dir(out_dir, resume, overwrite)
        run = RunStart(run_id or "", config)
    config = run.config
    options = None if entry.options is None else (options or entry.default_options()).check(config)
    if site_dirs:
        run_classes = RunClasses(classes, config.model.num_classes, config.model.conditional)
        shards = site_shards(site_dirs, data.dataset, config.workers, config.model.sample_shape, run_classes,
                             bad_images)
    else:
        shards = load_all_shards(replace(data, num_shards=config.workers).validate(), config.model.sample_shape)
    if config.privacy.enabled:  # (before anything is written or spent)
        from mdgan import privacy

        privacy.check_run(config, [len(s) for s in shards])
    if before_writing is not None:
        before_writing()
    start_run(out_dir, run)
    generator_side = GeneratorSide(config)
    evaluator = make_evaluator(generator_side, evaluation.data_root, evaluation.every, evaluation.samples,
                               evaluation.reference, evaluation.large_every, evaluation.large_samples)
    from mdgan.tracking import Tracking

    tracking = Tracking.open(run.run_id or algorithm, outputs.tensorboard, outputs.mlflow)
    recorder = RunRecorder(out_dir, stop_after or config.iterations, progress, algorithm, evaluator,
                           resume_at=run.resumed_from, tracking=tracking)
    result = None
    discriminators = {} if outputs.save_discriminators else None
    try:
        result = entry.run_in_process(InProcessRun(
            config, shards, generator_side, recorder, out_dir, run, options, emulation, checkpoint_every,
            keep_checkpoints, discriminators, stop_after))
    finally:
        wall = recorder.close(result.iterations if result else None)
    if discriminators:
        checkpoint.atomic_save({"discriminators": discriminators, "config": config.to_dict()},
                               os.path.join(out_dir, DISCRIMINATORS_FILE))
    extra = {"algorithm": algorithm, "crash_every": crash_every, "run_id": run.run_id or None,
             "resumed_from": run.resumed_from, "byzantine": byzantine, "attack": attack,
             "worker_sizes": {f"worker-{s.index}": len(s) for s in shards},
             # what `mdgan audit` needs to recover each worker's members, from wherever it is run
             "data": None if site_dirs else dataclasses.asdict(replace(
                 data, num_shards=config.workers,
                 data_root=None if data.data_root is None else os.path.abspath(data.data_root))),
             "site_dirs": os.path.abspath(site_dirs) if site_dirs else None}
    if stop_after is not None:
        extra["stop_after"] = stop_after
    if options is not None:  # the options its traffic formula (`mdgan traffic`) and its record need
        extra[algorithm] = options.summary(config)
    return write_outputs(out_dir, config, generator_side, result, wall, "simulate", extra, scores=recorder.scores,
                         tracking=tracking)


