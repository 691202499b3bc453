"""Run configuration: plain dataclasses, validated once where they are built.

Entry points (the CLI, the services' ``__main__``) read flags and ``MDGAN_*`` variables and build
these; nothing below them reads the environment.
"""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass, field
from typing import ClassVar

GAN_KINDS = ("acgan", "gan")
LOSSES = ("non-saturating", "saturating")
DATASETS = ("mnist", "cifar10", "synthetic", "imagefolder")  # imagefolder: see mdgan/sites.py
SPLITS = ("iid", "dirichlet")  # how a dataset is cut into shards (DataConfig.split)
WIRE_DTYPES = ("float32", "float16", "bfloat16", "int8")  # see mdgan/compression.py
AGGREGATIONS = ("mean", "median", "trimmed-mean", "norm-clip")  # see mdgan/aggregation.py
SYNC_MODES = ("all", "quorum", "async")  # see mdgan/algorithms/mdgan/synchrony.py
ARCHITECTURE_NAMES = ("mlp", "cnn-mnist", "cnn-cifar10")  # built by mdgan/models.py (ARCHITECTURES)
MAX_DISC_WIDTH = 8192  # an MLP discriminator's hidden layer: 8,192^2 float32 weights are 268 MB


_SETTING_MARK = "\u2063"  # (an invisible separator) around a setting's key in a ConfigError's text
_NAMED = re.compile(f"{_SETTING_MARK}([a-z0-9_]+){_SETTING_MARK}")


def named(key: str) -> str:
    """A setting named in a ConfigError's text: its key (`kappa`, as a YAML experiment or a library caller
    writes it) in str(error); its flag (`--kappa`) in error.for_flags(), which the command line shows."""
    return f"{_SETTING_MARK}{key}{_SETTING_MARK}"


def as_flag(key: str) -> str:
    return "--" + key.replace("_", "-")


class ConfigError(ValueError):
    """A configuration value is out of range or inconsistent with another one. Its text names settings by
    their keys; for_flags() names them by their command-line flags."""

    def __str__(self) -> str:
        return _NAMED.sub(lambda m: m.group(1), super().__str__())

    def for_flags(self) -> str:
        return _NAMED.sub(lambda m: as_flag(m.group(1)), super().__str__())


def check_device(device: str) -> str:
    """--device: cpu, cuda or cuda:N that this machine has; ConfigError, in one line, otherwise."""
    if not (device == "cpu" or device == "cuda" or device.startswith("cuda:")):
        raise ConfigError(f"{named('device')} must be cpu, cuda or cuda:N, got {device!r}")
    if device != "cpu":
        import torch

        if not torch.cuda.is_available():
            raise ConfigError(f"{named('device')} {device}: no CUDA device is available here")
        index = device.partition(":")[2]
        if index and not (index.isdigit() and int(index) < torch.cuda.device_count()):
            raise ConfigError(f"{named('device')} {device}: this machine has CUDA devices 0 to {torch.cuda.device_count() - 1}")
    return device


@dataclass(frozen=True)
class ModelSpec:
    """What both sides need to build their networks. Travels to workers when they join."""

    architecture: str = "mlp"
    gan: str = "acgan"  # "acgan": D has 1 + num_classes outputs and G is class conditional
    loss: str = "non-saturating"
    latent_dim: int = 100
    num_classes: int = 10
    sample_shape: tuple[int, ...] = (784,)
    disc_width: int = 512  # the MLP discriminator's units per hidden layer (the paper's: 512)

    def validate(self) -> None:
        if self.architecture not in ARCHITECTURE_NAMES:
            raise ConfigError(f"unknown architecture {self.architecture!r}; choose from {sorted(ARCHITECTURE_NAMES)}")
        if self.gan not in GAN_KINDS:
            raise ConfigError(f"unknown gan kind {self.gan!r}; choose from {GAN_KINDS}")
        if self.loss not in LOSSES:
            raise ConfigError(f"unknown loss {self.loss!r}; choose from {LOSSES}")
        if self.latent_dim < 1 or self.num_classes < 1:
            raise ConfigError("latent_dim and num_classes must be positive")
        if not self.sample_shape or any(s < 1 for s in self.sample_shape):
            raise ConfigError(f"bad sample shape {self.sample_shape}")
        if not 1 <= self.disc_width <= MAX_DISC_WIDTH:
            raise ConfigError(f"{named('disc_width')} must be between 1 and {MAX_DISC_WIDTH:,}, got {self.disc_width}")
        if self.disc_width != ModelSpec.disc_width and self.architecture != "mlp":
            raise ConfigError(f"{named('disc_width')} sets the MLP discriminator's width; {named('architecture')} {self.architecture} "
                              "has its own layers (docs/ARCHITECTURES.md)")

    @property
    def conditional(self) -> bool:
        return self.gan == "acgan"

    @property
    def sample_size(self) -> int:
        """d: the number of floats in one generated sample."""
        return math.prod(self.sample_shape)


