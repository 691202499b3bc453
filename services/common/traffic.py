"""`mdgan traffic`: each algorithm's bytes per iteration, from its formula ("Table III") and from a run.

`mdgan traffic RUN`: the run's wire traffic, measured by the Prometheus counters of every process,
next to the per-iteration formula of the run's algorithm (summary.json's "algorithm"), evaluated
with the run's own counts (docs/ALGORITHMS.md has one table per algorithm):

- mdgan (the paper's Table III; floats, x4 bytes at fp32): server->workers 2*b*d per worker per
  iteration, workers->server b*d per worker per iteration, worker->worker |theta| per worker per swap.
  Evaluated with the workers active in each iteration, the feedback sent and the discriminators
  pushed, so it holds exactly for runs where workers failed too. A run with a compressed wire
  (--wire-dtype) is held to the same formula at its wire dtype (2 bytes a float at float16/bfloat16;
  1 byte plus a float32 scale per row at int8), and each row also gives Table III at float32 and
  the ratio to it.
- flgan: |theta_G| + |theta_D| both ways per worker per averaging round (every S iterations).
- pwgan, dpgan: their library's ``traffic_per_iteration`` for the workers asked in each iteration
  of the history. An iteration in which a worker was lost or rejected (its messages stop in the
  round it fails, which the history does not record) is bounded instead: at least the formula for
  the workers that answered, at most for those asked; the row "matches" when the counter lies in
  that range, and exactly on the formula when no such iteration happened.

`mdgan traffic --algorithm A --workers N --batch-size b ...` (no run directory): the formulas alone,
bytes per worker per iteration in each direction for one algorithm or all four, what a user
compares before choosing one (``formula_table``).
"""

from __future__ import annotations

import glob
import json
import math
import os
from dataclasses import asdict

from prometheus_client.parser import text_string_to_metric_families

DIRECTIONS = ("server_to_worker", "worker_to_server", "worker_to_worker")
ARROWS = {"server_to_worker": "C->W", "worker_to_server": "W->C", "worker_to_worker": "W->W"}
# which process kind sends and which receives, per direction
ENDS = {"server_to_worker": ("server", "workers"), "worker_to_server": ("workers", "server"),
        "worker_to_worker": ("workers", "workers")}


def read_exposition(path: str) -> dict[tuple[str, str, str, str], float]:
    """(metric, direction, side, kind) -> value for the wire counters of one process."""
    with open(path, encoding="utf-8") as fh:
        text = fh.read()
    values = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.startswith("mdgan_wire_") and sample.name.endswith("_total"):
                key = (sample.name, sample.labels["direction"], sample.labels["side"], sample.labels["kind"])
                values[key] = sample.value
    return values


def _model_spec(config: dict):
    from mdgan.config import ModelSpec

    return ModelSpec(**dict(config["model"], sample_shape=tuple(config["model"]["sample_shape"])))


def generator_state_bytes(config: dict) -> int:
    from mdgan.models import build_generator

    return sum(t.numel() * t.element_size() for t in build_generator(_model_spec(config), seed=0).state_dict().values())


def discriminator_state_bytes(config: dict, wire_dtype: str = "float32") -> int:
    """Bytes of one swapped discriminator state: |theta| floats (and Adam moments when they travel),
    in the wire dtype."""
    from mdgan.compression import packed_nbytes
    from mdgan.models import build_discriminator

    disc = build_discriminator(_model_spec(config), seed=0)
    shapes = [tuple(t.shape) for t in disc.state_dict().values()]
    if config.get("swap_optimizer_state"):
        shapes += [tuple(p.shape) for p in disc.parameters() for _ in ("exp_avg", "exp_avg_sq")]
        steps = 4 * len(list(disc.parameters()))  # Adam's step counters travel exactly, at float32
    else:
        steps = 0
    return sum(packed_nbytes(shape, wire_dtype) for shape in shapes) + steps


def _sum(values: dict, metric: str, direction: str, side: str) -> int:
    return int(sum(v for (m, d, s, _), v in values.items() if m == metric and d == direction and s == side))


# ---------------------------------------------------------------------------------------------
# One formula per algorithm, evaluated on a run: (formula, formula_min, formula at float32), bytes by
# direction over the whole run. formula_min == formula wherever the counts are exact.


