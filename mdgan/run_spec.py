"""One run, whole: what it trains (TrainingConfig), on which data, how it is scored, kept, emulated and
written. `RunSpec.from_values` builds it from a run's settings by key (a command's flags, an experiment's
run, a kept run.json); `validate` refuses, in one line naming the setting, everything the run would refuse later,
before anything is written. `mdgan.simulation.train` trains it."""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from typing import Any, Mapping

from mdgan import algorithms, settings
from mdgan.algorithms.base import Emulation
from mdgan.config import ConfigError, DataConfig, TrainingConfig, named
from mdgan.run import EvaluationOptions

DATASET_SIZES = {"mnist": 60000, "cifar10": 50000}  # training images of the datasets whose size is known unread


@dataclass(frozen=True)
class Durability:
    """Checkpoints and resume (the durable algorithms): as for the server; each worker keeps its state in
    OUT/workers/worker-K. overwrite: a finished run in out_dir is replaced by this one (without it: a
    RunFinished error)."""

    checkpoint_every: int = settings.default("checkpoint_every")
    keep_checkpoints: int = settings.default("keep_checkpoints")
    resume: str = "no"  # no | yes | auto
    run_id: str | None = None
    overwrite: bool = False


@dataclass(frozen=True)
class SiteFolders:
    """Worker i's data from SITE_DIRS/site-i in the data.dataset format, loaded, checked and shaped as a
    worker does it (mdgan.sites; classes: the run's class names, as the server's --classes)."""

    site_dirs: str | None = None
    bad_images: str = settings.default("bad_images")
    classes: tuple[str, ...] | None = None


@dataclass(frozen=True)
class Outputs:
    """What a run writes beyond its run folder's usual files: TensorBoard and MLflow tracking
    (mdgan/tracking.py), and OUT/discriminators.pt, every worker's final discriminator (what `mdgan audit`
    attacks; MD-GAN, FL-GAN and the standalone GAN)."""

    tensorboard: str | None = settings.default("tensorboard")
    mlflow: str | None = settings.default("mlflow")
    save_discriminators: bool = settings.default("save_discriminators")


def check_evaluation(evaluation: EvaluationOptions, dataset: str, downstream: int = 0) -> None:
    """The scoring a run asks for is one it can do."""
    if evaluation.every < -1:
        raise ConfigError(f"eval_every must be -1 (never), 0 (at the end) or more, not {evaluation.every}")
    for name, value in (("eval_samples", evaluation.samples), ("eval_reference", evaluation.reference),
                        ("eval_large_samples", evaluation.large_samples)):
        if value < 2:
            raise ConfigError(f"{name} must be at least 2 (a FID needs two images to compare), not {value}")
    if evaluation.large_every < 0:
        raise ConfigError(f"eval_large_every must be >= 0, not {evaluation.large_every}")
    if downstream < 0:
        raise ConfigError(f"eval_downstream must be >= 0, not {downstream}")
    if downstream and dataset != "mnist":
        raise ConfigError(f"eval_downstream: downstream accuracy is measured on MNIST, not {dataset}")


def known_shard_sizes(data: DataConfig, workers: int) -> list[int]:
    """The i.i.d. shards' sizes where they are known without reading the data; [] otherwise."""
    from mdgan.data import SYNTHETIC_SIZE, shard_sizes

    size = {**DATASET_SIZES, "synthetic": SYNTHETIC_SIZE}.get(data.dataset)
    if data.split != "iid" or not size:
        return []
    return shard_sizes(min(size, data.max_samples or size), workers)