@dataclass(frozen=True)
class OptimizerSpec:
    """Adam, as in the paper; defaults are the usual DCGAN/ACGAN ones."""

    lr: float = 2e-4
    beta1: float = 0.5
    beta2: float = 0.999

    def validate(self) -> None:
        if not (self.lr > 0 and 0 <= self.beta1 < 1 and 0 <= self.beta2 < 1):
            raise ConfigError(f"bad Adam settings {self}")


DP_MECHANISMS = ("sgd", "feedback")


@dataclass(frozen=True)
class PrivacySpec:
    """Differential privacy on every site (mdgan/privacy.py): off unless a noise multiplier or a target
    epsilon is given. delta 0: min(1e-5, 1/(10 m_n)) per site.

    mechanism "sgd": DP-SGD discriminators (Poisson samples, clipped and noised real-data gradients).
    mechanism "feedback": private feedback (MD-GAN only): each sample's feedback is clipped to C and
    noised before it leaves the site; the site's `discriminators` train without noise on disjoint parts
    of its data and never leave it (mdgan/algorithms/mdgan/private_feedback.py)."""

    noise_multiplier: float = 0.0  # sigma; 0 with no target epsilon: not private
    max_grad_norm: float = 1.0  # C, the per-sample clipping norm
    delta: float = 0.0
    target_epsilon: float = 0.0  # > 0: sigma is computed so that the planned run spends this much
    mechanism: str = "sgd"
    discriminators: int = 1  # "feedback": K discriminators per site, one part of its data each
    # "sgd": each generated sample's gradient in D's step clipped to C too; None: on exactly when DP-SGD is
    clip_generated: bool | None = None
    # research and tests only: each site's noise and Poisson sampling come from this number and the site's slot
    # instead of a secret the site makes (mdgan/secret_noise.py); None: secret. Never sent to the workers.
    fixed_noise: int | None = None
    CLIP_GENERATED_BEFORE: ClassVar[bool] = False  # what a run recorded before the setting existed did

    def __post_init__(self):
        if self.clip_generated is None:
            object.__setattr__(self, "clip_generated", self.active_mechanism == "sgd")

    @property
    def enabled(self) -> bool:
        return self.noise_multiplier > 0 or self.target_epsilon > 0

    @property
    def active_mechanism(self) -> str | None:
        """The mechanism a run uses (None: not private)."""
        return self.mechanism if self.enabled else None

    @property
    def keeps_discriminators(self) -> bool:
        """Private feedback: no discriminator leaves its site (no swaps, no copies for late joiners)."""
        return self.active_mechanism == "feedback"

    def validate(self) -> None:
        for name, value in (("--dp-noise-multiplier", self.noise_multiplier), ("--dp-max-grad-norm", self.max_grad_norm),
                            ("--dp-delta", self.delta), ("--dp-target-epsilon", self.target_epsilon)):
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
                raise ConfigError(f"{name} must be a finite number >= 0, got {value}")
        if self.noise_multiplier and self.target_epsilon:
            raise ConfigError(f"give {named('dp_noise_multiplier')} or {named('dp_target_epsilon')}, not both")
        if self.enabled and not self.max_grad_norm > 0:
            raise ConfigError(f"{named('dp_max_grad_norm')} must be > 0, got {self.max_grad_norm}")
        if self.delta >= 1:
            raise ConfigError(f"{named('dp_delta')} must be in (0, 1/m), got {self.delta}")
        if self.mechanism not in DP_MECHANISMS:
            raise ConfigError(f"{named('dp_mechanism')} must be one of {', '.join(DP_MECHANISMS)}, got {self.mechanism!r}")
        if self.mechanism != "sgd" and not self.enabled:
            raise ConfigError(f"{named('dp_mechanism')} {self.mechanism} needs {named('dp_noise_multiplier')} or {named('dp_target_epsilon')}")
        if isinstance(self.discriminators, bool) or not isinstance(self.discriminators, int) or self.discriminators < 1:
            raise ConfigError(f"{named('dp_discriminators')} must be a whole number >= 1, got {self.discriminators!r}")
        if not isinstance(self.clip_generated, bool):
            raise ConfigError(f"{named('dp_clip_generated')} is a switch (true or false), got {self.clip_generated!r}")
        if self.clip_generated and self.active_mechanism != "sgd":
            raise ConfigError(f"{named('dp_clip_generated')} clips DP-SGD's discriminator steps: it needs {named('dp_mechanism')} sgd "
                              f"and {named('dp_noise_multiplier')} or {named('dp_target_epsilon')}")
        if self.fixed_noise is not None and (isinstance(self.fixed_noise, bool) or not isinstance(self.fixed_noise, int)
                                             or self.fixed_noise < 0):
            raise ConfigError(f"{named('dp_fixed_noise')} must be a whole number >= 0, got {self.fixed_noise!r}")
        if self.fixed_noise is not None and not self.enabled:
            raise ConfigError(f"{named('dp_fixed_noise')} fixes a private run's noise: it needs {named('dp_noise_multiplier')} or "
                              f"{named('dp_target_epsilon')}")
        if self.discriminators > 1 and self.mechanism != "feedback":
            raise ConfigError(f"{named('dp_discriminators')} {self.discriminators} needs {named('dp_mechanism')} feedback (DP-SGD "
                              "trains one discriminator a site)")


