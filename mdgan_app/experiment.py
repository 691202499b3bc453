"""`mdgan experiment CONFIG`: run a grid of trainings and plot the paper's figures.

A config (YAML) names a base setting, a grid of values to vary and, optionally, explicit extra runs:

    name: figure3-mnist-mlp
    out: runs/figure3-mnist-mlp
    base: {dataset: mnist, data_root: ../shared/data, iterations: 50000, eval_every: 1000, seed: 0}
    grid:                      # every combination of these
      algorithm: [mdgan]
      workers: [10]
      kappa: [1, log2]         # log2: floor(log2 N), the paper's second setting
    runs:                      # plus these, one by one (base + grid keys they don't set)
      - {algorithm: standalone, batch_size: 10}
      - {algorithm: standalone, batch_size: 100}
    plot: curves               # scores against iterations (Figures 3 and 5), bands (the runs sharing a
                               # label, over seeds: mean +- std, and bands.csv), or
                               # final-vs-workers (Figure 4: final scores against N)

`base_from: OTHER.yaml` (beside this file) starts the base from that config's (its own base_from applied):
this file's base then sets only what differs, e.g. a second seed of an experiment is
`base_from: privacy-levers-mlp.yaml` with `base: {seed: 1}`. A file with neither runs nor grid runs that
config's runs (and grid) at its own base; a file without plot takes that config's.

Run keys: algorithm; every training setting, named as its flag (workers, batch_size, ..., the full list
in mdgan/settings.py), with the same defaults as on the command line; swap_every also "never" (no
swap); each algorithm's own options (potential_rounds, ps_threshold, swap_lag, ...); and an
experiment's own: dataset, data_root, split, dirichlet_alpha, eval_every, eval_samples, eval_reference,
eval_large_every and eval_large_samples (scores on that many images too, every so many iterations and
at the end: fid_large, mnist_score_large), checkpoint_every (durable algorithms: a stopped run resumes
from its last checkpoint), save_discriminators (for `mdgan audit`), eval_downstream (> 0: the final generator's downstream accuracy, mdgan score
--downstream, on that many generated images), device (cpu, cuda), crash ("every
I/N": one worker fails every I/N iterations, the paper's crash experiment), byzantine and attack
(docs/GUIDE.md), label (the curve's name), series (final-vs-workers: the line(s) a run belongs to, a
name or a list; default: its name without N).

Every run is an ordinary run directory under OUT/runs/; a run whose summary.json exists is not run
again, so an interrupted experiment resumes where it stopped (its label and series may change in
between, any other setting may not). Results: OUT/results.csv (one row per
evaluation of every run), OUT/runs.csv (one row per finished run: its last scores, payload bytes per
iteration by direction as the run counted them, seconds per iteration, wall time) and OUT/*.png.

`--keep DIR` makes an experiment outlive its machine: every finished run's record (run.json,
summary.json, the history's evaluation lines, samples.png) and the tables and plots are copied into
DIR (a folder kept under version control, say), and a run finished in DIR is put back into OUT and
not run again. Days of runs then add up across machines that keep nothing but DIR.

`--time-limit SECONDS` (mdgan_app/run_budget.py) makes it end within SECONDS, for a machine held for minutes:
each unfinished run's first --probe iterations are timed, only the runs expected to end in time start (shortest
first), and those under way when the time is up stop; with --keep, what finished is kept for the next start.
"""

from __future__ import annotations

import contextlib
import csv
import itertools
import json
import math
import multiprocessing
import os
import re
import signal
import sys
import threading
import warnings
from dataclasses import dataclass

import yaml
from tqdm import tqdm

from services.common import scheduling
from mdgan import algorithms
from mdgan.algorithms import ALGORITHMS
from mdgan.algorithms.base import option_key
from mdgan import settings
from mdgan.config import ConfigError, TrainingConfig
from mdgan.run_spec import RunSpec
from mdgan_app import run_budget

# An experiment's keys: every declared setting an experiment takes (mdgan/settings.py), with its default, and these
# of its own: crash ("every I/N": the paper's crash experiment), label and series (plots), device
DEFAULTS = {
    "algorithm": "mdgan", **{s.key: s.default for s in settings.EVERY_SETTING.values() if s.experiment},
    "crash": None, "label": None, "series": None, "device": "cpu",
}
# every algorithm's own options (mdgan/algorithms/*: P-WGAN's T, the parameter-server GAN's Q, ...), with their defaults
OPTION_FIELDS = [f for entry in ALGORITHMS.values() for f in entry.option_fields()]
DEFAULTS.update({option_key(f): f.default for f in OPTION_FIELDS})
OPTIONS = {option_key(f): f for f in OPTION_FIELDS}
# the keys that name a run (in this order) when they differ between runs
NAME_KEYS = ("algorithm", "workers", "batch_size", "kappa", "disc_steps", "swap_every", "swap_epochs",
             "swap_optimizer_state", "crash",
             "architecture", "gan", "loss", "disc_width", "split", "iterations", "wire_dtype", "aggregation",
             "trim_fraction",
             "clip_norm", "byzantine", "attack", "sync", "quorum", "max_staleness", "dp_noise_multiplier",
             "dp_target_epsilon", "dp_max_grad_norm", "dp_delta", "dp_mechanism", "dp_discriminators",
             "dp_clip_generated", "dp_fixed_noise", *(option_key(f) for f in OPTION_FIELDS), "gen_lr", "disc_lr",
             "beta1", "beta2", "seed")