def _mdgan_run_formula(summary: dict, history: list[dict], swaps: list[dict]):
    from mdgan.compression import packed_nbytes

    config = summary["config"]
    wire = config.get("wire_dtype", "float32")
    b, d = config["batch_size"], math.prod(config["model"]["sample_shape"])
    counts = {"server_to_worker": 2 * sum(r["active_workers"] for r in history),  # tensors of b*d floats
              # late answers (--sync quorum|async) travelled too, and were dropped on arrival
              "worker_to_server": sum(r["answered"] + r["rejected"] + r.get("late", 0) for r in history),
              "worker_to_worker": sum(1 for s in swaps for w in s["workers"].values() if w["sent"])}
    per_tensor = {"server_to_worker": packed_nbytes((b, d), wire), "worker_to_server": packed_nbytes((b, d), wire),
                  "worker_to_worker": discriminator_state_bytes(config, wire)}
    per_tensor_fp32 = {"server_to_worker": b * d * 4, "worker_to_server": b * d * 4,
                       "worker_to_worker": discriminator_state_bytes(config)}
    formula = {k: counts[k] * per_tensor[k] for k in DIRECTIONS}
    return formula, formula, {k: counts[k] * per_tensor_fp32[k] for k in DIRECTIONS}


def _flgan_run_formula(summary: dict, history: list[dict], swaps: list[dict]):
    # theta + w down and up per worker per round; nothing between workers.
    config = summary["config"]
    model = discriminator_state_bytes(config, config.get("wire_dtype", "float32")) + generator_state_bytes(config)
    per_round = sum(s["workers"] for s in swaps)
    formula = {"server_to_worker": per_round * model, "worker_to_server": per_round * model, "worker_to_worker": 0}
    return formula, formula, formula


def _option(summary: dict, algorithm: str, key: str):
    """An algorithm option of the run: summary[algorithm][key] (simulate), else the config's (a spec's)."""
    for source in (summary.get(algorithm) or {}, summary["config"]):
        if key in source:
            return source[key]
    raise ValueError(f"the run's summary.json names no {algorithm} {key!r}: its traffic formula needs it")


def _rounds_run_formula(per_iteration):
    """pwgan, dpgan: the formula of `workers` workers answering, summed over the history's iterations."""

    def evaluate(summary: dict, history: list[dict], swaps: list[dict]):
        formula, formula_min = dict.fromkeys(DIRECTIONS, 0), dict.fromkeys(DIRECTIONS, 0)
        for record in history:
            asked, answered = record["active_workers"], record["answered"]
            full = per_iteration(summary, asked)
            clean = answered == asked and not record.get("rejected") and not record.get("lost")
            least = full if clean else per_iteration(summary, answered)
            for k in DIRECTIONS:
                formula[k] += full[k]
                formula_min[k] += least[k]
        return formula, formula_min, formula

    return evaluate


def _pwgan_per_iteration(summary: dict, workers: int) -> dict[str, int]:
    from mdgan.algorithms.pwgan import PWGANOptions, traffic_per_iteration
    from mdgan.config import TrainingConfig

    options = PWGANOptions(potential_rounds=int(_option(summary, "pwgan", "potential_rounds")))
    return traffic_per_iteration(TrainingConfig.from_dict(summary["config"]), options, workers)


def _dpgan_per_iteration(summary: dict, workers: int) -> dict[str, int]:
    from mdgan.algorithms.dpgan import traffic_per_iteration
    from mdgan.config import TrainingConfig

    return traffic_per_iteration(TrainingConfig.from_dict(summary["config"]), workers)


RUN_FORMULAS = {"mdgan": _mdgan_run_formula, "flgan": _flgan_run_formula,
                "pwgan": _rounds_run_formula(_pwgan_per_iteration),
                "dpgan": _rounds_run_formula(_dpgan_per_iteration)}


