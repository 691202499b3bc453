"""Every training setting of a run, declared once.

A Setting names its key (argparse's dest, a `--config` or experiment key, the `MDGAN_*` variable's
suffix), its flag, default, help and type; the command-line parsers, the variables, `--config` files,
experiments, `mdgan local`'s forwarding to its server and `training_config` are all made from
TRAINING_SETTINGS. Defaults are read from the config dataclasses (mdgan/config.py), so a value is
typed once. Each algorithm's own options are declared the same way, on its options dataclass
(mdgan/algorithms/base.py `option()`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Mapping

from mdgan.config import (AGGREGATIONS, DP_MECHANISMS, GAN_KINDS, LOSSES, SYNC_MODES, WIRE_DTYPES, ConfigError, ModelSpec,
                          OptimizerSpec, PrivacySpec, TrainingConfig)

PAPER = "training (the paper's N, I, b, kappa, L, E)"
BEYOND = "beyond the paper: wire compression, robust aggregation, partial synchronisation"
PRIVACY = ("privacy: differential privacy per site, by DP-SGD discriminators or private feedback (Opacus; "
           "docs/PRIVACY.md)")


def _default(cls, name: str):
    return next(f.default for f in dataclasses.fields(cls) if f.name == name)


AS_DEFAULT = object()  # a Setting's `before` when a record lacking its key had its default


@dataclass(frozen=True)
class Setting:
    """One training setting: key (dest), default, help, the help group it is shown in, its type
    (bool: a switch, --flag sets it and --no-flag clears it), its choices; optional: None is a value (unset);
    to_workers: the server sends it to its workers in the run's TrainingSpec (services/common/codec.py);
    before: what a record written before the setting existed (launch.toml, an experiment's run.json) stands for.
    A setting whose default (None) is worked out from the others is worked out in `resolved`."""

    key: str
    default: Any
    help: str
    group: str
    kind: type
    choices: tuple | None = None
    optional: bool = False
    to_workers: bool = True
    before: Any = AS_DEFAULT

    @property
    def flag(self) -> str:
        return "--" + self.key.replace("_", "-")


TRAINING_SETTINGS: tuple[Setting, ...] = (
    Setting("workers", _default(TrainingConfig, "workers"), "N: number of workers (one shard each)", PAPER, int),
    Setting("iterations", _default(TrainingConfig, "iterations"), "I: global iterations", PAPER, int),
    Setting("batch_size", _default(TrainingConfig, "batch_size"), "b: samples per batch", PAPER, int),
    Setting("kappa", _default(TrainingConfig, "kappa"), "k: generated batches per iteration (<= N)", PAPER, int),
    Setting("disc_steps", _default(TrainingConfig, "disc_steps"), "L: discriminator steps per iteration", PAPER, int),
    Setting("swap_epochs", _default(TrainingConfig, "swap_epochs"), "E: local epochs between swaps", PAPER, float,
            to_workers=False),
    Setting("swap_every", None, "swap every this many iterations instead of ceil(E*m/b)", PAPER, int, optional=True,
            to_workers=False),
    Setting("swap_optimizer_state", False,
            "send Adam moments along with a swapped discriminator (default: weights only)", PAPER, bool),
    Setting("seed", _default(TrainingConfig, "seed"), "run seed (every role's randomness derives from it)", PAPER, int),
    Setting("architecture", ModelSpec.architecture, "network architecture (see `mdgan models`)", PAPER, str),
    Setting("gan", ModelSpec.gan, "ACGAN (class conditional) or plain GAN", PAPER, str, GAN_KINDS),
    Setting("disc_width", ModelSpec.disc_width, "the MLP discriminator's units per hidden layer (the paper's 512)",
            BEYOND, int),
    Setting("loss", ModelSpec.loss,
            "generator loss: -log D(G(z)) (default) or log(1 - D(G(z))) as written in the paper", PAPER, str, LOSSES),
    Setting("gen_lr", OptimizerSpec.lr, "generator Adam learning rate", PAPER, float),
    Setting("disc_lr", OptimizerSpec.lr, "discriminator Adam learning rate", PAPER, float),
    Setting("beta1", OptimizerSpec.beta1, "Adam beta1 (both networks)", PAPER, float),
    Setting("beta2", OptimizerSpec.beta2, "Adam beta2 (both networks)", PAPER, float),
    Setting("wire_dtype", _default(TrainingConfig, "wire_dtype"),
            "how generated batches, feedback and swapped discriminators travel: float32 (the paper), float16, "
            "bfloat16, or int8 with a float32 scale per row (per sample)", BEYOND, str, WIRE_DTYPES),
    Setting("aggregation", _default(TrainingConfig, "aggregation"),
            "how the feedback of the workers that got the same X_g is combined, per sample: mean (the paper), "
            "coordinate-wise median, trimmed-mean, or norm-clip (each sample's feedback scaled to L2 norm <= "
            "--clip-norm, then the mean)", BEYOND, str, AGGREGATIONS, to_workers=False),
    Setting("trim_fraction", _default(TrainingConfig, "trim_fraction"),
            "trimmed-mean: share of the workers dropped at each end of every coordinate", BEYOND, float,
            to_workers=False),
    Setting("sync", _default(TrainingConfig, "sync"),
            "all: every iteration waits for every worker (the paper); quorum: G is updated once --quorum workers "
            "answered, late answers are dropped; async: every answer is applied as it comes, weighted by "
            "1/(1 + staleness)", BEYOND, str, SYNC_MODES, to_workers=False),
    Setting("quorum", _default(TrainingConfig, "quorum"), "--sync quorum: answers to wait for (0: N - 1)", BEYOND, int,
            to_workers=False),
    Setting("max_staleness", _default(TrainingConfig, "max_staleness"),
            "--sync async: drop feedback computed more than this many iterations ago", BEYOND, int, to_workers=False),
    Setting("clip_norm", _default(TrainingConfig, "clip_norm"),
            "norm-clip: largest L2 norm of one sample's feedback (0: the median of the norms the workers sent for "
            "that sample)", BEYOND, float, to_workers=False),
    Setting("dp_noise_multiplier", None,
            "sigma > 0: Gaussian noise of std sigma x C on every D step's clipped real-data gradients (sgd) or on "
            "every clipped feedback sample (feedback), on every site (default: not private, unless "
            "--dp-target-epsilon)", PRIVACY, float, optional=True),
    Setting("dp_target_epsilon", None,
            "instead of --dp-noise-multiplier: each site computes the sigma that spends this epsilon over the "
            "planned run (sgd: I x L steps at sampling rate b / m_n; feedback: ceil(I / K) answers of each part)",
            PRIVACY, float, optional=True),
    Setting("dp_max_grad_norm", PrivacySpec.max_grad_norm, "C: every real sample's gradient (sgd), or every "
            "generated sample's feedback (feedback), is clipped to this L2 norm", PRIVACY, float),
    Setting("dp_mechanism", PrivacySpec.mechanism,
            "sgd: DP-SGD discriminators; feedback (MD-GAN): only clipped, noised feedback leaves a site, its "
            "discriminators train without noise and never leave it (no swaps)", PRIVACY, str, DP_MECHANISMS),
    Setting("dp_discriminators", PrivacySpec.discriminators,
            "--dp-mechanism feedback: K discriminators per site, each on its own part of the site's data; each "
            "answer comes from one of them, drawn at random (each part answers once every K iterations)",
            PRIVACY, int),
    Setting("dp_delta", PrivacySpec.delta,
            "delta of each site's (epsilon, delta) (0: min(1e-5, 1/(10 m_n)); must be below 1/m_n)", PRIVACY, float),
    Setting("dp_clip_generated", PrivacySpec.clip_generated,
            "--dp-mechanism sgd: clip each generated sample's gradient in a discriminator step to C as well, as each "
            "real sample's is, so that the two parts weigh alike (no noise on it, no epsilon spent: the generated "
            "samples are public). On with DP-SGD unless --no-dp-clip-generated (the generated part's mean gradient "
            "unclipped: D learns to call every real image fake; docs/PRIVACY.md)", PRIVACY, bool, optional=True,
            before=PrivacySpec.CLIP_GENERATED_BEFORE),
    Setting("dp_fixed_noise", None,
            "research and tests only: each site's DP noise and Poisson sampling come from this number and the "
            "site's slot instead of a secret the site makes itself, so that two runs draw the same noise (mdgan "
            "local == mdgan simulate). The guarantee then holds only against those who do not know the number; "
            "the run's privacy record says it was set (docs/PRIVACY.md). Default: secret noise",
            PRIVACY, int, optional=True, to_workers=False),
)
SETTINGS: dict[str, Setting] = {s.key: s for s in TRAINING_SETTINGS}
TRAINING_KEYS = tuple(SETTINGS)


def defaults() -> dict[str, Any]:
    """Every training setting's default, by key."""
    return {s.key: s.default for s in TRAINING_SETTINGS}


def resolved(values: Mapping[str, Any]) -> dict[str, Any]:
    """Settings by key with each derived one left at None worked out from the others (what the run trains), where
    they are valid: what a record of the run (launch.toml, an experiment's run.json, `mdgan local`'s flags to its
    server) holds, so that it runs the same again, and two records of a run compare alike."""
    out = dict(values)
    if "dp_clip_generated" in out and out["dp_clip_generated"] is None:
        try:
            out["dp_clip_generated"] = privacy_spec(
                out["dp_noise_multiplier"], out["dp_max_grad_norm"], out["dp_delta"], out["dp_target_epsilon"],
                out["dp_mechanism"], out["dp_discriminators"]).clip_generated
        except (ConfigError, KeyError, TypeError):
            pass  # (refused where the run is made)
    return out


def before_values() -> dict[str, Any]:
    """What a record lacking a setting's key stands for, where that is not the setting's default: its `before`,
    the behaviour runs had before it was a setting."""
    return {s.key: s.before for s in TRAINING_SETTINGS if s.before is not AS_DEFAULT}


def privacy_spec(noise_multiplier: float | None, max_grad_norm: float, delta: float, target_epsilon: float | None,
                 mechanism: str = PrivacySpec.mechanism, discriminators: int = PrivacySpec.discriminators,
                 clip_generated: bool = PrivacySpec.clip_generated, fixed_noise: int | None = None) -> PrivacySpec:
    """The run's DP settings; a sigma or target given must be > 0 (leave the flag out for a run without DP)."""
    for flag, value in (("--dp-noise-multiplier", noise_multiplier), ("--dp-target-epsilon", target_epsilon)):
        if value is not None and not value > 0:
            raise ConfigError(f"{flag} must be > 0, got {value} (leave it out for a run without differential privacy)")
    return PrivacySpec(noise_multiplier or 0.0, max_grad_norm, delta, target_epsilon or 0.0, mechanism, discriminators,
                       clip_generated, fixed_noise)


def training_config(values: Mapping[str, Any], dataset: str | None = None, device: str = "cpu",
                    classes: tuple[str, ...] | None = None) -> TrainingConfig:
    """The run's TrainingConfig from its settings by key (parsed flags, an experiment's run), validated.

    The samples' flat shape: with a dataset, the dataset's (mnist/synthetic (784,), cifar10 (3072,)),
    and an architecture built for another image size is refused; without one (the server), the
    architecture's own (cnn-cifar10: (3072,)), (784,) for the MLP. classes: the run's class names
    (image folders), which set the number of classes.
    """
    from mdgan.data import DATASET_SAMPLE_SHAPES
    from mdgan.models import ARCHITECTURE_SAMPLE_SHAPES

    missing = [key for key in TRAINING_KEYS if key not in values]
    if missing:
        raise ConfigError(f"settings missing: {', '.join(missing)}")
    v = {key: values[key] for key in TRAINING_KEYS}
    native = ARCHITECTURE_SAMPLE_SHAPES.get(v["architecture"])  # None: any shape (mlp) or unknown (refused below)
    sample_shape = DATASET_SAMPLE_SHAPES.get(dataset) if dataset is not None else None
    if sample_shape is None:
        sample_shape = native or ModelSpec().sample_shape
    elif native is not None and tuple(native) != tuple(sample_shape):
        raise ConfigError(f"--architecture {v['architecture']} works on samples of shape {tuple(native)}, but "
                          f"--dataset {dataset} has samples of shape {tuple(sample_shape)}")
    return TrainingConfig(
        workers=v["workers"], iterations=v["iterations"], batch_size=v["batch_size"], kappa=v["kappa"],
        disc_steps=v["disc_steps"], swap_epochs=v["swap_epochs"], swap_every=v["swap_every"],
        swap_optimizer_state=v["swap_optimizer_state"], seed=v["seed"], device=device,
        model=ModelSpec(architecture=v["architecture"], gan=v["gan"], loss=v["loss"], sample_shape=tuple(sample_shape),
                        num_classes=len(classes) if classes else ModelSpec.num_classes, disc_width=v["disc_width"]),
        generator_optimizer=OptimizerSpec(v["gen_lr"], v["beta1"], v["beta2"]),
        discriminator_optimizer=OptimizerSpec(v["disc_lr"], v["beta1"], v["beta2"]),
        wire_dtype=v["wire_dtype"], aggregation=v["aggregation"], trim_fraction=v["trim_fraction"],
        clip_norm=v["clip_norm"], sync=v["sync"], quorum=v["quorum"], max_staleness=v["max_staleness"],
        privacy=privacy_spec(v["dp_noise_multiplier"], v["dp_max_grad_norm"], v["dp_delta"], v["dp_target_epsilon"],
                             v["dp_mechanism"], v["dp_discriminators"], v["dp_clip_generated"], v["dp_fixed_noise"]),
    ).validate()