# a setting declared later with a short name names runs too, after these (the names of kept runs stay as they are)
NAME_KEYS += tuple(s.key for s in settings.EVERY_SETTING.values() if s.short is not None and s.key not in NAME_KEYS)
SHORT = {"algorithm": "", "crash": "crash",
         **{s.key: s.short for s in settings.EVERY_SETTING.values() if s.short is not None},
         **{option_key(f): f.metadata["short"] for f in OPTION_FIELDS}}


# curves: each run's scores against iterations (Figures 3 and 5); bands: the runs that share a label (the
# same setting over several seeds) as their mean with a band of +- one standard deviation, and bands.csv;
# final-vs-workers: final scores against N (Figure 4)
PLOTS = ("curves", "bands", "final-vs-workers")


def band_rows(rows: list[dict], runs: list[dict]) -> list[dict]:
    """Per label and evaluated iteration: how many seeds, and the mean and standard deviation (n - 1) of
    each score over them: the tables of a multi-seed experiment."""
    import statistics

    out = []
    for label in dict.fromkeys(run["label"] for run in runs):
        names = {run["name"] for run in runs if run["label"] == label}
        mine = [r for r in rows if r["run"] in names]
        for iteration in sorted({r["iteration"] for r in mine}):
            at = [r for r in mine if r["iteration"] == iteration]
            row = {"label": label, "iteration": iteration, "seeds": len(at)}
            for metric in ("mnist_score", "fid", "mnist_score_large", "fid_large"):
                values = [r[metric] for r in at if r.get(metric) is not None]
                row[f"{metric}_mean"] = statistics.fmean(values) if values else None
                row[f"{metric}_std"] = statistics.stdev(values) if len(values) > 1 else (0.0 if values else None)
                row[f"{metric}_values"] = " ".join(f"{v:.4g}" for v in values)
            out.append(row)
    return out


def load_config(path: str, _including: tuple[str, ...] = ()) -> dict:
    """The config at path, its base completed from its base_from's (and its runs, grid and plot, where it sets
    none)."""
    try:
        with open(path, encoding="utf-8") as fh:
            config = yaml.safe_load(fh) or {}
    except OSError as exc:
        raise ConfigError(f"{_including[-1] + ': base_from ' if _including else ''}{path}: {exc.strerror}") from exc
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""
        raise ConfigError(f"{path}: not YAML{where}: {getattr(exc, 'problem', None) or exc}") from exc
    if not isinstance(config, dict):
        raise ConfigError(f"{path}: an experiment config is a mapping (name, out, base, grid, runs, plot)")
    unknown = set(config) - {"name", "out", "base", "base_from", "grid", "runs", "plot"}
    if unknown:
        raise ConfigError(f"{path}: unknown keys {sorted(unknown)}")
    _check_shape(config, path)
    if config.get("base_from") is not None:
        parent = os.path.join(os.path.dirname(path), str(config["base_from"]))
        chain = (*_including, path)
        if os.path.realpath(parent) in {os.path.realpath(p) for p in chain}:
            raise ConfigError(f"{path}: base_from {config['base_from']} comes back to itself "
                              f"({' -> '.join(os.path.basename(p) for p in (*chain, parent))})")
        inherited = load_config(parent, chain)
        config["base"] = {**_keys(inherited.get("base")), **_keys(config.get("base"))}
        if "runs" not in config and "grid" not in config:  # the same runs at other base settings
            config["runs"], config["grid"] = inherited.get("runs"), inherited.get("grid")
        config.setdefault("plot", inherited["plot"])
    config.setdefault("name", os.path.splitext(os.path.basename(path))[0])
    config.setdefault("out", os.path.join("runs", config["name"]))
    config.setdefault("plot", "curves")
    if config["plot"] not in PLOTS:
        raise ConfigError(f"{path}: plot must be one of {', '.join(PLOTS)}")
    return config


def _check_shape(config: dict, path: str) -> None:
    """Each key of a config holds what it must: one clear line for the first that does not."""
    for key in ("name", "out", "base_from", "plot"):
        if config.get(key) is not None and not (isinstance(config[key], str) and config[key].strip()):
            raise ConfigError(f"{path}: {key} must be a text, not {config[key]!r}")
    for key, example in (("base", "{workers: 10, iterations: 5000}"), ("grid", "{workers: [2, 10]}")):
        if config.get(key) is not None and not isinstance(config[key], dict):
            raise ConfigError(f"{path}: {key} must be a mapping of settings, like {example}; not {config[key]!r}")
    for key, values in (config.get("grid") or {}).items():
        if isinstance(values, list) and not values:
            raise ConfigError(f"{path}: grid {key} has no values")
        if isinstance(values, dict):
            raise ConfigError(f"{path}: grid {key} must be a value or a list of values, not a mapping")
    runs = config.get("runs")
    if runs is not None and not (isinstance(runs, list) and all(isinstance(run, dict) for run in runs)):
        raise ConfigError(f"{path}: runs must be a list of mappings of settings, like "
                          "[{algorithm: standalone, batch_size: 10}]; not " + repr(runs))


def _keys(settings: dict | None) -> dict:
    """A run's settings with the flags' names accepted too (batch-size as batch_size), as in --config, and
    renamed ones under their new names (algorithms.renamed_settings)."""
    return algorithms.renamed_settings({str(k).replace("-", "_"): v for k, v in (settings or {}).items()})