def traffic_report(run_dir: str) -> dict:
    with open(os.path.join(run_dir, "summary.json"), encoding="utf-8") as fh:
        summary = json.load(fh)
    with open(os.path.join(run_dir, "history.jsonl"), encoding="utf-8") as fh:
        history = [json.loads(line) for line in fh if line.strip()]
    swaps = []
    if os.path.exists(os.path.join(run_dir, "swaps.jsonl")):
        with open(os.path.join(run_dir, "swaps.jsonl"), encoding="utf-8") as fh:
            swaps = [json.loads(line) for line in fh if line.strip()]
    files = sorted(glob.glob(os.path.join(run_dir, "metrics", "*.prom")))
    if not files:
        raise FileNotFoundError(f"no metrics/*.prom in {run_dir}: was it a `mdgan local` run?")
    processes = {os.path.basename(f)[:-5]: read_exposition(f) for f in files}
    server = processes.get("server", {})
    workers = [v for k, v in processes.items() if k != "server"]

    config = summary["config"]
    wire = config.get("wire_dtype", "float32")
    b, d = config["batch_size"], math.prod(config["model"]["sample_shape"])
    theta_bytes = discriminator_state_bytes(config, wire)
    algorithm = summary.get("algorithm", "mdgan")
    if algorithm not in RUN_FORMULAS:
        raise ValueError(f"{run_dir}: no traffic formula for algorithm {algorithm!r} "
                         f"(known: {', '.join(sorted(RUN_FORMULAS))})")
    formula, formula_min, formula_fp32 = RUN_FORMULAS[algorithm](summary, history, swaps)

    def measured(group: str, metric: str, direction: str, side: str) -> int:
        sources = [server] if group == "server" else workers
        return sum(_sum(v, metric, direction, side) for v in sources)

    rows = []
    for direction in DIRECTIONS:
        sender, receiver = ENDS[direction]
        for side, group in (("sender", sender), ("receiver", receiver)):
            payload = measured(group, "mdgan_wire_payload_bytes_total", direction, side)
            message = measured(group, "mdgan_wire_message_bytes_total", direction, side)
            rows.append({
                "direction": direction, "counted_at": f"{group} ({side})", "side": side,
                "payload_bytes": payload, "formula_bytes": formula[direction],
                # equal to formula_bytes except for pwgan/dpgan iterations with a lost or rejected worker
                "formula_min_bytes": formula_min[direction],
                "payload_matches_formula": formula_min[direction] <= payload <= formula[direction],
                "table_iii_fp32_bytes": formula_fp32[direction],
                "ratio_to_fp32": payload / formula_fp32[direction] if formula_fp32[direction] else None,
                "message_bytes": message,
                "overhead": message / payload - 1 if payload else None,
                "per_worker_bytes": payload / max(1, summary["workers"]),
            })
    return {"run": run_dir, "algorithm": algorithm, "iterations": summary["iterations"],
            "wire_dtype": wire,
            "workers": summary["workers"],
            "batch_size": b, "sample_size": d, "discriminator_bytes": theta_bytes, "swaps": len(swaps),
            "rows": rows}


def format_table(report: dict) -> str:
    mb = 1e6
    formula_name = "Table III MB" if report["algorithm"] == "mdgan" else "formula MB"  # the paper's, or its own
    lines = [f"{report['run']} ({report['algorithm']}): I={report['iterations']} N={report['workers']} "
             f"b={report['batch_size']} "
             f"d={report['sample_size']} wire={report.get('wire_dtype', 'float32')} "
             f"|theta| on the wire={report['discriminator_bytes']} B swaps={report['swaps']}",
             f"{'':5} {'counted at':20} {'payload MB':>12} {formula_name:>13} {'match':>6} {'per worker MB':>14} "
             f"{'serialized MB':>14} {'overhead':>9} {'x fp32':>7}"]
    for r in report["rows"]:
        overhead = "-" if r["overhead"] is None else f"{100 * r['overhead']:.2f}%"
        ratio = "-" if r.get("ratio_to_fp32") is None else f"{r['ratio_to_fp32']:.4f}"
        lines.append(f"{ARROWS[r['direction']]:5} {r['counted_at']:20} {r['payload_bytes'] / mb:12.3f} "
                     f"{r['formula_bytes'] / mb:13.3f} {'yes' if r['payload_matches_formula'] else 'NO':>6} "
                     f"{r['per_worker_bytes'] / mb:14.3f} {r['message_bytes'] / mb:14.3f} {overhead:>9} {ratio:>7}")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# The formulas alone (`mdgan traffic --algorithm A --workers N ...`, no run directory)

