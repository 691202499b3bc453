"""Command-line flags with environment fallbacks, shared by every entry point.

Precedence: a flag given on the command line, then its variable, then the default. Each program reads
its own namespace of variables, so that a variable set for one never changes another:

    mdgan-server, mdgan-worker, mdgan-healthcheck   MDGAN_<FLAG>          (what compose and Helm set)
    mdgan local, mdgan simulate, ...                MDGAN_<COMMAND>_<FLAG> (MDGAN_LOCAL_WORKERS, ...)
    mdgan certs ...                                  none

(a worker's MDGAN_SERVER=host:port once made `mdgan certs issue` fail: it read it as its --server).
Only entry points build these parsers.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys

from services.common import allocator, scheduling
from mdgan.renames import RENAMED_SETTINGS
from mdgan.config import ConfigError, DataConfig, TrainingConfig

ENV_PREFIX = "MDGAN_"
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


def env_name(dest: str, prefix: str = ENV_PREFIX) -> str:
    return prefix + dest.upper()


def program_version() -> str:
    """This installation's version (the package metadata's), for --version and the image tag."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("mdgan")
    except PackageNotFoundError:  # run from a checkout that was never installed
        return "unknown (not installed: pip install -e .)"


EXIT_CODES = """exit status:
  0    done (the run finished, or the command did what it was asked)
  1    the run failed: a worker's or the server's own error, or the run stopped early; the last line
       says who and why (mdgan local prints it)
  2    a bad setting or input, said in one line (a flag, a variable, a data file, a certificate)
  3    (mdgan-worker) the server refused this worker: its reason is in the log; (mdgan experiment
       --time-limit) runs were left for another start: the last line names them
  128+N  stopped by signal N (130: Ctrl-C, 143: SIGTERM); a stopped run resumes with --resume"""


def settings_toml(settings: dict, header: str, worked_out: dict | None = None) -> str:
    """Settings (dest -> value) as a TOML file that --config takes: a key per flag (batch-size = 10),
    unset ones (None: TOML has no null) as comments, with what they come to where `worked_out` says (a
    derived setting: mdgan.settings.resolved)."""
    lines = [f"# {header}"]
    for dest, value in settings.items():
        key = dest.replace("_", "-")
        if value is None and dest in (worked_out or {}):
            lines.append(f"# {key} =  (unset: {str(worked_out[dest]).lower()} with the settings above and below)")
        elif value is None:
            lines.append(f"# {key} =  (unset)")
        elif isinstance(value, bool):
            lines.append(f"{key} = {str(value).lower()}")
        elif isinstance(value, (int, float)):
            lines.append(f"{key} = {value!r}")
        elif isinstance(value, (list, tuple)):
            lines.append(f"{key} = {json.dumps([str(v) for v in value])}")
        else:
            lines.append(f"{key} = {json.dumps(str(value))}")
    return "\n".join(lines) + "\n"


class _HelpFormatter(argparse.HelpFormatter):
    """argparse's, but the exit-status table keeps its lines."""

    def _fill_text(self, text, width, indent):
        if text.startswith("exit status:"):
            return "".join(indent + line for line in text.splitlines(keepends=True))
        return super()._fill_text(text, width, indent)


def add_version(parser: argparse.ArgumentParser, program: str) -> None:
    parser.add_argument("--version", action="version", version=f"{program} {program_version()}")


def _shown_default(action: argparse.Action) -> str:
    """' (default: X)' for help: the built-in default (a variable's applies when parsing). Nothing for
    a flag, an empty or absent default (0 is shown), or a help text that already says it."""
    default = action.default
    if action.nargs == 0 or default is None or default is False or default is argparse.SUPPRESS \
            or default in ("", [], ()) or "default" in (action.help or ""):
        return ""
    return f" (default: {str(default).replace('%', '%%')})"  # (help is %-formatted)