@dataclass(frozen=True)
class TrainingConfig:
    """One MD-GAN run, as the server sees it."""

    workers: int = 4
    iterations: int = 1000
    batch_size: int = 10
    kappa: int = 1
    disc_steps: int = 1
    swap_epochs: float = 1.0
    swap_every: int | None = None  # overrides ceil(E*m/b), for short runs
    # Adam moments stay on the worker and are reset when a new discriminator arrives, so a swap
    # moves |theta| floats exactly as in the paper's Table III; True sends them along (3|theta|).
    swap_optimizer_state: bool = False
    seed: int = 0
    # Where this process computes ("cpu", "cuda", "cuda:1"); a property of the process, not of the
    # run: it never travels to the workers, each chooses its own. Randomness is always drawn on the
    # CPU, so the draws are the same on every device.
    device: str = "cpu"
    model: ModelSpec = field(default_factory=ModelSpec)
    generator_optimizer: OptimizerSpec = field(default_factory=OptimizerSpec)
    discriminator_optimizer: OptimizerSpec = field(default_factory=OptimizerSpec)
    # Beyond the paper. How generated batches, feedback and swapped discriminators are
    # rounded on the wire (the rounding is part of the algorithm: mdgan/compression.py).
    wire_dtype: str = "float32"
    # How the server combines the feedback of the workers that got the same X_g (mdgan/aggregation.py):
    # mean is the paper's; the others resist workers that send wrong feedback.
    aggregation: str = "mean"
    trim_fraction: float = 0.2  # trimmed-mean: share of the workers dropped at each end, per coordinate
    # norm-clip: every sample's feedback is scaled down to at most this L2 norm; 0: to the median of
    # the norms the workers sent for that sample (adapts to the feedback's scale, which changes in training)
    clip_norm: float = 0.0
    # How long an iteration waits for feedback (mdgan/algorithms/mdgan/synchrony.py): all (the paper), quorum (update G
    # once `quorum` workers answered; 0: N - 1), async (apply each answer as it comes, weighted by
    # 1/(1 + staleness), dropped beyond max_staleness iterations).
    sync: str = "all"
    quorum: int = 0
    max_staleness: int = 4
    # Differentially private discriminators (mdgan/privacy.py, docs/PRIVACY.md); off by default.
    privacy: PrivacySpec = field(default_factory=PrivacySpec)

    def validate(self) -> "TrainingConfig":
        if self.workers < 1:
            raise ConfigError(f"{named('workers')} must be at least 1")
        if self.iterations < 0:
            raise ConfigError(f"{named('iterations')} must be >= 0")
        if self.batch_size < 1:
            raise ConfigError(f"{named('batch_size')} must be at least 1")
        if not 1 <= self.kappa <= self.workers:
            raise ConfigError(f"{named('kappa')} must be in [1, workers={self.workers}], got {self.kappa}")
        if self.disc_steps < 0:
            raise ConfigError(f"{named('disc_steps')} must be >= 0")
        if not self.swap_epochs > 0:
            raise ConfigError(f"{named('swap_epochs')} must be > 0")
        if self.swap_every is not None and self.swap_every < 1:
            raise ConfigError(f"{named('swap_every')} must be at least 1")
        if self.swap_every is not None and self.privacy.keeps_discriminators:
            raise ConfigError(f"{named('swap_every')} {self.swap_every}: with {named('dp_mechanism')} feedback no discriminator leaves "
                              f"its site, so there are no swaps (leave {named('swap_every')} out)")
        if self.seed < 0:
            raise ConfigError(f"{named('seed')} must be >= 0")
        check_device(self.device)
        if self.wire_dtype not in WIRE_DTYPES:
            raise ConfigError(f"unknown {named('wire_dtype')} {self.wire_dtype!r}; choose from {WIRE_DTYPES}")
        if self.aggregation not in AGGREGATIONS:
            raise ConfigError(f"unknown {named('aggregation')} {self.aggregation!r}; choose from {AGGREGATIONS}")
        if not 0 <= self.trim_fraction < 0.5:
            raise ConfigError(f"{named('trim_fraction')} must be in [0, 0.5), got {self.trim_fraction}")
        if not (math.isfinite(self.clip_norm) and self.clip_norm >= 0):
            raise ConfigError(f"{named('clip_norm')} must be a number >= 0, got {self.clip_norm}")
        if self.sync not in SYNC_MODES:
            raise ConfigError(f"unknown {named('sync')} {self.sync!r}; choose from {SYNC_MODES}")
        if not 0 <= self.quorum <= self.workers:
            raise ConfigError(f"{named('quorum')} must be in [1, workers={self.workers}] (0: N - 1), got {self.quorum}")
        if self.max_staleness < 0:
            raise ConfigError(f"{named('max_staleness')} must be >= 0, got {self.max_staleness}")
        self.model.validate()
        self.privacy.validate()
        self.generator_optimizer.validate()
        self.discriminator_optimizer.validate()
        return self

    @property
    def quorum_size(self) -> int:
        """--sync quorum: the number of answers an iteration waits for."""
        return self.quorum or max(1, self.workers - 1)

    def swap_period(self, shard_size: int) -> int | None:
        """S = ceil(E * m / b) iterations between swaps (Algorithm 1, line 11); None where no
        discriminator leaves its site (private feedback: no swaps).

        With workers of different sizes (sites) the trainers pass the smallest m: no discriminator
        then sees more than E epochs of the data it trains on between two swaps (with the mean, the
        smallest site's D would see more and overfit it); FL-GAN rounds use the same S.
        """
        if self.privacy.keeps_discriminators:
            return None
        if self.swap_every is not None:
            return self.swap_every
        return max(1, math.ceil(self.swap_epochs * shard_size / self.batch_size))

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "TrainingConfig":
        """The inverse of to_dict (a run's config, read back from its run directory)."""
        d = dict(d)
        model = dict(d.pop("model"))
        model["sample_shape"] = tuple(model["sample_shape"])
        # a run from before DP: not private; from before --dp-clip-generated: the generated part unclipped
        privacy = PrivacySpec(**{"clip_generated": PrivacySpec.CLIP_GENERATED_BEFORE, **d.pop("privacy", {})})
        return cls(model=ModelSpec(**model), privacy=privacy,
                   generator_optimizer=OptimizerSpec(**d.pop("generator_optimizer")),
                   discriminator_optimizer=OptimizerSpec(**d.pop("discriminator_optimizer")),
                   **d)


