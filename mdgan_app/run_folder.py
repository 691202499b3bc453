"""A run folder's bookkeeping on the command line's side: one command at a time in a folder (its lock),
and the settings it was launched with (RUN/launch.toml, a --config file), which `--resume` takes again."""

from __future__ import annotations

import contextlib
import fcntl
import os
import sys

from mdgan.config import ConfigError

RUN_DIR_LOCK = ".mdgan.lock"


@contextlib.contextmanager
def run_dir_lock(out: str, command: str):
    """Keep `out` ours while a run writes there: a second `mdgan local` or `simulate` in the same
    folder would remove the first's logs and overwrite its history, summary and checkpoints."""
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, RUN_DIR_LOCK), "a+") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            fh.seek(0)
            holder = fh.read().strip() or "another process"
            raise ConfigError(f"--out {out}: a run is under way there ({holder}); wait for it to end, or choose "
                              f"another --out") from None
        fh.seek(0)
        fh.truncate()
        fh.write(f"mdgan {command}, pid {os.getpid()}")
        fh.flush()
        yield  # (the lock goes with the file's closing, or the process's death)


# `mdgan local`'s or `simulate`'s settings of the run in a folder, for --resume: a --config file (TOML)
LAUNCH_FILE = "launch.toml"
OLD_LAUNCH_FILE = "launch.json"  # what mdgan wrote before: still read
_NOT_LAUNCH_SETTINGS = {"command", "func", "given", "out", "resume", "run_id"}
_PATH_SETTINGS = ("data_root", "site_dirs")  # saved absolute: a resume may start from another folder


def save_launch_settings(args) -> None:
    """RUN/launch.toml: every setting of this `mdgan local` or `simulate` but where it writes and whether
    it resumes, as a --config file (`mdgan local --config RUN/launch.toml --out ELSEWHERE` runs it again)."""
    from mdgan import settings as declared
    from mdgan.checkpoint import atomic_write_bytes
    from services.common.settings import settings_toml

    # a setting worked out from the others is kept as what it came to (a resume trains the same run)
    settings = {key: value for key, value in sorted(declared.resolved(vars(args)).items())
                if key not in _NOT_LAUNCH_SETTINGS and key not in ("config", "print_config")}
    for key in _PATH_SETTINGS:
        if settings.get(key):
            settings[key] = os.path.abspath(settings[key])
    text = settings_toml(settings, f"mdgan {args.command}: the settings this run was launched with (--resume "
                                   f"takes them again; --config takes this file)")
    atomic_write_bytes(os.path.join(args.out, LAUNCH_FILE), text.encode())


def _read_launch_settings(args) -> tuple[dict, str]:
    """(the run's launch settings keyed like args, the file's name): launch.toml, or an older mdgan's
    launch.json, or none (an older mdgan still: its training settings are the run's own)."""
    import tomllib

    from mdgan.checkpoint import read_json

    toml_path = os.path.join(args.resume, LAUNCH_FILE)
    try:
        with open(toml_path, "rb") as fh:
            return {key.replace("-", "_"): value for key, value in tomllib.load(fh).items()}, LAUNCH_FILE
    except FileNotFoundError:
        pass
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"--resume {args.resume}: {LAUNCH_FILE} is unreadable: {exc}") from None
    try:
        return read_json(os.path.join(args.resume, OLD_LAUNCH_FILE)), OLD_LAUNCH_FILE
    except FileNotFoundError:
        print(f"mdgan {args.command}: {args.resume} has no {LAUNCH_FILE} (an older mdgan launched it): its training "
              "settings are its own, the others (data, evaluation, checkpoints) this command's", file=sys.stderr)
        return {}, LAUNCH_FILE
    except (OSError, ValueError) as exc:
        raise ConfigError(f"--resume {args.resume}: {OLD_LAUNCH_FILE} is unreadable: {exc}") from None


def _check_launch_setting(args, key: str, value, name: str = LAUNCH_FILE) -> None:
    """A saved setting must be of its option's kind (an edited launch file): a number where a number
    is, and so on; what it may be beyond that, the checks of a fresh launch say."""
    default = getattr(args, key)
    if default is None or value is None:
        return

    def kind(v) -> str:  # (an int default may stand for a float option: numbers are one kind)
        return "bool" if isinstance(v, bool) else "number" if isinstance(v, (int, float)) else type(v).__name__

    if kind(value) != kind(default):
        raise ConfigError(f"--resume {args.resume}: {name}: {key} is {value!r}, not a "
                          f"{kind(default)} like its option's (edit it, or give --{key.replace('_', '-')})")


def take_launch_settings(args) -> None:
    """--resume RUN: the run goes on as it was launched (its data, split, evaluation, checkpoints,
    timeouts, security...), but for what this command gives (a moved --data-root, --threads, ...).
    Before, only its workers and iterations were taken: a run of synthetic data or another data root
    resumed with the defaults' data (or failed), and without --checkpoint-every never checkpointed again."""
    from mdgan.checkpoint import RUN_FILE, CheckpointError, read_identity

    args.out = args.resume
    try:
        saved = read_identity(args.resume)
    except FileNotFoundError:
        raise ConfigError(f"--resume {args.resume}: no run to resume there (no {RUN_FILE})") from None
    except CheckpointError as exc:
        raise ConfigError(f"--resume {args.resume}: {exc}") from None
    launched, name = _read_launch_settings(args)
    if not isinstance(launched, dict):
        raise ConfigError(f"--resume {args.resume}: {name} holds no settings (a JSON object is expected)")
    from mdgan.renames import renamed_settings

    launched = renamed_settings(launched)  # (an older mdgan's keys: their names now)
    if launched:  # a setting newer than the file: what the run did before it existed
        from mdgan.settings import before_values

        launched = {**before_values(), **launched}
    given = getattr(args, "given", set())
    for key, value in launched.items():
        if key not in given and key not in _NOT_LAUNCH_SETTINGS and hasattr(args, key):
            _check_launch_setting(args, key, value, name)
            setattr(args, key, value)
    for key in ("workers", "iterations"):  # the run's own: its checkpoints are of that many
        if key in given and getattr(args, key) != saved["config"][key]:
            raise ConfigError(f"--resume {args.resume}: the run has {key} {saved['config'][key]}; --{key} "
                              f"{getattr(args, key)} cannot change it (start a new run with --out elsewhere)")
        setattr(args, key, saved["config"][key])