def given_options(parser: argparse.ArgumentParser, argv: list[str]) -> set[str]:
    """The dests of the options of `parser` that `argv` gives (as `--opt value`, `--opt=value` or an
    abbreviation argparse accepts) or that their MDGAN_* variable sets: what the user chose for this
    command, which settings saved by an earlier command must not override."""
    options = {string: action.dest for action in parser._actions for string in action.option_strings}
    given = set()
    for token in argv:
        if token == "--":
            break
        if not token.startswith("-"):
            continue
        name = token.split("=", 1)[0]
        if name in options:
            given.add(options[name])
        elif name.startswith("--") and parser.allow_abbrev:
            matches = {dest for string, dest in options.items() if string.startswith(name)}
            given |= matches if len(matches) == 1 else set()
    given |= getattr(parser, "config_dests", set())  # a --config file's settings are chosen too
    prefix = getattr(parser, "env_prefix", None)
    if prefix:
        given |= {action.dest for action in parser._actions
                  if action.option_strings and env_name(action.dest, prefix) in os.environ}
    return given


class EnvArgumentParser(argparse.ArgumentParser):
    """argparse, where every option's default may come from its variable: env_prefix + FLAG (MDGAN_ by
    default; None: no variables at all). A subcommand's parser takes its own env_prefix.

    Applied when parsing (and when printing help), so options added through argument groups and
    subcommands get it too.
    """

    def __init__(self, *args, env_prefix: str | None = ENV_PREFIX, config_file: bool = False, **kwargs):
        # A flag is taken only whole: with abbreviations, `--port 50051` was --port-file (a server on the default
        # port, and a file named 50051), and a flag added later could change what an old command line means.
        kwargs.setdefault("allow_abbrev", False)
        kwargs.setdefault("epilog", EXIT_CODES)
        kwargs.setdefault("formatter_class", _HelpFormatter)
        super().__init__(*args, **kwargs)
        self.env_prefix = env_prefix
        self.config_dests: set[str] = set()  # the options a --config file set
        if config_file:
            self.add_argument("--config", metavar="FILE", default=None,
                              help="a TOML file of settings, one key per flag (batch-size = 10, insecure = true); "
                                   "a flag, then a variable, then the file, then the default")
            self.add_argument("--print-config", action="store_true",
                              help="print every setting as this command would run with it (as TOML) and exit")

    # -- --config FILE ------------------------------------------------------------------------
    def _options(self) -> dict[str, argparse.Action]:
        return {a.dest: a for a in self._actions if a.option_strings and a.dest not in ("help", "version", "config",
                                                                                        "print_config")}

    def _config_path(self, argv: list[str]) -> str | None:
        for i, token in enumerate(argv):
            if token == "--":
                break
            if token == "--config" and i + 1 < len(argv):
                return argv[i + 1]
            if token.startswith("--config="):
                return token.split("=", 1)[1]
        if self.env_prefix and env_name("config", self.env_prefix) in os.environ:
            return os.environ[env_name("config", self.env_prefix)]
        return None

    def _apply_config_file(self, path: str) -> None:
        import tomllib

        try:
            with open(path, "rb") as fh:
                data = tomllib.load(fh)
        except OSError as exc:
            self.error(f"--config {path}: {exc.strerror}")
        except tomllib.TOMLDecodeError as exc:
            self.error(f"--config {path}: not TOML ({exc})")
        options = self._options()
        from mdgan.renames import renamed_settings, setting_key

        renamed_settings({k.replace("-", "_"): v for k, v in data.items()})  # (a setting given twice: refused)
        for key, value in data.items():
            dest = setting_key(key.replace("-", "_"))  # (an old name: its new; --algorithm's type takes old values)
            action = options.get(dest)
            where = f"--config {path}: {key} = {value!r}"
            if action is None:
                self.error(f"--config {path}: unknown key {key!r}: not an option of {self.prog} (see --help)")
            if action.nargs == 0:  # a switch (store_true, --flag/--no-flag): the key names the option's dest
                if not isinstance(value, bool):
                    self.error(f"{where}: true or false")
                action.default = value
            else:
                many = isinstance(action, argparse._AppendAction) or action.nargs in ("*", "+")
                values = value if isinstance(value, list) else [value]
                if isinstance(value, (dict, bool)) or (isinstance(value, list) and not many) \
                        or any(isinstance(v, (dict, list, bool)) for v in values):
                    self.error(f"{where}: a {'list of values' if many else 'single value'} is expected")
                try:
                    converted = [self._get_value(action, str(v)) for v in values]
                except argparse.ArgumentError as exc:
                    self.error(f"{where}: {exc.message}")
                if action.choices is not None and any(c not in action.choices for c in converted):
                    self.error(f"{where}: choose from {', '.join(map(str, action.choices))}")
                action.default = converted if many else converted[0]
            self.config_dests.add(dest)

    def _print_config(self, namespace: argparse.Namespace) -> None:
        """Every setting as TOML (what --config takes); unset ones as comments."""
        from mdgan.settings import resolved

        values = {dest: getattr(namespace, dest, None) for dest in self._options()}
        worked_out = {k: v for k, v in resolved(values).items() if values[k] is None and v is not None}
        text = settings_toml(values, f"{self.prog}: every setting, as it would run (flag > variable > --config > "
                                     f"default)", worked_out)
        try:
            print(text, end="", flush=True)
        except BrokenPipeError:  # (| head): the reader has what it wanted
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())

    def _apply_environment(self) -> None:
        if self.env_prefix is None:
            return
        for action in self._actions:
            if not action.option_strings or isinstance(action, (argparse._HelpAction, argparse._VersionAction)) \
                    or getattr(action, "_env_applied", False):
                continue
            action._env_applied = True
            name = env_name(action.dest, self.env_prefix)
            action.help = f"{action.help or ''}{_shown_default(action)} [env {name}]".strip()
            old = [o for o, n in RENAMED_SETTINGS.items() if n == action.dest]
            if not os.environ.get(name) and old and os.environ.get(env_name(old[0], self.env_prefix)):
                from mdgan.renames import setting_key

                setting_key(old[0])  # (a variable of the old name: said once)
                name = env_name(old[0], self.env_prefix)
            if not os.environ.get(name):  # unset, or set empty (a compose file's ${VAR:-}): the default
                continue
            raw = os.environ[name]
            if action.nargs == 0:  # a switch (store_true, store_false, --flag/--no-flag)
                lowered = raw.strip().lower()
                if lowered not in _TRUE | _FALSE:
                    self.error(f"{name}={raw!r}: expected one of {sorted(_TRUE | _FALSE)}")
                if isinstance(action, argparse.BooleanOptionalAction):  # --flag / --no-flag: the value it says
                    action.default = lowered in _TRUE
                else:  # store_true: a true value sets it; store_false: a true value clears it
                    action.default = (lowered in _TRUE) == isinstance(action, argparse._StoreTrueAction)
            else:
                action.default = raw  # argparse applies `type` to a string default (not `choices`: below)
                action._env_raw = raw

    def _check_environment_choices(self, namespace: argparse.Namespace) -> None:
        """argparse checks the choices of a value on the command line only; a variable's value that
        the command line did not override is checked here, before anything starts with it."""
        for action in self._actions:
            raw = getattr(action, "_env_raw", None)
            if raw is None or action.choices is None:
                continue
            if getattr(namespace, action.dest, None) not in action.choices:
                self.error(f"{env_name(action.dest, self.env_prefix)}={raw!r}: invalid choice (choose from "
                           f"{', '.join(map(repr, action.choices))})")

    def _get_value(self, action, arg_string):
        try:
            return super()._get_value(action, arg_string)
        except argparse.ArgumentError as exc:
            # the variable's own string (the same object), not a flag's: name the variable
            if arg_string is getattr(action, "_env_raw", None):
                self.error(f"{env_name(action.dest, self.env_prefix)}={arg_string!r}: {exc.message}")
            raise

    def parse_known_args(self, args=None, namespace=None):
        if "--config" in self._option_string_actions:
            path = self._config_path(sys.argv[1:] if args is None else list(args))
            if path:
                self._apply_config_file(path)
        self._apply_environment()
        namespace, extras = super().parse_known_args(args, namespace)
        self._check_environment_choices(namespace)
        if getattr(namespace, "print_config", False):
            self._print_config(namespace)
            self.exit(0)
        return namespace, extras

    def format_help(self) -> str:
        self._apply_environment()
        return super().format_help()


