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
    from mdgan_app.cluster_commands import forwarded_training_flags
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
    configs["mdgan local -> mdgan-server"] = config_of(server_parser().parse_args(forwarded_training_flags(local)))
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


# Where each of the run's other settings lands in its RunSpec (a new setting without a place here fails below).
SPEC_FIELDS = {"dataset": "data.dataset", "data_root": "data.data_root", "split_seed": "data.split_seed",
               "max_samples": "data.max_samples", "split": "data.split", "dirichlet_alpha": "data.dirichlet_alpha",
               "bad_images": "sites.bad_images", "eval_every": "evaluation.every", "eval_samples": "evaluation.samples",
               "eval_reference": "evaluation.reference", "eval_large_every": "evaluation.large_every",
               "eval_large_samples": "evaluation.large_samples", "eval_downstream": "downstream",
               "checkpoint_every": "durability.checkpoint_every", "keep_checkpoints": "durability.keep_checkpoints",
               "byzantine": "emulation.byzantine", "attack": "emulation.attack",
               "save_discriminators": "outputs.save_discriminators", "tensorboard": "outputs.tensorboard",
               "mlflow": "outputs.mlflow"}
RUN_ALTERNATIVES = {"dataset": "synthetic", "data_root": "elsewhere", "attack": "sign-flip", "byzantine": 1,
                    "tensorboard": "tb", "mlflow": "mlruns", "eval_every": 50, "dirichlet_alpha": 0.25}
RUN_COMPANIONS = {"byzantine": {"attack": "sign-flip"}, "attack": {"byzantine": 1},
                  "dirichlet_alpha": {"split": "dirichlet"}}


def spec_value(spec, key):
    value = spec
    for part in SPEC_FIELDS[key].split("."):
        value = getattr(value, part)
    return value


def test_every_setting_is_declared_once_with_a_place_in_the_run():
    assert set(settings.EVERY_SETTING) == set(TRAINING_KEYS) | set(SPEC_FIELDS)
    for setting in settings.EVERY_SETTING.values():
        assert setting.help and setting.group, setting.key
        assert setting.check(setting.default) == setting.default, setting.key  # its default is one it takes


@pytest.mark.parametrize("key", [s.key for s in settings.RUN_SETTINGS])
def test_a_run_setting_reaches_the_run_the_same_by_every_path(key, tmp_path, monkeypatch):
    """Each of the run's other settings (data, evaluation, durability, emulation, outputs): by a flag of
    `mdgan simulate` and `mdgan local`, a variable, a `--config` file and an experiment's key, it ends in the same
    RunSpec (RunSpec.from_values, the one builder); `mdgan local` hands the server its own as the server's flags."""
    from mdgan.run_spec import RunSpec
    from mdgan_app.experiment import DEFAULTS
    from mdgan_app.cluster_commands import SERVER_SETTINGS, forwarded_training_flags
    from services.common.settings import settings_toml

    every = settings.EVERY_SETTING
    value = RUN_ALTERNATIVES[key] if key in RUN_ALTERNATIVES else alternative(every[key])
    given = {key: value, **RUN_COMPANIONS.get(key, {})}
    base = {"dataset": "synthetic"} if key != "dataset" else {}
    specs = {}
    if every[key].experiment:
        specs["experiment"] = RunSpec.from_values({**DEFAULTS, **base, **given})
    from services.worker.__main__ import build_parser as worker_parser

    parsers = {"simulate": command_parser("simulate"), "local": command_parser("local"), "server": server_parser(),
               "worker": worker_parser()}
    for command, parser in parsers.items():  # the commands that have its flag, and only those
        dests = {a.dest for a in parser._actions}
        if command == "server" and key == "dataset":
            continue  # (the server's own --dataset: the kind of data its workers hold, default none)
        assert (key in dests) == (command in every[key].commands), f"{key} in {command}"
    if every[key].commands:
        tokens = [t for k, v in {**base, **given}.items() for t in flag_tokens(every[k], v)]

        def command_spec(args):
            if args.workers is None:
                args.workers = 4
            return RunSpec.from_values(vars(args), command=True)

        specs["simulate flag"] = command_spec(command_parser("simulate").parse_args(tokens))
        if "local" in every[key].commands:
            local = command_parser("local").parse_args(tokens)
            specs["local flag"] = command_spec(local)
        config_file = tmp_path / "run.toml"
        config_file.write_text(settings_toml({**base, **given}, "one setting"))
        specs["--config"] = command_spec(command_parser("simulate").parse_args(["--config", str(config_file)]))
        with monkeypatch.context() as env:
            for k, v in {**base, **given}.items():
                env.setenv(f"MDGAN_SIMULATE_{k.upper()}", "true" if v is True else str(v))
            specs["variable"] = command_spec(command_parser("simulate").parse_args([]))
        if key in SERVER_SETTINGS:
            server = server_parser().parse_args(forwarded_training_flags(local))
            assert getattr(server, key) == value, f"{key}: mdgan local -> mdgan-server"
    assert specs, f"{key} has no path into a run"
    for path, spec in specs.items():
        assert spec_value(spec, key) == value, f"{key} by {path}"
        for other in SPEC_FIELDS:
            if other not in (*given, *base, "data_root"):  # (evaluation.data_root follows the dataset)
                expected = every[other].default
                assert spec_value(spec, other) == expected, f"{key} by {path} also set {other}"


@pytest.mark.parametrize("key,bad", [("eval_samples", 1), ("kappa", 0), ("checkpoint_every", -2), ("split", "rows"),
                                     ("swap_optimizer_state", "yes"), ("workers", 2.5)])
def test_a_setting_out_of_range_is_named_by_its_key_in_the_library_and_by_its_flag_on_the_command_line(key, bad):
    from mdgan.config import ConfigError
    from mdgan.run_spec import RunSpec
    from mdgan_app.experiment import DEFAULTS

    with pytest.raises(ConfigError) as refused:
        RunSpec.from_values({**DEFAULTS, "dataset": "synthetic", key: bad}).validate()
    flag = "--" + key.replace("_", "-")
    assert str(refused.value).startswith(key) and flag not in str(refused.value), str(refused.value)
    assert refused.value.for_flags().startswith(flag), refused.value.for_flags()


def test_an_experiment_is_refused_whole_before_it_writes_naming_the_run_and_the_setting(tmp_path, capsys):
    """A bad setting of any run (a range only a declaration knows, eval_samples >= 2) refuses the experiment
    before experiment.json or any run folder is written, in one line naming the YAML key, not a flag."""
    from mdgan_app.cli import main

    spec = tmp_path / "exp.yaml"
    out = tmp_path / "out"
    spec.write_text(f"out: {out}\nname: bad\nbase:\n  dataset: synthetic\n  iterations: 4\n  eval_every: -1\n"
                    "runs:\n  - {workers: 2}\n  - {workers: 3}\n  - {workers: 4, eval_samples: 1}\n")
    assert main(["experiment", str(spec)]) == 2
    error = capsys.readouterr().err
    assert "eval_samples must be at least 2" in error and "--eval-samples" not in error, error
    assert not out.exists() or not any(out.iterdir())
