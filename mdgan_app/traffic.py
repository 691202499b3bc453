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
- pwgan, psgan: their library's ``traffic_per_iteration`` for the workers asked in each iteration
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

from mdgan.algorithms import ALGORITHMS
from mdgan.algorithms.base import DIRECTIONS
from mdgan.algorithms.traffic import discriminator_state_bytes
from mdgan.config import ConfigError
from mdgan.sampling import read_summary

ARROWS = {"server_to_worker": "C->W", "worker_to_server": "W->C", "worker_to_worker": "W->W"}
# which process kind sends and which receives, per direction
ENDS = {"server_to_worker": ("server", "workers"), "worker_to_server": ("workers", "server"),
        "worker_to_worker": ("workers", "workers")}


def read_exposition(path: str) -> dict[tuple[str, str, str, str], float]:
    """(metric, direction, side, kind) -> value for the wire counters of one process; the relay's bytes
    (mdgan_relayed_bytes_total) under ("mdgan_relayed_bytes_total", "relay", sender, receiver)."""
    with open(path, encoding="utf-8") as fh:
        text = fh.read()
    values = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.startswith("mdgan_wire_") and sample.name.endswith("_total"):
                key = (sample.name, sample.labels["direction"], sample.labels["side"], sample.labels["kind"])
                values[key] = sample.value
            elif sample.name == RELAYED:
                values[(RELAYED, "relay", sample.labels["sender"], sample.labels["receiver"])] = sample.value
    return values


RELAYED = "mdgan_relayed_bytes_total"


def relay_row(server: dict, swaps: list[dict], theta_bytes: int) -> dict | None:
    """The relay's term (docs/DEPLOY.md "Sites that only dial out"): a relayed discriminator crosses the server's
    link in and out besides the two sites' links. Payload by Table III, |theta| per relayed push, each way; what the
    relay forwarded (sealed, so it counts sealed bytes) against what the senders report having sealed. None for a
    run without relayed pushes."""
    pushes = [w for s in swaps if isinstance(s.get("workers"), dict) for w in s["workers"].values()
              if isinstance(w, dict) and w.get("relayed_bytes")]  # (MD-GAN's rounds; FL-GAN's count workers)
    forwarded = int(sum(v for (m, *_), v in server.items() if m == RELAYED))
    if not pushes and not forwarded:
        return None
    sealed = sum(w["relayed_bytes"] for w in pushes)
    return {"relayed_pushes": len(pushes), "payload_formula_bytes": len(pushes) * theta_bytes,
            "sealed_reported_bytes": sealed, "forwarded_bytes": forwarded,
            "forwarded_matches_reported": forwarded == sealed,
            "overhead": forwarded / (len(pushes) * theta_bytes) - 1 if pushes and theta_bytes else None}


def _sum(values: dict, metric: str, direction: str, side: str) -> int:
    return int(sum(v for (m, d, s, _), v in values.items() if m == metric and d == direction and s == side))


def _records(path: str) -> list[dict]:
    """A run's JSON-lines file (history.jsonl, swaps.jsonl); ConfigError naming the line that is not one."""
    records = []
    with open(path, encoding="utf-8", errors="replace") as fh:
        for number, line in enumerate(fh, 1):
            if line.strip():
                try:
                    record = json.loads(line)
                except ValueError as exc:
                    raise ConfigError(f"{path} line {number}: not a run's record ({exc})") from None
                if not isinstance(record, dict):
                    raise ConfigError(f"{path} line {number}: not a run's record")
                records.append(record)
    return records


def traffic_report(run_dir: str) -> dict:
    summary = read_summary(run_dir)
    history = _records(os.path.join(run_dir, "history.jsonl"))
    swaps = []
    if os.path.exists(os.path.join(run_dir, "swaps.jsonl")):
        swaps = _records(os.path.join(run_dir, "swaps.jsonl"))
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
    known = [name for name, entry in ALGORITHMS.items() if entry.run_traffic is not None]
    if algorithm not in known:
        raise ValueError(f"{run_dir}: no traffic formula for algorithm {algorithm!r} (known: {', '.join(known)})")
    formula, formula_min, formula_fp32 = ALGORITHMS[algorithm].run_traffic(summary, history, swaps)

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
                # equal to formula_bytes except for pwgan/psgan iterations with a lost or rejected worker
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
            "rows": rows, "relay": relay_row(server, swaps, theta_bytes)}