ALGORITHMS = ("mdgan", "flgan", "pwgan", "dpgan")
DATASET_TRAIN_SIZES = {"mnist": 60_000, "cifar10": 50_000}  # shard size m = train size / N by default


def per_worker_per_iteration(algorithm: str, config, shard_size: int, pwgan_options=None) -> dict[str, float]:
    """Payload bytes one worker sends and receives in one iteration, by direction (periodic transfers,
    MD-GAN's swaps and FL-GAN's averaging rounds, spread over their period S = ceil(E m / b))."""
    from mdgan.compression import packed_nbytes

    period = config.swap_period(shard_size)
    as_dict = config.to_dict()
    if algorithm == "mdgan":
        sample = packed_nbytes((config.batch_size, config.model.sample_size), config.wire_dtype)
        return {"server_to_worker": 2 * sample, "worker_to_server": sample,
                "worker_to_worker": discriminator_state_bytes(as_dict, config.wire_dtype) / period}
    if algorithm == "flgan":
        model = discriminator_state_bytes(as_dict, config.wire_dtype) + generator_state_bytes(as_dict)
        return {"server_to_worker": model / period, "worker_to_server": model / period, "worker_to_worker": 0}
    if algorithm == "pwgan":
        from mdgan.algorithms.pwgan import PWGANOptions, traffic_per_iteration

        formula = traffic_per_iteration(config, pwgan_options or PWGANOptions(), 1)
    elif algorithm == "dpgan":
        from mdgan.algorithms.dpgan import traffic_per_iteration

        formula = traffic_per_iteration(config, 1)
    else:
        raise ValueError(f"no traffic formula for algorithm {algorithm!r} (known: {', '.join(ALGORITHMS)})")
    return {k: formula[k] for k in DIRECTIONS}


def formula_table(algorithms: list[str], config, shard_size: int, pwgan_options=None) -> dict:
    """Each algorithm's bytes per iteration, per worker by direction and for the whole run's N workers."""
    from mdgan.algorithms.pwgan import PWGANOptions

    pwgan_options = pwgan_options or PWGANOptions()
    rows = []
    for algorithm in algorithms:
        per_worker = per_worker_per_iteration(algorithm, config, shard_size, pwgan_options)
        rows.append({"algorithm": algorithm, "per_worker": per_worker,
                     "all_workers": config.workers * sum(per_worker.values())})
    reference = next((r["all_workers"] for r in rows if r["algorithm"] == "mdgan"), None)
    for row in rows:
        row["x_mdgan"] = row["all_workers"] / reference if reference else None
    return {"workers": config.workers, "batch_size": config.batch_size, "sample_size": config.model.sample_size,
            "architecture": config.model.architecture, "gan": config.model.gan, "disc_steps": config.disc_steps,
            "wire_dtype": config.wire_dtype, "shard_size": shard_size, "period": config.swap_period(shard_size),
            "pwgan": asdict(pwgan_options), "rows": rows}


def format_formulas(report: dict) -> str:
    lines = [f"payload bytes per iteration: N={report['workers']} b={report['batch_size']} d={report['sample_size']} "
             f"{report['architecture']} {report['gan']} L={report['disc_steps']} m={report['shard_size']} "
             f"(S={report['period']}: swaps, FL-GAN rounds) T={report['pwgan']['potential_rounds']} "
             f"wire={report['wire_dtype']}",
             f"{'algorithm':10} {'C->W per worker':>16} {'W->C per worker':>16} {'W->W per worker':>16} "
             f"{'all N workers':>15} {'x MD-GAN':>9}"]
    for row in report["rows"]:
        w = row["per_worker"]
        ratio = "-" if row["x_mdgan"] is None else f"{row['x_mdgan']:.2f}"
        lines.append(f"{row['algorithm']:10} {w['server_to_worker']:16,.0f} {w['worker_to_server']:16,.0f} "
                     f"{w['worker_to_worker']:16,.0f} {row['all_workers']:15,.0f} {ratio:>9}")
    return "\n".join(lines)