def add_algorithm_argument(parser, choices: tuple[str, ...]) -> None:
    """--algorithm, offering `choices` (every algorithm, or those the services run), from the registry."""
    from mdgan.algorithms import ALGORITHMS
    from mdgan.renames import canonical

    parser.add_argument("--algorithm", choices=choices, default="mdgan", type=canonical,  # (an old name: its new)
                        help="; ".join(f"{name}: {ALGORITHMS[name].title}" for name in choices)
                        + " (docs/ALGORITHMS.md)")


def add_algorithm_options(parser: argparse.ArgumentParser) -> None:
    """Every algorithm's own options, made from its options dataclass (mdgan/algorithms/*: each field
    names its flag), a group per algorithm: defined once for the command line and the services."""
    from mdgan.algorithms import ALGORITHMS
    from mdgan.algorithms.base import option_key

    for entry in ALGORITHMS.values():
        if entry.options is None:
            continue
        group = parser.add_argument_group(f"{entry.title} (--algorithm {entry.name})")
        for field in dataclasses.fields(entry.options):
            meta = dict(field.metadata)
            flag, help_text = meta.pop("flag"), meta.pop("help")
            meta.pop("short")
            meta.setdefault("type", type(field.default))
            old = [f"--{o.replace('_', '-')}" for o, n in RENAMED_SETTINGS.items() if option_key(field) == n]
            group.add_argument(flag, *old, default=field.default, help=f"{entry.name}: {help_text}",
                               action=_RenamedFlag if old else "store", **meta)


