"""Every training setting, declared once (mdgan/settings.py), walked through every path that carries
it: a flag of `mdgan simulate`, `mdgan local` and `mdgan-server`, its variable, a `--config` file, an
experiment's key, `mdgan local`'s forwarding to its server, and (for those the workers need) the
run's TrainingSpec on the wire. Each path must end in the same TrainingConfig."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from mdgan import settings
from mdgan.config import TrainingConfig
from mdgan.settings import SETTINGS, TRAINING_KEYS, TRAINING_SETTINGS

# a value other than the default, valid on its own with every other setting at its default
ALTERNATIVES = {"workers": 6, "kappa": 2, "quorum": 2, "architecture": "cnn-mnist", "gen_lr": 1e-4, "disc_lr": 3e-4,
                "dp_noise_multiplier": 1.5, "dp_target_epsilon": 3.0, "dp_delta": 1e-6, "swap_every": 7,
                "dp_clip_generated": False, "dp_fixed_noise": 7}  # (clip: on by default with DP-SGD, its companion)
# the settings an alternative is valid only with (given by the same path)
COMPANIONS = {"dp_mechanism": {"dp_noise_multiplier": 1.5},
              "dp_discriminators": {"dp_mechanism": "feedback", "dp_noise_multiplier": 1.5},
              "dp_clip_generated": {"dp_noise_multiplier": 1.5},
              "dp_fixed_noise": {"dp_noise_multiplier": 1.5}}


def settings_of(config: TrainingConfig) -> dict:
    """The settings by key that make `config`, the inverse of mdgan.settings.training_config: what a path
    made of each setting (both optimizers share their betas, as the flags set them; a derived setting, None, where
    it is what the others make it)."""
    g, d, p = config.generator_optimizer, config.discriminator_optimizer, config.privacy
    if (g.beta1, g.beta2) != (d.beta1, d.beta2):
        raise AssertionError("the generator's and the discriminator's Adam betas differ: no flags set that")
    return {"workers": config.workers, "iterations": config.iterations, "batch_size": config.batch_size,
            "kappa": config.kappa, "disc_steps": config.disc_steps, "swap_epochs": config.swap_epochs,
            "swap_every": config.swap_every, "swap_optimizer_state": config.swap_optimizer_state, "seed": config.seed,
            "architecture": config.model.architecture, "gan": config.model.gan, "loss": config.model.loss,
            "disc_width": config.model.disc_width,
            "gen_lr": g.lr, "disc_lr": d.lr, "beta1": d.beta1, "beta2": d.beta2, "wire_dtype": config.wire_dtype,
            "aggregation": config.aggregation, "trim_fraction": config.trim_fraction, "sync": config.sync,
            "quorum": config.quorum, "max_staleness": config.max_staleness, "clip_norm": config.clip_norm,
            "dp_noise_multiplier": p.noise_multiplier or None, "dp_target_epsilon": p.target_epsilon or None,
            "dp_max_grad_norm": p.max_grad_norm, "dp_delta": p.delta, "dp_mechanism": p.mechanism,
            "dp_discriminators": p.discriminators, "dp_fixed_noise": p.fixed_noise,
            "dp_clip_generated": None if p == dataclasses.replace(p, clip_generated=None) else p.clip_generated}


def alternative(setting):
    if setting.key in ALTERNATIVES:
        return ALTERNATIVES[setting.key]
    if setting.kind is bool:
        return not setting.default
    if setting.choices:
        return next(c for c in setting.choices if c != setting.default)
    if setting.kind is int:
        return setting.default + 1
    if setting.kind is float:
        return setting.default / 2 if setting.default else 0.5
    raise AssertionError(f"no alternative value for {setting.key}")


def command_parser(name: str) -> argparse.ArgumentParser:
    from mdgan_app.cli import build_parser

    top = build_parser()
    return next(a for a in top._actions if isinstance(a, argparse._SubParsersAction)).choices[name]


def server_parser() -> argparse.ArgumentParser:
    from services.server.__main__ import build_parser

    return build_parser()


def flag_tokens(setting, value) -> list[str]:
    if setting.kind is bool:
        return [setting.flag if value else "--no-" + setting.flag[2:]]
    return [setting.flag, str(value)]


def config_of(args: argparse.Namespace) -> TrainingConfig:
    from mdgan_app.cli import _resolve_workers
    from services.common.settings import training_config

    if getattr(args, "workers", 0) is None:
        _resolve_workers(args)
    return training_config(args)


def test_every_setting_has_a_flag_in_every_command_that_trains_and_one_default():
    for parser in (command_parser("simulate"), command_parser("local"), server_parser()):
        actions = {a.dest: a for a in parser._actions}
        for setting in TRAINING_SETTINGS:
            action = actions[setting.key]
            assert setting.flag in action.option_strings
            if setting.key != "workers":  # (mdgan local and simulate: 4, or the number of --site-dirs)
                assert action.default == setting.default, setting.key
    from mdgan_app.experiment import DEFAULTS

    assert {key: DEFAULTS[key] for key in settings.TRAINING_KEYS} == settings.defaults()
    assert settings.training_config(settings.defaults()) == TrainingConfig().validate()


@pytest.mark.parametrize("key", list(SETTINGS))
def test_a_setting_reaches_the_run_the_same_by_every_path(key, tmp_path, monkeypatch):
    from mdgan_app.experiment import DEFAULTS, training_config as experiment_config
    from mdgan_app.launcher import _forwarded_training_flags
    from services.common import training_spec
    from services.common.settings import settings_toml

    setting = SETTINGS[key]
    value = alternative(setting)
    given = {key: value, **COMPANIONS.get(key, {})}
    tokens = [token for k, v in given.items() for token in flag_tokens(SETTINGS[k], v)]
    data = ["--dataset", "mnist"]
    by_flag = config_of(command_parser("simulate").parse_args([*data, *tokens]))
    assert {k: settings_of(by_flag)[k] for k in given} == given  # the values took effect
    assert all(settings_of(by_flag)[other] == SETTINGS[other].default
               for other in SETTINGS if other not in (*given, "workers")), "one flag set another setting"

    configs = {"mdgan local flag": config_of(command_parser("local").parse_args([*data, *tokens])),
               "mdgan-server flag": config_of(server_parser().parse_args(tokens))}
    config_file = tmp_path / "settings.toml"
    config_file.write_text(settings_toml(given, "one setting"))
    configs["--config"] = config_of(command_parser("simulate").parse_args([*data, "--config", str(config_file)]))
    with monkeypatch.context() as env:
        for k, v in given.items():
            env.setenv(f"MDGAN_SIMULATE_{k.upper()}", "true" if v is True else str(v))
        configs["variable"] = config_of(command_parser("simulate").parse_args(data))
    with monkeypatch.context() as env:
        for k, v in given.items():
            env.setenv(f"MDGAN_{k.upper()}", "true" if v is True else str(v))
        configs["mdgan-server variable"] = config_of(server_parser().parse_args([]))
    configs["experiment"] = experiment_config({**DEFAULTS, **given})
    local = command_parser("local").parse_args([*data, *tokens])
    config_of(local)
    configs["mdgan local -> mdgan-server"] = config_of(server_parser().parse_args(_forwarded_training_flags(local)))
    for path, config in configs.items():
        assert config == by_flag, f"{key} by {path}"

    worker = training_spec.config_from_spec(training_spec.spec_from_config(by_flag))  # the worker's view of the run
    expected = value if setting.to_workers else setting.default
    assert settings_of(worker)[key] == expected, f"{key} on the wire"


def option_values(defaults, field) -> list:
    """Values other than the default that the options accept: a few candidates, 0 among them."""
    import dataclasses

    from mdgan.config import ConfigError

    default = field.default
    if field.metadata.get("choices"):
        candidates = [c for c in field.metadata["choices"] if c != default]
    elif default is None or (isinstance(default, int) and not isinstance(default, bool)):
        candidates = [(default or 0) + 1, (default or 0) + 3, 0]
    else:
        candidates = [default * 1.5, default / 2, 0.0] if default else [0.25, 0.5]
    accepted = []
    for value in candidates:
        if value == default:
            continue
        options = dataclasses.replace(defaults, **{field.name: value})
        try:
            options.validate() if hasattr(options, "validate") else None
        except ConfigError:
            continue
        accepted.append(value)
    assert accepted, f"no value but the default for {field.name}"
    return accepted


@pytest.mark.parametrize("name", ["mdgan", "pwgan", "psgan"])
def test_an_algorithms_options_travel_in_a_message_of_their_own(name):
    """Each option reaches the workers as the server holds it; an option given as 0 arrives as 0, not as
    its default (presence); a spec without the algorithm's message means every default."""
    import dataclasses

    from mdgan import algorithms
    from services.common import codec
    from services.common.proto import coordinator_pb2 as pb

    entry = algorithms.get(name)
    defaults = entry.default_options()
    assert codec.options_from_spec(pb.TrainingSpec(), name) == defaults
    for field in entry.option_fields():
        for value in option_values(defaults, field):
            options = dataclasses.replace(defaults, **{field.name: value})
            spec = pb.TrainingSpec()
            codec.describe_options(spec, name, options)
            assert spec.WhichOneof("options") == name
            assert codec.options_from_spec(pb.TrainingSpec.FromString(spec.SerializeToString()), name) == options


@pytest.mark.parametrize("key", TRAINING_KEYS)
def test_every_training_setting_that_varies_names_its_runs(tmp_path, key):
    """Two runs of an experiment that differ in one setting are two runs, each named by its value (a setting
    missing from the names made them 'the same' and refused the experiment)."""
    from mdgan_app.experiment import expand

    value = alternative(SETTINGS[key])
    runs = expand({"out": str(tmp_path), "base": {}, "runs": [{}, {key: value}], "name": "x"})
    assert len({r["name"] for r in runs}) == 2
    assert str(value).lower() in runs[1]["name"].lower(), runs[1]["name"]