def expand(config: dict) -> list[dict]:
    """Every run of the experiment, as complete settings (keys: the flags' names, with - or _)."""
    base = {**DEFAULTS, **_keys(config.get("base"))}
    grid = _keys(config.get("grid"))
    runs = []
    keys = list(grid)
    for values in itertools.product(*(grid[k] if isinstance(grid[k], list) else [grid[k]] for k in keys)):
        if keys:
            runs.append({**base, **dict(zip(keys, values))})
    for extra in config.get("runs") or []:
        runs.append({**base, **_keys(extra)})
    if not runs:
        raise ConfigError("the experiment has no runs: give `runs` a list of runs' settings, like "
                          "[{algorithm: standalone}], or `grid` settings to vary, like {workers: [2, 10]}")
    for run in runs:
        unknown = set(run) - set(DEFAULTS)
        if unknown:
            raise ConfigError(f"unknown run keys {sorted(unknown)}")
        _check_types(run)
        if run["kappa"] == "log2":
            run["kappa"] = max(1, int(math.log2(run["workers"])))
        algorithms.refuse_foreign_options(run["algorithm"], run)
        if algorithms.get(run["algorithm"]).whole_dataset:  # one G and one D on the whole dataset
            run["workers"], run["kappa"] = 1, 1
    varying = [k for k in NAME_KEYS if len({json.dumps(r[k]) for r in runs}) > 1]
    for run in runs:
        name = "-".join(f"{SHORT[k]}{run[k]}" for k in varying if run[k] is not None) or "run"
        run["name"] = re.sub(r"[^A-Za-z0-9_.-]+", "", name.replace("every I/N", "IoverN"))  # a folder name
        run["label"] = run["label"] or run["name"]
        run["series"] = run["series"] or "-".join(
            f"{SHORT[k]}{run[k]}" for k in varying if k != "workers" and run[k] is not None) or run["algorithm"]
    names = [r["name"] for r in runs]
    if len(set(names)) != len(names):
        raise ConfigError(f"two runs of the experiment are the same: {sorted(n for n in names if names.count(n) > 1)}")
    return [settings.resolved(run) for run in runs]  # (named by what was given; recorded as they train)


# words some keys take besides a value of their type
SPELLINGS = {"kappa": ("log2",), "swap_every": ("never",)}


@dataclass(frozen=True)
class KeyType:
    """What a run's key takes: a value of `kind` (None too where optional), or one of `choices`' values."""

    kind: type
    optional: bool
    choices: tuple | None = None


def _key_type(key: str) -> KeyType:
    """From the key's declaration: a setting's (mdgan/settings.py), an algorithm's option's, else the
    experiment's own default (None: a text or nothing)."""
    setting, option = settings.EVERY_SETTING.get(key), OPTIONS.get(key)
    if setting is not None:
        return KeyType(setting.kind, setting.optional or key == "swap_every", setting.choices)
    if option is not None:
        return KeyType(option.metadata.get("type", type(option.default)), option.default is None,
                       option.metadata.get("choices"))
    default = DEFAULTS[key]
    return KeyType(str if default is None else type(default), default is None)


def _fits(value, kind: type) -> bool:
    if kind is bool:
        return isinstance(value, bool)
    if kind in (int, float):
        return isinstance(value, int if kind is int else (int, float)) and not isinstance(value, bool)
    return isinstance(value, str)


def _check_types(run: dict) -> None:
    """Every value of a run of the type its key takes (a whole number where the flag takes one, true or false for a
    switch, one of the choices): one clear line for the first that is not. A number written as YAML reads it as a
    text (1e-4) is taken as the number."""
    for key, value in list(run.items()):
        takes = _key_type(key)
        if (value is None and takes.optional) or value in SPELLINGS.get(key, ()):
            continue
        if key == "series" and isinstance(value, list) and all(isinstance(v, str) for v in value):
            continue
        if takes.kind is float and isinstance(value, str):  # (YAML reads 1e-4, without a dot, as a text)
            with contextlib.suppress(ValueError):
                value = run[key] = float(value)
        if not _fits(value, takes.kind):
            also = "".join(f" or {w!r}" for w in SPELLINGS.get(key, ())) + (" or null" if takes.optional else "")
            raise ConfigError(f"{key} must be {settings.KIND_WORDS[takes.kind]}{also}, not {value!r}")
        if takes.choices is not None and value not in takes.choices:
            raise ConfigError(f"{key} must be one of {', '.join(map(str, takes.choices))}, not {value!r}")


def run_spec(run: dict, first: int | None = None, score_first: bool = False) -> RunSpec:
    """A run's RunSpec (mdgan/run_spec.py), validated: what it trains and everything it would refuse."""
    return RunSpec.from_values(run, first, score_first).validate()


def training_config(run: dict) -> TrainingConfig:
    """A run's TrainingConfig as it trains."""
    return RunSpec.from_values(run).config


def validate_runs(runs: list[dict]) -> None:
    """Every run's spec, validated before the experiment writes anything: one line naming the run and its
    setting for the first that would be refused."""
    for run in runs:
        try:
            run_spec(run)
        except ConfigError as exc:
            raise ConfigError(f"run {run['name']}: {exc}") from None


def run_one(run: dict, out_dir: str, progress: bool, first: int | None = None, score_first: bool = False) -> dict:
    """The run in this process. first: only its first this many iterations, as the whole run trains them
    (its rounds and crash schedule are the whole run's), without checkpoints or saved discriminators, and
    unscored unless score_first: what experiments/replay.py and experiments/first_evaluation.py compare
    with a kept run."""
    from mdgan.simulation import train

    spec = RunSpec.from_values(run, first, score_first)  # (train validates it)
    summary = train(spec, out_dir, progress=progress)
    if spec.downstream:
        summary = _score_downstream(run, out_dir, summary)
    return summary