class _RenamedFlag(argparse._StoreAction):
    """A flag that also answers to its old name, which says once that it is deprecated."""

    def __call__(self, parser, namespace, values, option_string=None):
        if option_string is not None and option_string != self.option_strings[0]:
            from mdgan.renames import setting_key

            setting_key(option_string.lstrip("-").replace("-", "_"))  # (said once)
        setattr(namespace, self.dest, values)


def algorithm_options(name: str, args: argparse.Namespace, config: TrainingConfig | None = None, *,
                      alone: bool = True):
    """The options of algorithm `name` from the parsed flags (None: it has none); with `config`,
    checked against the run (one clear line for the first bad one, before anything starts). `alone`:
    the run is of `name` only, so another algorithm's option set away from its default is refused."""
    from mdgan import algorithms

    if alone:
        algorithms.refuse_foreign_options(name, vars(args))
    options = algorithms.get(name).options_from(vars(args))
    return options.check(config) if config is not None and options is not None else options


def algorithm_flags(name: str, args: argparse.Namespace) -> list[str]:
    """The flags that give mdgan-server the options of algorithm `name` as `args` holds them."""
    from mdgan import algorithms
    from mdgan.algorithms.base import option_key

    flags = []
    for field in algorithms.get(name).option_fields():
        value = getattr(args, option_key(field))
        if value is not None:
            flags += [field.metadata["flag"], repr(value) if isinstance(value, float) else str(value)]
    return flags


def add_stop_grace_argument(group) -> None:
    group.add_argument("--stop-grace", type=non_negative_seconds, default=20.0,
                       help="on SIGTERM, how long the server waits for the iteration under way to end and be "
                            "checkpointed (s)")




def setting_type(setting):
    """argparse's `type` for a declared setting: its text parsed and checked by the declaration."""
    def parse(text: str):
        try:
            return setting.parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    parse.__name__ = setting.kind.__name__  # (argparse names the type in some of its messages)
    return parse


def add_setting_arguments(group, keys, **helps: str) -> None:
    """The flags of the declared settings `keys` (mdgan/settings.py) in `group` (a parser or an argument
    group); helps: a command's own help for a key, where it says more than the declaration's."""
    from mdgan.settings import EVERY_SETTING

    for key in keys:
        setting = EVERY_SETTING[key]
        help_text = helps.get(key, setting.help)
        if setting.kind is bool:
            group.add_argument(setting.flag, action=argparse.BooleanOptionalAction, default=setting.default,
                               help=help_text)
        else:
            group.add_argument(setting.flag, type=setting_type(setting), default=setting.default,
                               choices=setting.choices, help=help_text, metavar=METAVARS.get(key))


METAVARS = {"tensorboard": "DIR", "mlflow": "URI"}


