"""A run's TrainingConfig <-> the TrainingSpec a worker gets when it joins, field by declared field.

TRAINING_SPEC_FIELDS names, for each field of the message, where its value lives in TrainingConfig
and which declared setting (mdgan/settings.py) it carries; every setting declared `to_workers` has one
field here, and no other does (checked at import). A sender sets every field, so an explicit 0 stays 0;
a field absent from a message (a sender from before the fields had presence) means what it meant then
(`absent`)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from mdgan import settings
from mdgan.config import ModelSpec, OptimizerSpec, PrivacySpec, TrainingConfig


@dataclass(frozen=True)
class SpecField:
    field: str  # TrainingSpec's field
    path: str  # where it lives in TrainingConfig ("model.gan")
    setting: str | None  # the declared setting it carries; None: worked out from others (the model's shape)
    absent: Any  # its value when a message lacks it


def _fields() -> tuple[SpecField, ...]:
    t, m, o, p = TrainingConfig, ModelSpec, OptimizerSpec, PrivacySpec
    return (
        SpecField("architecture", "model.architecture", "architecture", ""),
        SpecField("gan", "model.gan", "gan", ""),
        SpecField("loss", "model.loss", "loss", ""),
        SpecField("latent_dim", "model.latent_dim", None, 0),
        SpecField("num_classes", "model.num_classes", None, 0),
        SpecField("disc_width", "model.disc_width", "disc_width", m.disc_width),
        SpecField("batch_size", "batch_size", "batch_size", 0),
        SpecField("disc_steps", "disc_steps", "disc_steps", 0),
        SpecField("disc_lr", "discriminator_optimizer.lr", "disc_lr", 0.0),
        SpecField("disc_beta1", "discriminator_optimizer.beta1", "beta1", 0.0),
        SpecField("disc_beta2", "discriminator_optimizer.beta2", "beta2", 0.0),
        SpecField("gen_lr", "generator_optimizer.lr", "gen_lr", o.lr),
        SpecField("gen_beta1", "generator_optimizer.beta1", "beta1", 0.0),
        SpecField("gen_beta2", "generator_optimizer.beta2", "beta2", o.beta2),
        SpecField("seed", "seed", "seed", 0),
        SpecField("swap_optimizer_state", "swap_optimizer_state", "swap_optimizer_state", False),
        SpecField("kappa", "kappa", "kappa", 0),
        SpecField("workers", "workers", "workers", 0),
        SpecField("iterations", "iterations", "iterations", t.iterations),
        SpecField("wire_dtype", "wire_dtype", "wire_dtype", "float32"),
        SpecField("dp_noise_multiplier", "privacy.noise_multiplier", "dp_noise_multiplier", 0.0),
        SpecField("dp_target_epsilon", "privacy.target_epsilon", "dp_target_epsilon", 0.0),
        SpecField("dp_max_grad_norm", "privacy.max_grad_norm", "dp_max_grad_norm", p.max_grad_norm),
        SpecField("dp_delta", "privacy.delta", "dp_delta", 0.0),
        SpecField("dp_mechanism", "privacy.mechanism", "dp_mechanism", p.mechanism),
        SpecField("dp_discriminators", "privacy.discriminators", "dp_discriminators", p.discriminators),
        SpecField("dp_clip_generated", "privacy.clip_generated", "dp_clip_generated", False),
    )


TRAINING_SPEC_FIELDS = _fields()


def _check_declarations() -> None:
    carried = {f.setting for f in TRAINING_SPEC_FIELDS if f.setting}
    declared = {s.key for s in settings.TRAINING_SETTINGS if s.to_workers}
    if carried != declared:
        raise ImportError(f"TrainingSpec carries {sorted(carried - declared)} not declared to_workers, and lacks "
                          f"{sorted(declared - carried)} declared to_workers (mdgan/settings.py)")


_check_declarations()


def _get(config, path: str):
    for name in path.split("."):
        config = getattr(config, name)
    return config


def _with(config, path: str, value):
    head, _, rest = path.partition(".")
    return dataclasses.replace(config, **{head: _with(getattr(config, head), rest, value) if rest else value})


def spec_from_config(config: TrainingConfig, algorithm: str = "mdgan") -> "coordinator_pb2.TrainingSpec":
    from services.common.proto import coordinator_pb2

    spec = coordinator_pb2.TrainingSpec(algorithm=algorithm, sample_shape=list(config.model.sample_shape))
    for f in TRAINING_SPEC_FIELDS:
        value = _get(config, f.path)
        if value is not None:  # (a derived value the config has not worked out stays absent)
            setattr(spec, f.field, value)
    return spec


def config_from_spec(spec) -> TrainingConfig:
    """The worker's view of the run; raises mdgan.config.ConfigError on nonsense."""
    config = TrainingConfig()
    config = _with(config, "model.sample_shape", tuple(spec.sample_shape))
    for f in TRAINING_SPEC_FIELDS:
        config = _with(config, f.path, getattr(spec, f.field) if spec.HasField(f.field) else f.absent)
    return config.validate()