@dataclass(frozen=True)
class DataConfig:
    """Where a worker's shard comes from.

    split "iid": a seeded random permutation cut into equal pieces (the paper's setting);
    "dirichlet": non-i.i.d. shards, for each class the proportions over shards ~ Dir(alpha)
    (smaller alpha, more skewed). Both are seeded by split_seed, the same on every worker.
    """

    dataset: str = "mnist"
    data_root: str = "data"
    num_shards: int = 1
    split_seed: int = 0
    split: str = "iid"
    dirichlet_alpha: float = 0.5
    # > 0: only this many images of the dataset take part (a seeded choice, before the split): small
    # runs, and the memorisation experiment of docs/PRIVACY.md (a few dozen images per site)
    max_samples: int = 0

    def validate(self) -> "DataConfig":
        if self.dataset not in DATASETS:
            raise ConfigError(f"unknown dataset {self.dataset!r}; choose from {DATASETS}")
        if self.num_shards < 1:
            raise ConfigError("number of shards must be at least 1")
        if self.split not in SPLITS:
            raise ConfigError(f"unknown split {self.split!r}; choose from {SPLITS}")
        if not (math.isfinite(self.dirichlet_alpha) and self.dirichlet_alpha > 0):
            raise ConfigError(f"{named('dirichlet_alpha')} must be a positive number, got {self.dirichlet_alpha}")
        if self.max_samples < 0:
            raise ConfigError(f"{named('max_samples')} must be >= 0, got {self.max_samples}")
        return self