def add_setting_groups(parser: argparse.ArgumentParser, keys, **helps: str) -> dict[str, argparse._ArgumentGroup]:
    """The flags of the declared settings `keys`, each in its declared help group; the groups by title."""
    from mdgan.settings import EVERY_SETTING

    groups: dict[str, argparse._ArgumentGroup] = {}
    for key in keys:
        group = EVERY_SETTING[key].group
        if group not in groups:
            groups[group] = parser.add_argument_group(group)
        add_setting_arguments(groups[group], [key], **{k: v for k, v in helps.items() if k == key})
    return groups


def command_settings(command: str, *groups: str) -> list[str]:
    """The run settings (beyond training's) whose flag `command` has (mdgan/settings.py `commands`): simulate,
    local, server or worker; only those of `groups`, when given."""
    from mdgan.settings import RUN_SETTINGS

    return [s.key for s in RUN_SETTINGS if command in s.commands and (not groups or s.group in groups)]


def add_training_arguments(parser: argparse.ArgumentParser) -> None:
    """Every training setting's flag (mdgan/settings.py declares them), in its help group."""
    from mdgan.settings import TRAINING_KEYS

    add_setting_groups(parser, TRAINING_KEYS)


def add_data_arguments(parser: argparse.ArgumentParser) -> None:
    """The data settings' flags (what a worker holds, and a run in one process trains on)."""
    from mdgan.settings import DATA

    add_setting_groups(parser, command_settings("worker", DATA))


def add_site_arguments(parser: argparse.ArgumentParser, launcher: bool) -> None:
    """Flags of runs whose workers bring their own data (mdgan/sites.py)."""
    g = parser.add_argument_group("sites (every worker brings its own data)")
    if launcher:
        g.add_argument("--site-dirs", default=None,
                       help="a folder of site-0, site-1, ... (`mdgan split` writes one): worker i reads only "
                            "SITE_DIRS/site-i, in the --dataset format, instead of a shard of --data-root "
                            "(--workers defaults to the number of sites)")
    g.add_argument("--classes", default=None,
                   help="the run's class names, comma-separated (image folders): each site may hold a subset and "
                        "its labels are mapped to these; default: the first site's classes, and every site must "
                        "have all of them")


def class_names(args: argparse.Namespace) -> tuple[str, ...] | None:
    raw = getattr(args, "classes", None)
    if not raw:
        return None
    from mdgan.images import check_class_names

    names = tuple(n.strip() for n in raw.split(","))
    malformed = check_class_names(names)
    if malformed:
        raise ConfigError(f"--classes must be distinct names separated by commas ({malformed}), got {raw[:200]!r}")
    return names


def add_threads_argument(parser: argparse.ArgumentParser, default: int) -> None:
    parser.add_argument("--threads", type=non_negative_int, default=default,
                        help="torch intra-op threads per process (0: torch's default, one per usable core)")
    parser.add_argument("--device", default="cpu", help="where this process computes: cpu, cuda or cuda:N")


def training_config(args: argparse.Namespace) -> TrainingConfig:
    """The run's TrainingConfig from its parsed flags (mdgan.settings.training_config: the samples' shape
    from --dataset where the command has one, else from --architecture); `args` is left as it is."""
    from mdgan import settings

    return settings.training_config(vars(args), dataset=getattr(args, "dataset", None),
                                    device=getattr(args, "device", "cpu"), classes=class_names(args))


def add_scheduling_argument(parser: argparse.ArgumentParser, default: str) -> None:
    parser.add_argument("--cpu-scheduling", choices=("batch", "normal"), default=default,
                        help="batch: run as SCHED_BATCH with a 10 ms slice, for several services sharing few cores "
                             "(they preempt each other less: about 8%% less CPU per iteration at 10 workers on 2 "
                             "cores; see services/common/scheduling.py); normal: the kernel's defaults")


def add_affinity_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--pin-cpu", type=_cpu_set, default=None, metavar="CPUS",
                        help="keep this process (all its threads) on these CPUs, as `taskset -c CPUS` would: 3, "
                             "0-1 or 0,2-3 (default: wherever the kernel puts it); no more --threads than CPUs, and "
                             "--threads 0 becomes one per CPU; `mdgan local` gives each worker process cores of its "
                             "own this way (see its --pin-workers)")


