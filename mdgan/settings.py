"""Every setting of a run, declared once: training (the paper's and beyond), data, evaluation,
durability, emulation and outputs.

A Setting names its key (argparse's dest, a `--config` or experiment key, the `MDGAN_*` variable's
suffix), its flag, default, range, help, short name in experiment labels, and whether it goes to the
workers in the run's TrainingSpec. The command-line parsers (services/common/settings.py), the
variables, `--config` files, experiments (mdgan_app/experiment.py), launch.toml, `mdgan local`'s
forwarding, the wire's TrainingSpec (services/common/training_spec.py) and RunSpec.from_values
(mdgan/run_spec.py) are all made from these tables. Training defaults are read from the config
dataclasses (mdgan/config.py); the other settings' defaults are here, and the dataclasses that carry
them (EvaluationOptions, Durability, ...) read them from here, so a value is typed once. Each
algorithm's own options are declared the same way, on its options dataclass (mdgan/algorithms/base.py
`option()`). Errors name a setting by its key (`named`); the command line shows its flag.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Mapping

from mdgan.attacks import ATTACKS
from mdgan.config import (AGGREGATIONS, DATASETS, DP_MECHANISMS, GAN_KINDS, LOSSES, SPLITS, SYNC_MODES, WIRE_DTYPES,
                          ConfigError, DataConfig, ModelSpec, OptimizerSpec, PrivacySpec, TrainingConfig, named)

PAPER = "training (the paper's N, I, b, kappa, L, E)"
BEYOND = "beyond the paper: wire compression, robust aggregation, partial synchronisation"
PRIVACY = ("privacy: differential privacy per site, by DP-SGD discriminators or private feedback (Opacus; "
           "docs/PRIVACY.md)")


def _default(cls, name: str):
    return next(f.default for f in dataclasses.fields(cls) if f.name == name)


AS_DEFAULT = object()  # a Setting's `before` when a record lacking its key had its default


@dataclass(frozen=True)
class Setting:
    """One setting: key (dest), default, help, the help group it is shown in, its type (bool: a switch,
    --flag sets it and --no-flag clears it), its choices; optional: None is a value (unset); low: the least
    value (None: any), `expected` saying the range in words; short: its name in an experiment's run labels
    (None: it names no run); to_workers: the server sends it to its workers in the run's TrainingSpec
    (services/common/training_spec.py); experiment: an experiment's YAML takes it; commands: the commands that
    have its flag (simulate, local: `mdgan`'s; server, worker: the services'; none: an experiment's only); before:
    what a record
    written before the setting existed (launch.toml, an experiment's run.json) stands for. A setting whose
    default (None) is worked out from the others is worked out in `resolved`."""

    key: str
    default: Any
    help: str
    group: str
    kind: type
    choices: tuple | None = None
    optional: bool = False
    to_workers: bool = True
    before: Any = AS_DEFAULT
    short: str | None = None
    low: int | float | None = None
    expected: str = ""
    experiment: bool = True
    commands: tuple[str, ...] = ("simulate", "local")

    @property
    def flag(self) -> str:
        return "--" + self.key.replace("_", "-")

    def problem(self, value: Any) -> str | None:
        """What is wrong with `value` for this setting, said after its name ("must be ..., not X"); None: nothing."""
        if value is None and (self.optional or self.default is None):
            return None
        kind = self.kind
        if kind is bool:
            return None if isinstance(value, bool) else f"is a switch (true or false), not {value!r}"
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if not isinstance(value, kind) or isinstance(value, bool):
            return f"must be {KIND_WORDS[kind]}, not {value!r}"
        if self.choices is not None and value not in self.choices:
            return f"must be one of {', '.join(map(str, self.choices))}, not {value!r}"
        if self.low is not None and value < self.low:
            return f"must be {self.expected or f'at least {self.low}'}, not {value!r}"
        return None

    def check(self, value: Any) -> Any:
        """`value` (an int as a float where the setting is one) if this setting takes it; a ConfigError naming
        the setting otherwise."""
        problem = self.problem(value)
        if problem:
            raise ConfigError(f"{named(self.key)} {problem}")
        return float(value) if self.kind is float and isinstance(value, int) else value

    def parse(self, text: str) -> Any:
        """A command line's or a variable's text as this setting's value; ValueError saying what is wrong."""
        if self.kind is bool:
            raise ValueError("a switch takes no value")
        try:
            value = self.kind(text)
        except ValueError:
            raise ValueError(f"must be {KIND_WORDS[self.kind]}, not {text!r}") from None
        problem = self.problem(value) if self.choices is None else None  # (argparse says a wrong choice)
        if problem:
            raise ValueError(problem)
        return value


KIND_WORDS = {bool: "true or false", int: "a whole number", float: "a number", str: "a text"}  # (in errors)


TRAINING_SETTINGS: tuple[Setting, ...] = (
    Setting("workers", _default(TrainingConfig, "workers"), "N: number of workers (one shard each)", PAPER, int,
            short="N"),
    Setting("iterations", _default(TrainingConfig, "iterations"), "I: global iterations", PAPER, int, short="I"),
    Setting("batch_size", _default(TrainingConfig, "batch_size"), "b: samples per batch", PAPER, int, short="b"),
    Setting("kappa", _default(TrainingConfig, "kappa"), "k: generated batches per iteration (<= N)", PAPER, int,
            short="k"),
    Setting("disc_steps", _default(TrainingConfig, "disc_steps"), "L: discriminator steps per iteration", PAPER, int,
            short="L"),
    Setting("swap_epochs", _default(TrainingConfig, "swap_epochs"), "E: local epochs between swaps", PAPER, float,
            to_workers=False, short="E"),
    Setting("swap_every", None, "swap every this many iterations instead of ceil(E*m/b)", PAPER, int, optional=True,
            to_workers=False, short="S"),
    Setting("swap_optimizer_state", False,
            "send Adam moments along with a swapped discriminator (default: weights only)", PAPER, bool,
            short="swapstate"),
    Setting("seed", _default(TrainingConfig, "seed"), "run seed (every role's randomness derives from it)", PAPER, int,
            short="seed"),
    Setting("architecture", ModelSpec.architecture, "network architecture (see `mdgan models`)", PAPER, str, short=""),
    Setting("gan", ModelSpec.gan, "ACGAN (class conditional) or plain GAN", PAPER, str, GAN_KINDS, short=""),
    Setting("disc_width", ModelSpec.disc_width, "the MLP discriminator's units per hidden layer (the paper's 512)",
            BEYOND, int, short="Dw"),
    Setting("loss", ModelSpec.loss,
            "generator loss: -log D(G(z)) (default) or log(1 - D(G(z))) as written in the paper", PAPER, str, LOSSES,
            short=""),
    Setting("gen_lr", OptimizerSpec.lr, "generator Adam learning rate", PAPER, float, short="lrG"),
    Setting("disc_lr", OptimizerSpec.lr, "discriminator Adam learning rate", PAPER, float, short="lrD"),
    Setting("beta1", OptimizerSpec.beta1, "Adam beta1 (both networks)", PAPER, float, short="beta1_"),
    Setting("beta2", OptimizerSpec.beta2, "Adam beta2 (both networks)", PAPER, float, short="beta2_"),
    Setting("wire_dtype", _default(TrainingConfig, "wire_dtype"),
            "how generated batches, feedback and swapped discriminators travel: float32 (the paper), float16, "
            "bfloat16, or int8 with a float32 scale per row (per sample)", BEYOND, str, WIRE_DTYPES, short="wire"),
    Setting("aggregation", _default(TrainingConfig, "aggregation"),
            "how the feedback of the workers that got the same X_g is combined, per sample: mean (the paper), "
            "coordinate-wise median, trimmed-mean, or norm-clip (each sample's feedback scaled to L2 norm <= "
            "--clip-norm, then the mean)", BEYOND, str, AGGREGATIONS, to_workers=False, short=""),
    Setting("trim_fraction", _default(TrainingConfig, "trim_fraction"),
            "trimmed-mean: share of the workers dropped at each end of every coordinate", BEYOND, float,
            to_workers=False, short="trim"),
    Setting("sync", _default(TrainingConfig, "sync"),
            "all: every iteration waits for every worker (the paper); quorum: G is updated once --quorum workers "
            "answered, late answers are dropped; async: every answer is applied as it comes, weighted by "
            "1/(1 + staleness)", BEYOND, str, SYNC_MODES, to_workers=False, short=""),
    Setting("quorum", _default(TrainingConfig, "quorum"), "--sync quorum: answers to wait for (0: N - 1)", BEYOND, int,
            to_workers=False, short="K"),
    Setting("max_staleness", _default(TrainingConfig, "max_staleness"),
            "--sync async: drop feedback computed more than this many iterations ago", BEYOND, int, to_workers=False,
            short="S"),
    Setting("clip_norm", _default(TrainingConfig, "clip_norm"),
            "norm-clip: largest L2 norm of one sample's feedback (0: the median of the norms the workers sent for "
            "that sample)", BEYOND, float, to_workers=False, short="clip"),
    Setting("dp_noise_multiplier", None,
            "sigma > 0: Gaussian noise of std sigma x C on every D step's clipped real-data gradients (sgd) or on "
            "every clipped feedback sample (feedback), on every site (default: not private, unless "
            "--dp-target-epsilon)", PRIVACY, float, optional=True, short="sigma"),
    Setting("dp_target_epsilon", None,
            "instead of --dp-noise-multiplier: each site computes the sigma that spends this epsilon over the "
            "planned run (sgd: I x L steps at sampling rate b / m_n; feedback: ceil(I / K) answers of each part)",
            PRIVACY, float, optional=True, short="eps"),
    Setting("dp_max_grad_norm", PrivacySpec.max_grad_norm, "C: every real sample's gradient (sgd), or every "
            "generated sample's feedback (feedback), is clipped to this L2 norm", PRIVACY, float, short="C"),
    Setting("dp_mechanism", PrivacySpec.mechanism,
            "sgd: DP-SGD discriminators; feedback (MD-GAN): only clipped, noised feedback leaves a site, its "
            "discriminators train without noise and never leave it (no swaps)", PRIVACY, str, DP_MECHANISMS,
            short="dp"),
    Setting("dp_discriminators", PrivacySpec.discriminators,
            "--dp-mechanism feedback: K discriminators per site, each on its own part of the site's data; each "
            "answer comes from one of them, drawn at random (each part answers once every K iterations)",
            PRIVACY, int, short="parts"),
    Setting("dp_delta", PrivacySpec.delta,
            "delta of each site's (epsilon, delta) (0: min(1e-5, 1/(10 m_n)); must be below 1/m_n)", PRIVACY, float,
            short="delta"),
    Setting("dp_clip_generated", PrivacySpec.clip_generated,
            "--dp-mechanism sgd: clip each generated sample's gradient in a discriminator step to C as well, as each "
            "real sample's is, so that the two parts weigh alike (no noise on it, no epsilon spent: the generated "
            "samples are public). On with DP-SGD unless --no-dp-clip-generated (the generated part's mean gradient "
            "unclipped: D learns to call every real image fake; docs/PRIVACY.md)", PRIVACY, bool, optional=True,
            before=PrivacySpec.CLIP_GENERATED_BEFORE, short="clipgen"),
    Setting("dp_fixed_noise", None,
            "research and tests only: each site's DP noise and Poisson sampling come from this number and the "
            "site's slot instead of a secret the site makes itself, so that two runs draw the same noise (mdgan "
            "local == mdgan simulate). The guarantee then holds only against those who do not know the number; "
            "the run's privacy record says it was set (docs/PRIVACY.md). Default: secret noise",
            PRIVACY, int, optional=True, to_workers=False, short="fixednoise"),
)
SETTINGS: dict[str, Setting] = {s.key: s for s in TRAINING_SETTINGS}
TRAINING_KEYS = tuple(SETTINGS)

DATA = "data"
EVALUATION = "evaluation (MNIST score and FID with the shipped MNIST classifier)"
DURABLE = "durable runs (MD-GAN)"
EMULATION = "emulated Byzantine workers (experiments)"
OUTPUTS = "outputs"
TRACKING = "experiment tracking (pip install 'mdgan[tracking]')"

# The run's other settings: what it trains on, how it is scored, kept, emulated and written. None goes to the
# workers in the TrainingSpec (a worker's data is its own; the server scores, keeps and writes the run).
RUN_SETTINGS: tuple[Setting, ...] = (
    Setting("dataset", _default(DataConfig, "dataset"),
            "mnist, cifar10, a small synthetic set, or imagefolder: a folder of images, one sub-folder per class "
            "(torchvision's ImageFolder layout) or unlabelled images for a plain GAN", DATA, str, DATASETS,
            to_workers=False, commands=("simulate", "local", "worker")),
    Setting("data_root", _default(DataConfig, "data_root"),
            "folder holding MNIST/raw or cifar-10-batches-py (torchvision's layout; never downloads), or the image "
            "folder", DATA, str, to_workers=False, commands=("simulate", "local", "worker")),
    Setting("bad_images", "refuse",
            "imagefolder: an image that cannot be read, or cannot be resized like the others (another aspect "
            "ratio), stops the load with its name (refuse) or is left out with a warning (skip)", DATA, str,
            ("refuse", "skip"), to_workers=False, experiment=False, commands=("simulate", "local", "worker")),
    Setting("split_seed", _default(DataConfig, "split_seed"),
            "emulation (a shared dataset cut into shards): seed of the split (the same on every worker)", DATA, int,
            to_workers=False, experiment=False, commands=("simulate", "local", "worker")),
    Setting("max_samples", _default(DataConfig, "max_samples"),
            "use only this many images of the dataset (a seeded choice, before the split; 0: all): small runs, and "
            "the memorisation experiment of docs/PRIVACY.md", DATA, int, low=0, to_workers=False, experiment=False,
            commands=("simulate", "local", "worker")),
    Setting("split", _default(DataConfig, "split"),
            "iid: equal random shards (the paper); dirichlet: non-i.i.d. shards, per class proportions ~ Dir(alpha) "
            "(workers then need an explicit --shard-index)", DATA, str, SPLITS, to_workers=False, short="",
            commands=("simulate", "local", "worker")),
    Setting("dirichlet_alpha", _default(DataConfig, "dirichlet_alpha"),
            "concentration of the dirichlet split (smaller: more skewed shards)", DATA, float, to_workers=False,
            commands=("simulate", "local", "worker")),
    Setting("eval_every", 1000,
            "score the generator every this many iterations, in the background (0: only at the end, -1: never); "
            "MNIST-shaped samples only", EVALUATION, int, low=-1,
            expected="a number of iterations, or 0 (only at the end) or -1 (never)", to_workers=False,
            commands=("simulate", "local", "server")),
    Setting("eval_samples", 500, "generated images per evaluation", EVALUATION, int, low=2,
            expected="at least 2 images (a FID needs two to compare)", to_workers=False,
            commands=("simulate", "local", "server")),
    Setting("eval_reference", 2000, "MNIST test images FID compares against", EVALUATION, int, low=2,
            expected="at least 2 images (a FID needs two to compare)", to_workers=False,
            commands=("simulate", "local", "server")),
    Setting("eval_large_every", 0, "long runs: also score on eval_large_samples images every this many iterations "
            "and at the end (0: never)", EVALUATION, int, low=0, to_workers=False, commands=()),
    Setting("eval_large_samples", 5000, "images of the large evaluation", EVALUATION, int, low=2,
            expected="at least 2 images (a FID needs two to compare)", to_workers=False, commands=()),
    Setting("eval_downstream", 0, "> 0: the final generator's downstream accuracy on that many generated images "
            "(mdgan/downstream.py; MNIST only)", EVALUATION, int, low=0, to_workers=False, commands=()),
    Setting("checkpoint_every", 0,
            "checkpoint every this many iterations (0: never); a server also on SIGTERM (the server and its "
            "workers at the same iteration boundary, each worker in its state folder)", DURABLE, int, low=0, to_workers=False,
            commands=("simulate", "local", "server")),
    Setting("keep_checkpoints", 3, "complete checkpoints kept", DURABLE, int, low=1, to_workers=False,
            experiment=False, commands=("simulate", "local", "server", "worker")),
    Setting("byzantine", 0, "K: the last K workers by rank send wrong feedback (needs --attack)", EMULATION, int,
            low=0, to_workers=False, short="byz"),
    Setting("attack", None, "what they send: sign-flip (-F), scale (10 F), sign-flip-scale (-10 F), noise (10x F's "
            "RMS), free-ride (zeros); swap-*: the discriminators they push (docs/PRIVACY.md)", EMULATION, str, ATTACKS,
            optional=True, to_workers=False, short="", commands=("simulate", "local", "worker")),
    Setting("save_discriminators", False,
            "also write OUT/discriminators.pt, every worker's final discriminator (what `mdgan audit OUT` attacks; "
            "MD-GAN, FL-GAN and the standalone GAN)", OUTPUTS, bool, to_workers=False, commands=("simulate",)),
    Setting("tensorboard", None, "write TensorBoard event files under DIR/<run id>: losses, accuracies, workers, "
            "swaps, scores and a sample grid at every evaluation", TRACKING, str, optional=True, to_workers=False,
            experiment=False, commands=("simulate", "local", "server")),
    Setting("mlflow", None, "log the run to an MLflow tracking store: a folder (./mlruns), file:///path or "
            "http(s)://server; parameters, metrics, the final samples and generator. A slow or absent server never "
            "slows training: it is said once in the log", TRACKING, str, optional=True, to_workers=False,
            experiment=False, commands=("simulate", "local", "server")),
)
EVERY_SETTING: dict[str, Setting] = {s.key: s for s in (*TRAINING_SETTINGS, *RUN_SETTINGS)}
assert len(EVERY_SETTING) == len(TRAINING_SETTINGS) + len(RUN_SETTINGS), "a key declared twice"


def default(key: str) -> Any:
    """A setting's default (the dataclasses that carry a run setting read theirs here)."""
    return EVERY_SETTING[key].default


def check_values(values: Mapping[str, Any]) -> None:
    """Every declared setting in `values` is one its declaration takes (type, choices, range); a ConfigError
    naming the first that is not."""
    for key, value in values.items():
        setting = EVERY_SETTING.get(key)
        if setting is not None:
            setting.check(value)


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
        raise ConfigError(f"{named('architecture')} {v['architecture']} works on samples of shape {tuple(native)}, but "
                          f"{named('dataset')} {dataset} has samples of shape {tuple(sample_shape)}")
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