def _score_downstream(run: dict, out_dir: str, summary: dict) -> dict:
    """eval_downstream: the run's final generator's downstream accuracy (mdgan/downstream.py) on that many
    generated images, into its summary's scores."""
    from mdgan.checkpoint import atomic_write_json
    from mdgan.downstream import downstream_accuracy
    from mdgan.sampling import load_generator

    result = downstream_accuracy(load_generator(out_dir, run["device"]), run["data_root"],
                                 samples=int(run["eval_downstream"]), device=run["device"])
    summary["scores"] = {**(summary.get("scores") or {}), "downstream_accuracy": result.accuracy,
                         "downstream_samples": result.samples}
    atomic_write_json(os.path.join(out_dir, "summary.json"), summary)
    return summary


def collect(runs: list[dict], out: str) -> list[dict]:
    """One row per evaluation of every finished run."""
    rows = []
    for run in runs:
        history = os.path.join(out, "runs", run["name"], "history.jsonl")
        if not os.path.exists(os.path.join(out, "runs", run["name"], "summary.json")):
            continue
        with open(history, encoding="utf-8") as fh:
            for line in fh:
                record = json.loads(line)
                # every evaluation finished since the line before; older histories carry only the newest, flat
                evaluations = record.get("evaluations") or ([record] if "eval_iteration" in record else [])
                for evaluation in evaluations:
                    rows.append({"run": run["name"], "label": run["label"], "algorithm": run["algorithm"],
                                 "workers": run["workers"], "batch_size": run["batch_size"], "kappa": run["kappa"],
                                 "crash": run["crash"] or "", "swap_every": run["swap_every"] or "",
                                 "wire_dtype": run["wire_dtype"], "aggregation": run["aggregation"],
                                 "attack": f"{run['byzantine']}x {run['attack']}" if run["attack"] and run["byzantine"]
                                 else "", "seed": run["seed"],
                                 "iteration": evaluation["eval_iteration"], "mnist_score": evaluation.get("mnist_score"),
                                 "fid": evaluation.get("fid"), "active_workers": record.get("active_workers"),
                                 "large_samples": evaluation.get("large_samples"),
                                 "mnist_score_large": evaluation.get("mnist_score_large"),
                                 "fid_large": evaluation.get("fid_large")})
    return rows


def summarize(runs: list[dict], out: str) -> list[dict]:
    """One row per finished run: what a comparison table needs (docs/RESULTS.md)."""
    rows = []
    for run in runs:
        path = os.path.join(out, "runs", run["name"], "summary.json")
        if not os.path.exists(path):
            continue
        with open(path, encoding="utf-8") as fh:
            summary = json.load(fh)
        iterations = max(1, summary["iterations"])
        scores = summary.get("scores") or {}
        payload = summary.get("payload_bytes") or {}
        rows.append({"run": run["name"], "label": run["label"], "algorithm": run["algorithm"],
                     "workers": summary["workers"], "batch_size": run["batch_size"], "iterations": summary["iterations"],
                     "eval_iteration": scores.get("eval_iteration"), "mnist_score": scores.get("mnist_score"),
                     "fid": scores.get("fid"),
                     **{f"{d}_bytes_per_iteration": payload.get(d, 0) / iterations
                        for d in ("server_to_worker", "worker_to_server", "worker_to_worker")},
                     "seconds_per_iteration": summary.get("seconds_per_iteration"),
                     "wall_seconds": summary.get("wall_seconds"), "workers_alive": summary.get("workers_alive"),
                     "stopped_early": summary.get("stopped_early") or "",
                     "epsilon": (summary.get("privacy") or {}).get("epsilon_max"),
                     "fid_large": scores.get("fid_large"), "mnist_score_large": scores.get("mnist_score_large"),
                     **({"downstream_accuracy": scores["downstream_accuracy"]} if "downstream_accuracy" in scores
                        else {}),
                     # floating-point results agree bit for bit only on the same kernels (docs/RESULTS.md)
                     **{f"machine_{key}": value for key, value in (summary.get("machine") or {}).items()}})
    return rows


# what `--keep` holds of a finished run: all that collecting, summarizing and plotting it read
KEPT_FILES = ("run.json", "summary.json", "history.jsonl", "samples.png")
KEPT_TABLES = ("results.csv", "runs.csv", "bands.csv", "mnist_score.png", "fid.png", "samples.png")


def _evaluation_lines(history: str) -> bytes:
    """The lines of a history.jsonl that carry evaluations (a 50,000-iteration history is 20 MB, these
    50 kB). Each evaluation gets `train_seconds`: the iterations' wall time up to the one it scored
    (scoring excluded; it runs beside training and is reported a few lines later), for the time it
    takes to reach a score."""
    kept, train_seconds, clock = [], 0.0, {}
    with open(history, encoding="utf-8") as fh:
        for line in fh:
            record = json.loads(line)
            train_seconds += record.get("seconds") or 0.0
            clock[record.get("iteration")] = train_seconds
            if record.get("evaluations") or "eval_iteration" in record:
                # a history kept before (restored from --keep) holds these lines only: its times stand
                evaluations = [{**e, "train_seconds": e["train_seconds"] if "train_seconds" in e
                                else clock.get(e["eval_iteration"])} for e in record.get("evaluations") or []]
                kept.append(json.dumps({**record, "evaluations": evaluations} if evaluations else record) + "\n")
    return "".join(kept).encode()


def _copy_record(source: str, target: str, trim_history: bool = False) -> None:
    """A finished run's record from one run folder to another, summary.json last (it marks the run
    finished); trim_history: only the history's evaluation lines."""
    from mdgan.checkpoint import atomic_write_bytes

    os.makedirs(target, exist_ok=True)
    for name in sorted(KEPT_FILES, key=lambda n: n == "summary.json"):
        path = os.path.join(source, name)
        if not os.path.exists(path):
            continue
        if trim_history and name == "history.jsonl":
            data = _evaluation_lines(path)
        else:
            with open(path, "rb") as fh:
                data = fh.read()
        atomic_write_bytes(os.path.join(target, name), data)