def format_table(report: dict) -> str:
    mb = 1e6
    formula_name = "formula MB"
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
    relay = report.get("relay")
    if relay:  # in at the server from the sender, out to the receiver: twice these bytes on the server's link
        overhead = "-" if relay["overhead"] is None else f"{100 * relay['overhead']:.2f}%"
        lines.append(f"{'relay':5} {'server (forwarded)':20} {relay['forwarded_bytes'] / mb:12.3f} "
                     f"{relay['payload_formula_bytes'] / mb:13.3f} "
                     f"{'yes' if relay['forwarded_matches_reported'] else 'NO':>6} {'':14} "
                     f"{relay['sealed_reported_bytes'] / mb:14.3f} {overhead:>9}")
        lines.append(f"      ({relay['relayed_pushes']} relayed pushes of |theta|, each in and out of the server; "
                     "forwarded: sealed bytes, against the sealed bytes the senders report)")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# The formulas alone (`mdgan traffic --algorithm A --workers N ...`, no run directory)

DATASET_TRAIN_SIZES = {"mnist": 60_000, "cifar10": 50_000}  # shard size m = train size / N by default
REFERENCE = "mdgan"  # the table's ratios are to the paper's algorithm


def formula_table(options: dict[str, object], config, shard_size: int) -> dict:
    """Each algorithm's bytes per iteration (options: name -> its options, None for none), per worker by
    direction (periodic transfers, MD-GAN's swaps and FL-GAN's averaging rounds, spread over their period
    S = ceil(E m / b)) and for the whole run's N workers."""
    rows = []
    for name, algorithm_options in options.items():
        per_worker = ALGORITHMS[name].per_worker_per_iteration(config, shard_size, algorithm_options)
        rows.append({"algorithm": name, "per_worker": {k: per_worker[k] for k in DIRECTIONS},
                     "all_workers": config.workers * sum(per_worker[k] for k in DIRECTIONS)})
    reference = next((r["all_workers"] for r in rows if r["algorithm"] == REFERENCE), None)
    for row in rows:
        row["x_mdgan"] = row["all_workers"] / reference if reference else None
    return {"workers": config.workers, "batch_size": config.batch_size, "sample_size": config.model.sample_size,
            "architecture": config.model.architecture, "gan": config.model.gan, "disc_steps": config.disc_steps,
            "wire_dtype": config.wire_dtype, "shard_size": shard_size, "period": config.swap_period(shard_size),
            "options": {name: asdict(o) for name, o in options.items() if o is not None}, "rows": rows}


def _symbols(name: str, options: dict) -> str:
    """An algorithm's options by their symbols (P-WGAN: T=5 eta=1.0 gp=10.0)."""
    return " ".join(f"{f.metadata['short'] or f.name}={options[f.name]}" for f in ALGORITHMS[name].option_fields()
                    if f.name in options)


def format_formulas(report: dict) -> str:
    lines = [f"payload bytes per iteration: N={report['workers']} b={report['batch_size']} d={report['sample_size']} "
             f"{report['architecture']} {report['gan']} L={report['disc_steps']} m={report['shard_size']}"
             + (" (no swaps: private feedback)" if report["period"] is None
                else f" (S={report['period']}: swaps, FL-GAN rounds)") + f" wire={report['wire_dtype']}"
             + "".join(f" {_symbols(name, o)}" for name, o in report["options"].items()),
             f"{'algorithm':10} {'C->W per worker':>16} {'W->C per worker':>16} {'W->W per worker':>16} "
             f"{'all N workers':>15} {'x MD-GAN':>9}"]
    for row in report["rows"]:
        w = row["per_worker"]
        ratio = "-" if row["x_mdgan"] is None else f"{row['x_mdgan']:.2f}"
        lines.append(f"{row['algorithm']:10} {w['server_to_worker']:16,.0f} {w['worker_to_server']:16,.0f} "
                     f"{w['worker_to_worker']:16,.0f} {row['all_workers']:15,.0f} {ratio:>9}")
    return "\n".join(lines)