def _cpu_set(text: str) -> frozenset[int]:
    try:
        return scheduling.parse_cpu_list(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


URI_SCHEMES = ("dns:", "ipv4:", "ipv6:", "unix:", "unix-abstract:", "vsock:")  # gRPC's own target forms


def _host_port(text: str, lowest_port: int) -> str:
    if text.startswith(URI_SCHEMES):
        return text  # gRPC parses its own forms, and says what is wrong with them
    host, colon, port = text.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host  # [IPv6]:PORT
    if not colon or not host or not port.isdigit() or not lowest_port <= int(port) <= 65535:
        raise argparse.ArgumentTypeError(f"HOST:PORT with a port from {lowest_port} to 65535 (or a gRPC target "
                                         f"such as dns:///HOST:PORT), got {text!r}")
    return text


def listen_address(text: str) -> str:
    """--listen: HOST:PORT to bind (port 0: any free one)."""
    return _host_port(text, 0)


def dial_address(text: str) -> str:
    """--server: HOST:PORT to connect to, or one of gRPC's target forms."""
    return _host_port(text, 1)


def port_number(text: str) -> int:
    return _whole_number(text, 0, 65535, "a port from 0 to 65535")


def served_port(text: str) -> int:
    """A port others connect to (a kit's /metrics): 1 to 65535."""
    return _whole_number(text, 1, 65535, "a port from 1 to 65535")


CERTIFICATE_DAYS = 36_500  # a certificate's longest validity: a hundred years (X.509 dates end in 9999)


def certificate_days(text: str) -> int:
    """--days: how long a certificate is valid, 1 day to a hundred years."""
    return _whole_number(text, 1, CERTIFICATE_DAYS, f"a number of days from 1 to {CERTIFICATE_DAYS:,}")


def log_level(text: str) -> str:
    level = text.upper()
    if level not in ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"):
        raise argparse.ArgumentTypeError(f"one of debug, info, warning, error, critical, got {text!r}")
    return level


def positive_seconds(text: str) -> float:
    """A duration flag: a finite number of seconds above 0 (0 or less would time out at once)."""
    seconds = _finite(text)
    if seconds <= 0:
        raise argparse.ArgumentTypeError(f"a number of seconds above 0, got {text!r}")
    return seconds


def non_negative_seconds(text: str) -> float:
    seconds = _finite(text)
    if seconds < 0:
        raise argparse.ArgumentTypeError(f"a number of seconds, 0 or more, got {text!r}")
    return seconds


def _finite(text: str) -> float:
    try:
        number = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a number of seconds, got {text!r}") from None
    if not math.isfinite(number):
        raise argparse.ArgumentTypeError(f"a finite number of seconds, got {text!r}")
    return number


def non_negative_int(text: str) -> int:
    return _whole_number(text, 0, None, "must be >= 0")


def positive_int(text: str) -> int:
    return _whole_number(text, 1, None, "must be at least 1")


def _whole_number(text: str, low: int, high: int | None, expected: str) -> int:
    try:
        number = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a whole number, got {text!r}") from None
    if number < low or (high is not None and number > high):
        raise argparse.ArgumentTypeError(f"{expected}, got {number}")
    return number


def data_config(args: argparse.Namespace, num_shards: int) -> DataConfig:
    return DataConfig(args.dataset, args.data_root, num_shards, args.split_seed,
                      split=args.split, dirichlet_alpha=args.dirichlet_alpha,
                      max_samples=getattr(args, "max_samples", 0)).validate()


def configure_compute(threads: int, pinned_cpus=None) -> None:
    """What every process that trains sets once, before its first step: torch's threads (0: torch's
    default; in a process kept on `pinned_cpus`, one per CPU, and no more than that: a ConfigError)
    and the allocator's thresholds (services/common/allocator.py). `simulate`, `experiment` and each service of
    `mdgan local` set the same, so their figures compare."""
    import torch

    threads = scheduling.check_threads_fit(threads, pinned_cpus)
    if threads > 0:
        torch.set_num_threads(threads)
    allocator.keep_freed_memory()