def restore_kept(runs: list[dict], out: str, keep: str) -> list[str]:
    """Puts every run finished in `keep` and not in `out` into `out` (before running: it is not run again).
    A kept run must have the settings the config gives it now."""
    restored = []
    for run in runs:
        kept = os.path.join(keep, "runs", run["name"])
        target = os.path.join(out, "runs", run["name"])
        if not os.path.exists(os.path.join(kept, "summary.json")) or os.path.exists(os.path.join(target, "summary.json")):
            continue
        with open(os.path.join(kept, "run.json"), encoding="utf-8") as fh:
            before = json.load(fh)
        changed = _differing(before, run)
        if changed:
            raise ConfigError(f"{kept} holds a run with other settings ({changed} differ): "
                              "give the experiment another --keep, or delete that run")
        _copy_record(kept, target)
        restored.append(run["name"])
    return restored


def keep_finished(runs: list[dict], out: str, keep: str) -> list[str]:
    """Copies every finished run's record and the experiment's tables and plots from `out` into `keep`."""
    from mdgan.checkpoint import atomic_write_bytes

    kept = []
    for run in runs:
        source = os.path.join(out, "runs", run["name"])
        if not os.path.exists(os.path.join(source, "summary.json")):
            continue
        _copy_record(source, os.path.join(keep, "runs", run["name"]), trim_history=True)
        kept.append(run["name"])
    for name in KEPT_TABLES:
        if os.path.exists(os.path.join(out, name)):
            with open(os.path.join(out, name), "rb") as fh:
                atomic_write_bytes(os.path.join(keep, name), fh.read())
    return kept


def write_csv(rows: list[dict], path: str) -> None:
    if not rows:
        return
    with open(path, "w", newline="", encoding="utf-8") as fh:
        # every row's columns, in order of appearance: runs summarized by older versions lack some
        writer = csv.DictWriter(fh, fieldnames=list(dict.fromkeys(key for row in rows for key in row)))
        writer.writeheader()
        writer.writerows(rows)


def plot(rows: list[dict], runs: list[dict], kind: str, out: str, title: str) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    for metric, better in (("mnist_score", "higher is better"), ("fid", "lower is better")):
        fig, ax = plt.subplots(figsize=(7, 4.5))
        if kind == "bands":
            for label in dict.fromkeys(run["label"] for run in runs):
                points = [(b["iteration"], b[f"{metric}_mean"], b[f"{metric}_std"]) for b in band_rows(rows, runs)
                          if b["label"] == label and b[f"{metric}_mean"] is not None]
                if points:
                    xs, means, stds = zip(*points)
                    seeds = max(b["seeds"] for b in band_rows(rows, runs) if b["label"] == label)
                    line, = ax.plot(xs, means, label=f"{label} ({seeds} seed{'s' if seeds > 1 else ''})")
                    ax.fill_between(xs, [m - s for m, s in zip(means, stds)], [m + s for m, s in zip(means, stds)],
                                    color=line.get_color(), alpha=0.2)
            ax.set_xlabel("iteration")
        elif kind == "curves":
            for run in runs:
                points = sorted((r["iteration"], r[metric]) for r in rows if r["run"] == run["name"]
                                and r[metric] is not None)
                if points:
                    ax.plot(*zip(*points), marker="o", markersize=3, label=run["label"])
            ax.set_xlabel("iteration")
        else:  # final score against the number of workers, one line per setting apart from N
            series: dict[str, list] = {}
            for run in runs:
                final = [r for r in rows if r["run"] == run["name"] and r[metric] is not None]
                if final:
                    last = max(final, key=lambda r: r["iteration"])[metric]
                    for name in run["series"] if isinstance(run["series"], list) else [run["series"]]:
                        series.setdefault(name, []).append((run["workers"], last))
            for key, points in series.items():
                ax.plot(*zip(*sorted(points)), marker="o", label=key)
            ax.set_xlabel("workers N")
        ax.set_ylabel(f"{'MNIST score' if metric == 'mnist_score' else 'FID'} ({better})")
        if metric == "fid":
            ax.set_yscale("log")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        path = os.path.join(out, f"{metric}.png")
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths


def plot_samples(runs: list[dict], out: str, title: str, per_row: int = 4) -> str | None:
    """Every finished run's sample grid (its samples.png), side by side under its label."""
    grids = [(run["label"], os.path.join(out, "runs", run["name"], "samples.png")) for run in runs]
    grids = [(label, path) for label, path in grids if os.path.exists(path)]
    if not grids:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.image
    import matplotlib.pyplot as plt

    columns = min(per_row, len(grids))
    rows = -(-len(grids) // columns)
    fig, axes = plt.subplots(rows, columns, figsize=(3.2 * columns, 3.7 * rows), squeeze=False)
    for ax in axes.flat:
        ax.axis("off")
    for ax, (label, path) in zip(axes.flat, grids):
        ax.imshow(matplotlib.image.imread(path))
        ax.set_title(label, fontsize=9)
    fig.suptitle(f"{title}: samples of the final generators", fontsize=10)
    fig.tight_layout()
    target = os.path.join(out, "samples.png")
    fig.savefig(target, dpi=110)
    plt.close(fig)
    from PIL import Image  # matplotlib's own dependency

    # The samples are grey: 16 grey levels keep a figure of 8 grids near 300 kB (RGBA: 1.2 MB).
    with Image.open(target) as image:
        grey = image.convert("L").quantize(16)
    grey.save(target, optimize=True)
    return target


# how a run is named, drawn or kept, not what it trained: free to change on resume (a name follows from the
# settings that vary in its experiment: the same run may be named otherwise in another experiment)
PRESENTATION_KEYS = ("name", "label", "series", "checkpoint_every", "save_discriminators")


def recorded_run(record: dict) -> dict:
    """A run's complete settings from its run.json: a key it lacks (written before the key existed) had its
    default, or what runs did before the setting existed (mdgan.settings.before_values); old names as new."""
    return {**DEFAULTS, **settings.before_values(), **algorithms.renamed_settings(record)}


def _trained(run: dict) -> dict:
    """What a run trained (a run of `expand`, or a run.json): a derived setting as it was worked out."""
    return {k: v for k, v in settings.resolved(recorded_run(run)).items() if k not in PRESENTATION_KEYS}


def _differing(before: dict, run: dict) -> list[str]:
    """The settings a recorded run (its run.json) trained otherwise than `run` would."""
    old, new = _trained(before), _trained(run)
    return sorted(k for k in old.keys() | new.keys() if old.get(k) != new.get(k))


def _start_child() -> None:
    """A worker process of `run_experiment(jobs > 1)`: Ctrl-C at the terminal reaches the whole
    process group; the parent alone handles it, and stops its children (no traceback from each).
    Stopped (SIGTERM), a child exits as from sys.exit, so multiprocessing's finalizers release what
    it holds (tqdm's lock, a named semaphore) instead of leaving it to the resource tracker."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    # and when the parent dies outright (SIGKILL, the OOM killer), so do we; it may have died while we imported
    scheduling.die_with_parent(multiprocessing.parent_process().pid)
    # what stopping leaves: the coroutine of the training step it cut short, never awaited
    warnings.filterwarnings("ignore", message="coroutine .* was never awaited", category=RuntimeWarning)


_STOPPED: list[int] = []  # a run process's SIGTERM, once it came


def _exit_on_sigterm(signum, frame):
    _STOPPED.append(signum)
    sys.exit(128 + signum)


def _run_in_child(task: tuple[dict, str, int]) -> str:
    """One run in a worker process of `run_experiment(jobs > 1)`: its own torch threads, no progress bar."""
    from services.common.settings import configure_compute

    run, run_dir, threads = task
    configure_compute(threads)
    try:
        run_one(run, run_dir, progress=False)
    except Exception:
        if _STOPPED:  # the SIGTERM's SystemExit, turned into another error on its way (torch.save's writer, say):
            sys.exit(128 + _STOPPED[0])  # the process ends as stopped, never back to wait for work
        raise
    return run["name"]


def _on_device(runs: list[dict], device: str | None) -> list[dict]:
    """The runs with their `device` set to `device` (None: as the experiment says), checked."""
    if device is not None:
        TrainingConfig(device=device).validate()  # a device that is not here: one line, before anything
        runs = [{**run, "device": device} for run in runs]
    return runs


def device_name(device: str) -> str:
    """What computes on `device`: the GPU's name, or the CPU's model and how many cores this process has."""
    import torch

    if device != "cpu":
        return f"{torch.cuda.get_device_name(device)} ({device})"
    model = "CPU"
    try:
        with open("/proc/cpuinfo") as fh:
            model = next((line.split(":", 1)[1].strip() for line in fh if line.startswith("model name")), model)
    except OSError:
        pass
    return f"{model}, {len(scheduling.usable_cpus())} cores, {torch.get_num_threads()} torch threads"


PROBE_WARMUP = 3  # a probe's first iterations, not counted (allocations, CUDA kernels' first launches)


def dry_run(path: str, device: str | None = None, probe: int = 20, jobs: int = 1, on_start=None,
            on_row=None) -> dict:
    """How long each run of the experiment that has not finished would take here: the first `probe`
    iterations of each, trained as the run trains them (in a temporary folder: nothing is written under
    the experiment's `out`), timed after PROBE_WARMUP of them (the median iteration), times the run's
    iterations. Evaluations come on top (each scores eval_samples images every eval_every iterations).
    on_start(report without its runs and totals, the runs' names), then on_row(row) as each run is timed: what a
    person watching sees before the slowest probe ends."""
    check_probe(probe)
    if jobs < 1:
        raise ConfigError(f"jobs must be at least 1, not {jobs}")
    config = load_config(path)
    runs = _on_device(expand(config), device)
    validate_runs(runs)  # every run's settings checked before the first probe
    report = {"experiment": config["name"], "machine": device_name(runs[0]["device"] if runs else "cpu"),
              "probe_iterations": probe, "jobs": jobs}
    if on_start is not None:
        on_start(report, [run["name"] for run in runs])
    rows = []
    for run in runs:
        if os.path.exists(os.path.join(config["out"], "runs", run["name"], "summary.json")):
            rows.append({"name": run["name"], "finished": True})
            if on_row is not None:
                on_row(rows[-1])
            continue
        per_iteration = probe_pace(run, probe)
        rows.append({"name": run["name"], "finished": False, "device": run["device"],
                     "seconds_per_iteration": per_iteration, "iterations": run["iterations"],
                     "expected_seconds": per_iteration * run["iterations"]})
        if on_row is not None:
            on_row(rows[-1])
    todo = [r["expected_seconds"] for r in rows if not r["finished"]]
    return {**report, "runs": rows, "one_at_a_time_seconds": sum(todo),
            # K runs at once finish in about the longest of K queues of the runs, if the device serves K as fast
            # as one; a GPU kept busy by one run serves K slower, which only the runs themselves measure
            "with_jobs_seconds": _longest_queue(todo, jobs)}


def check_probe(probe: int) -> None:
    if probe <= PROBE_WARMUP:
        raise ConfigError(f"--probe must be more than {PROBE_WARMUP} iterations, not {probe}")


def probe_pace(run: dict, probe: int) -> float:
    """A run's seconds an iteration here: its first `probe` iterations trained as the run trains them, in a
    temporary folder, the median iteration after PROBE_WARMUP of them."""
    import statistics
    import tempfile

    with tempfile.TemporaryDirectory(prefix="mdgan-dry-run-") as scratch:
        run_one(run, scratch, progress=False, first=min(probe, run["iterations"]))
        with open(os.path.join(scratch, "history.jsonl"), encoding="utf-8") as fh:
            seconds = [json.loads(line)["seconds"] for line in fh if line.strip()]
    return statistics.median(seconds[PROBE_WARMUP:] or seconds)


def iterations_left(run: dict, run_dir: str) -> int:
    """The iterations a start of this run trains: all, less those of the complete checkpoint it resumes from."""
    from mdgan.checkpoint import CheckpointStore

    folder = os.path.join(run_dir, "checkpoints")
    done = CheckpointStore(folder).latest_complete() if os.path.isdir(folder) else None
    return run["iterations"] - (done or 0)


def _longest_queue(durations: list[float], jobs: int) -> float:
    """When `jobs` workers take the runs in order, each the next as it becomes free: the last one's end."""
    ends = [0.0] * jobs
    for duration in durations:
        ends[ends.index(min(ends))] += duration
    return max(ends, default=0.0)


def format_duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 2 * 3600:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def dry_run_header(report: dict) -> str:
    return (f"{report['experiment']}: expected time on {report['machine']} (each run timed over its first "
            f"{report['probe_iterations']} iterations; evaluations not included)")


def dry_run_row(row: dict, width: int = 24) -> str:
    if row["finished"]:
        return f"  {row['name']:<{width}}  finished"
    return (f"  {row['name']:<{width}}  {row['seconds_per_iteration'] * 1000:8.1f} ms an iteration x "
            f"{row['iterations']:,} = {format_duration(row['expected_seconds'])}")


def dry_run_totals(report: dict) -> str:
    lines = [f"  all: {format_duration(report['one_at_a_time_seconds'])} one run at a time"]
    if report["jobs"] > 1:
        lines.append(f"  with --jobs {report['jobs']}: about {format_duration(report['with_jobs_seconds'])}, if the "
                     f"device serves {report['jobs']} runs at once as fast as one (it serves them slower when one "
                     "run keeps it busy)")
    return "\n".join(lines)


def dry_run_table(report: dict) -> str:
    """The dry run as a person reads it."""
    width = max((len(r["name"]) for r in report["runs"]), default=4)
    return "\n".join([dry_run_header(report), *(dry_run_row(r, width) for r in report["runs"]),
                      dry_run_totals(report)])


def run_experiment(path: str, progress: bool = True, only_plot: bool = False, jobs: int = 1,
                   threads: int = 1, keep: str | None = None, device: str | None = None,
                   time_limit: float | None = None, probe: int = 20, on_plan=None) -> dict:
    """Runs what has not finished, then collects and plots. jobs > 1: that many runs at once, each in
    its own process with `threads` torch threads (runs are independent and deterministic, so the
    results are those of running them one by one; on a GPU they share the card). keep: a folder of
    finished runs' records, read before and written after (and after each run). device: every run's
    (None: each run's own `device`, cpu by default).

    time_limit: the experiment ends within this many seconds (mdgan_app/run_budget.py): each unfinished run's
    first `probe` iterations are timed, a run is started only when it is expected to end in time (shortest
    first), each in a process of its own, and the runs under way when the time is up are stopped (a run with
    checkpoints resumes from its last one). on_plan(expected, started): each run's estimate as it is made. The result's `later` and
    `stopped` name the runs left for another start."""
    if jobs < 1:
        raise ConfigError(f"jobs must be at least 1, not {jobs}")
    if time_limit is not None:
        if not time_limit > 0:
            raise ConfigError(f"--time-limit must be more than 0 seconds, not {time_limit}")
        check_probe(probe)
    deadline = run_budget.Deadline(time_limit) if time_limit is not None else None
    config = load_config(path)
    runs = _on_device(expand(config), device)
    validate_runs(runs)
    out = config["out"]
    for what, folder in ((f"{path}: out", out), ("--keep", keep)):
        if folder and os.path.exists(folder) and not os.path.isdir(folder):
            raise ConfigError(f"{what} {folder} is a file: give a folder (made where there is none)")
    os.makedirs(os.path.join(out, "runs"), exist_ok=True)
    if keep:
        restore_kept(runs, out, keep)
    with open(os.path.join(out, "experiment.json"), "w", encoding="utf-8") as fh:
        json.dump({"config": config, "runs": runs}, fh, indent=2)
    todo = []
    if not only_plot:
        for run in runs:
            run_dir = os.path.join(out, "runs", run["name"])
            record = os.path.join(run_dir, "run.json")
            if os.path.exists(record):
                with open(record, encoding="utf-8") as fh:
                    before = json.load(fh)
                changed = _differing(before, run)
                if changed:
                    raise ConfigError(f"{run_dir} holds a run with other settings ({changed} differ): "
                                      "give the experiment another `out`, or delete that run")
                if os.path.exists(os.path.join(run_dir, "summary.json")):
                    if before != run:  # a new label or series: keep run.json current
                        with open(record, "w", encoding="utf-8") as fh:
                            json.dump(run, fh, indent=2)
                    continue  # resumed: this one finished before
            os.makedirs(run_dir, exist_ok=True)
            with open(record, "w", encoding="utf-8") as fh:
                json.dump(run, fh, indent=2)
            todo.append((run, run_dir))
    later: list[str] = []
    if deadline is not None and todo:
        plan = _in_time(todo, deadline, jobs, probe, on_plan)
        order = {expected.name: i for i, expected in enumerate(plan.start)}  # shortest first
        todo = sorted((task for task in todo if task[0]["name"] in order), key=lambda task: order[task[0]["name"]])
        later = [expected.name for expected in plan.later]
    bar = tqdm(total=len(runs), initial=len(runs) - len(todo) - len(later), desc=config["name"], unit="run",
               disable=not progress or only_plot)
    finished: list[str] = []
    try:
        _run_all(config, runs, todo, out, keep, jobs, threads, progress, bar, finished, deadline)
    except multiprocessing.TimeoutError:
        pass  # the time limit: the runs under way were stopped (their processes ended); what finished is kept below
    bar.close()
    rows, plots = tabulate(config, runs, out)
    result = {"out": out, "runs": len(runs), "ran": len(finished), "rows": len(rows), "plots": plots}
    if deadline is not None:
        result["later"] = later
        result["stopped"] = [run["name"] for run, _ in todo if run["name"] not in finished]
    if keep:
        result["kept"] = keep_finished(runs, out, keep)
    return result


def _in_time(todo: list[tuple[dict, str]], deadline: run_budget.Deadline, jobs: int, probe: int,
             on_plan) -> run_budget.TimePlan:
    """What a time limit lets start of `todo` (each run probed here), said to on_plan as it goes."""
    expected = []
    for run, run_dir in todo:
        left = iterations_left(run, run_dir)
        expected.append(run_budget.Expected(run["name"], probe_pace(run, probe) if left else 0.0, left))
        if on_plan is not None:
            on_plan(expected[-1], None)
    plan = run_budget.plan(expected, deadline.left(), jobs)
    if on_plan is not None:
        for run in plan.start:
            on_plan(run, True)
        for run in plan.later:
            on_plan(run, False)
    return plan


def _run_all(config: dict, runs: list[dict], todo: list[tuple[dict, str]], out: str, keep: str | None, jobs: int,
             threads: int, progress: bool, bar, finished: list[str], deadline: run_budget.Deadline | None) -> None:
    """Trains `todo`, `jobs` at a time, appending each run's name to `finished` as it ends (and keeping it). With a
    deadline every run trains in a process of its own, even one at a time, and multiprocessing.TimeoutError comes
    when the deadline passes, its processes ended: a run is stopped from outside, never inside its own loop."""
    if jobs == 1 and deadline is None:
        for run, run_dir in todo:
            run_one(run, run_dir, progress)
            finished.append(run["name"])
            if keep:  # now, with the tables and plots so far: the experiment may not live to its end
                tabulate(config, runs, out)
                keep_finished([run], out, keep)
            bar.update(1)
        return
    if not todo:
        return
    # spawn, not fork: a forked child would inherit torch's thread pools and locks mid-state
    # The children start with Ctrl-C ignored (an ignored signal stays ignored across exec): one that
    # came while a child was still importing torch printed its KeyboardInterrupt traceback. A SIGTERM
    # that comes while they start is handled once they have (scheduling.signals_held).
    pool = None
    others = set(multiprocessing.active_children())  # (the pool's processes are the children after less these)
    try:
        with scheduling.signals_held(signal.SIGTERM, ignoring=(signal.SIGINT,)):
            pool = multiprocessing.get_context("spawn").Pool(processes=jobs, initializer=_start_child)
        ended = pool.imap_unordered(_run_in_child, [(run, run_dir, threads) for run, run_dir in todo])
        for _ in todo:
            name = ended.next(timeout=None if deadline is None else max(deadline.left(), 0.0))
            finished.append(name)
            bar.set_postfix_str(f"finished {name}")  # a failed run raises here
            if keep:
                tabulate(config, runs, out)
                keep_finished([run for run in runs if run["name"] == name], out, keep)
            bar.update(1)
        pool.close()
    except BaseException:
        # a failed run, Ctrl-C, SIGTERM or the time limit: the runs under way stop now (waiting for them
        # could take hours); they and those not started are run again by a resume
        if pool is not None:
            _end_processes(pool, others)
            pool = None
        raise
    finally:
        if pool is not None:
            pool.join()


def _end_processes(pool, others: set, grace: float = 15.0) -> None:
    """The pool's processes (this process's children but `others`) ended: SIGTERM (Pool.terminate), then SIGKILL
    to any still alive `grace` seconds on. A process that did not die of its SIGTERM (it took it as another error,
    or another thread of it got it while it waited for work) would otherwise hold Pool.join forever."""

    def kill_the_rest() -> None:
        for process in set(multiprocessing.active_children()) - others:
            process.kill()

    killer = threading.Timer(grace, kill_the_rest)
    killer.daemon = True
    killer.start()
    try:
        pool.terminate()
        pool.join()
    finally:
        killer.cancel()


def tabulate(config: dict, runs: list[dict], out: str) -> tuple[list[dict], list[str]]:
    """The tables (results.csv, runs.csv, bands.csv) and plots of every run finished so far."""
    rows = collect(runs, out)
    write_csv(rows, os.path.join(out, "results.csv"))
    write_csv(summarize(runs, out), os.path.join(out, "runs.csv"))
    if config["plot"] == "bands":
        write_csv(band_rows(rows, runs), os.path.join(out, "bands.csv"))
    plots = plot(rows, runs, config["plot"], out, config["name"]) if rows else []
    samples = plot_samples(runs, out, config["name"])
    return rows, plots + ([samples] if samples else [])