@dataclass(frozen=True)
class RunSpec:
    """Everything one run of any algorithm needs. stop_after: train only the run's first this many
    iterations, as the whole run trains them (experiments/replay.py). downstream: score the final
    generator's downstream accuracy on that many images (the experiment does, after the run)."""

    config: TrainingConfig
    data: DataConfig = field(default_factory=DataConfig)
    algorithm: str = "mdgan"
    options: Any = None
    evaluation: EvaluationOptions = field(default_factory=EvaluationOptions)
    durability: Durability = field(default_factory=Durability)
    emulation: Emulation = field(default_factory=Emulation)
    sites: SiteFolders = field(default_factory=SiteFolders)
    outputs: Outputs = field(default_factory=Outputs)
    stop_after: int | None = None
    downstream: int = 0

    def validate(self, in_process: bool = True) -> "RunSpec":
        """The spec as it trains (an algorithm on the whole dataset: one worker, kappa 1; the options
        checked against the config), or a ConfigError for the first setting it would refuse. Reads no
        data and writes nothing: what depends on the data (a site's privacy budget, its folders) is
        checked again when the data is loaded. in_process: the run trains in this process (False: on the
        services, `mdgan local`)."""
        entry = algorithms.get(self.algorithm)
        d, e = self.durability, self.emulation
        algorithms.refuse(entry, checkpoint_every=d.checkpoint_every, resume=d.resume != "no", churn=bool(e.churn),
                          byzantine=e.byzantine, crash_every=e.crash_every, site_dirs=self.sites.site_dirs,
                          in_process=in_process, private=self.config.privacy.active_mechanism)
        if d.resume not in ("no", "yes", "auto"):
            raise ConfigError(f"resume must be no, yes or auto, not {d.resume!r}")
        if self.stop_after is not None and (d.checkpoint_every or d.resume != "no"):
            raise ConfigError(f"stop_after trains a run's first iterations once: not with checkpoints or {named('resume')}")
        if bool(e.byzantine) != bool(e.attack):
            raise ConfigError(f"{named('byzantine')} K and {named('attack')} go together")
        config = self.config
        if entry.whole_dataset:  # one G, one D, the whole dataset
            config = replace(config, workers=1, kappa=1)
        config.validate()
        if e.byzantine:
            from mdgan.attacks import ATTACKS, attackers

            attackers(config.workers, e.byzantine)  # refuses K outside [0, N)
            if e.attack not in ATTACKS:
                raise ConfigError(f"unknown attack {e.attack!r}; choose from {ATTACKS}")
        if self.stop_after is not None and not 0 < self.stop_after <= config.iterations:
            raise ConfigError(f"stop_after must be in 1..{config.iterations} (the run's iterations), "
                              f"not {self.stop_after!r}")
        data = replace(self.data, num_shards=config.workers).validate()
        check_evaluation(self.evaluation, data.dataset, self.downstream)
        options = None if entry.options is None else (self.options or entry.default_options()).check(config)
        if config.privacy.enabled:
            from mdgan import privacy

            privacy.check_run(config, [] if self.sites.site_dirs else known_shard_sizes(data, config.workers))
        return replace(self, config=config, data=data, options=options)

    @classmethod
    def from_values(cls, values: Mapping[str, Any], first: int | None = None, score_first: bool = False, *,
                    command: bool = False) -> "RunSpec":
        """The run of `values`, settings by key, from any source: a command's parsed flags (command=True), an
        experiment's run (mdgan_app/experiment.py DEFAULTS' keys), a kept run.json. A declared setting
        (mdgan/settings.py) the source lacks has its default; each is checked by its declaration first. Beside
        them: algorithm and device; an experiment's spellings (swap_every "never", crash "every I/N"); a command's
        resume (no|yes), run_id, overwrite, churn ([(iteration, "leave"|"join", slot)]), site_dirs and classes.

        command: durability and emulation as asked, and another algorithm's option set is refused; otherwise (an
        experiment's run) a durable algorithm checkpoints and resumes by itself, and the others run through.
        first: only its first this many iterations, without checkpoints or saved discriminators, unscored unless
        score_first."""
        values = {**{key: s.default for key, s in settings.EVERY_SETTING.items()}, **values}
        if values["swap_every"] == "never":
            values["swap_every"] = values["iterations"] + 1
        settings.check_values(values)  # each setting's type, choices and range, by its declaration
        classes = values.get("classes")
        config = settings.training_config(values, dataset=values["dataset"], device=values.get("device", "cpu"),
                                          classes=classes)
        entry = algorithms.get(values["algorithm"])
        if command:
            algorithms.refuse_foreign_options(values["algorithm"], values)
            durability = Durability(values["checkpoint_every"], values["keep_checkpoints"], values.get("resume", "no"),
                                    values.get("run_id"), bool(values.get("overwrite")))
            emulation = Emulation(churn=values.get("churn"), byzantine=values["byzantine"], attack=values["attack"])
        else:  # (the algorithms that cannot checkpoint run through: a stop restarts them)
            durable = first is None and values["checkpoint_every"] > 0 and entry.resumable
            durability = Durability(checkpoint_every=values["checkpoint_every"] if durable else 0,
                                    keep_checkpoints=values["keep_checkpoints"], resume="auto" if durable else "no")
            emulation = Emulation(crash_every=crash_period(values),
                                  byzantine=values["byzantine"] if values["attack"] else 0,
                                  attack=values["attack"] if values["byzantine"] else None)
        return cls(
            config=config, algorithm=values["algorithm"], options=entry.options_from(values), stop_after=first,
            data=DataConfig(values["dataset"], values["data_root"], config.workers, values["split_seed"],
                            split=values["split"], dirichlet_alpha=values["dirichlet_alpha"],
                            max_samples=values["max_samples"]),
            evaluation=EvaluationOptions(
                data_root=evaluation_root(values),
                every=values["eval_every"] if first is None or score_first else -1, samples=values["eval_samples"],
                reference=values["eval_reference"], large_every=values["eval_large_every"],
                large_samples=values["eval_large_samples"]),
            durability=durability, emulation=emulation,
            sites=SiteFolders(site_dirs=values.get("site_dirs"), bad_images=values["bad_images"], classes=classes),
            outputs=Outputs(tensorboard=values["tensorboard"], mlflow=values["mlflow"],
                            save_discriminators=first is None and bool(values["save_discriminators"])),
            downstream=int(values["eval_downstream"] or 0) if first is None else 0)


def evaluation_root(values: Mapping[str, Any]) -> str | None:
    """Where the scores' MNIST test set is: an MNIST run's data root (with site folders, the data root if it
    holds MNIST); None: the run is not scored."""
    if values["eval_every"] < 0:
        return None
    if values["dataset"] == "mnist" and not values.get("site_dirs"):
        return values["data_root"]
    if values.get("site_dirs") and os.path.isdir(os.path.join(values["data_root"], "MNIST", "raw")):
        return values["data_root"]
    return None


def crash_period(values: Mapping[str, Any]) -> int | None:
    """An experiment's `crash`: "every I/N" (the paper's crash experiment) or None."""
    if values["crash"] is None:
        return None
    if values["crash"] != "every I/N":
        raise ConfigError(f"crash: only 'every I/N' is known, got {values['crash']!r}")
    period = max(1, values["iterations"] // values["workers"])
    algorithms.refuse(algorithms.get(values["algorithm"]), crash_every=period)
    return period
