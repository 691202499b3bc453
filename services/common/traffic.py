"""`mdgan traffic RUN`: the run's wire traffic, measured by the Prometheus counters of every process,
next to the paper's Table III formula for the same run.

Table III (floats, x4 bytes at fp32): server->workers 2*b*d per worker per iteration, workers->server
b*d per worker per iteration, worker->worker |theta| per worker per swap. The formula is evaluated
with the run's own counts (workers active in each iteration, feedback sent, discriminators pushed), so
it holds exactly for runs where workers failed too. A run with a compressed wire (--wire-dtype) is
held to the same formula at its wire dtype (2 bytes a float at float16/bfloat16; 1 byte plus a float32
scale per row at int8), and each row also gives Table III at float32 and the ratio to it.
"""

from __future__ import annotations

import glob
import json
import math
import os

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

    from mdgan.compression import packed_nbytes

    config = summary["config"]
    wire = config.get("wire_dtype", "float32")
    b, d = config["batch_size"], math.prod(config["model"]["sample_shape"])
    theta_bytes = discriminator_state_bytes(config, wire)
    theta_fp32 = discriminator_state_bytes(config)
    if summary.get("algorithm") == "flgan":
        # Table III, FL-GAN: theta + w down and up per worker per round; nothing between workers.
        model = theta_bytes + generator_state_bytes(config)
        per_round = sum(s["workers"] for s in swaps)
        formula = {"server_to_worker": per_round * model, "worker_to_server": per_round * model,
                   "worker_to_worker": 0}
        formula_fp32 = formula
    else:
        counts = {"server_to_worker": 2 * sum(r["active_workers"] for r in history),  # tensors of b*d floats
                  # late answers (--sync quorum|async) travelled too, and were dropped on arrival
                  "worker_to_server": sum(r["answered"] + r["rejected"] + r.get("late", 0) for r in history),
                  "worker_to_worker": sum(1 for s in swaps for w in s["workers"].values() if w["sent"])}
        per_tensor = {"server_to_worker": packed_nbytes((b, d), wire), "worker_to_server": packed_nbytes((b, d), wire),
                      "worker_to_worker": theta_bytes}
        per_tensor_fp32 = {"server_to_worker": b * d * 4, "worker_to_server": b * d * 4, "worker_to_worker": theta_fp32}
        formula = {k: counts[k] * per_tensor[k] for k in DIRECTIONS}
        formula_fp32 = {k: counts[k] * per_tensor_fp32[k] for k in DIRECTIONS}

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
                "payload_matches_formula": payload == formula[direction],
                "table_iii_fp32_bytes": formula_fp32[direction],
                "ratio_to_fp32": payload / formula_fp32[direction] if formula_fp32[direction] else None,
                "message_bytes": message,
                "overhead": message / payload - 1 if payload else None,
                "per_worker_bytes": payload / max(1, summary["workers"]),
            })
    return {"run": run_dir, "algorithm": summary.get("algorithm", "mdgan"), "iterations": summary["iterations"],
            "wire_dtype": wire,
            "workers": summary["workers"],
            "batch_size": b, "sample_size": d, "discriminator_bytes": theta_bytes, "swaps": len(swaps),
            "rows": rows}


def format_table(report: dict) -> str:
    mb = 1e6
    lines = [f"{report['run']} ({report['algorithm']}): I={report['iterations']} N={report['workers']} "
             f"b={report['batch_size']} "
             f"d={report['sample_size']} wire={report.get('wire_dtype', 'float32')} "
             f"|theta| on the wire={report['discriminator_bytes']} B swaps={report['swaps']}",
             f"{'':5} {'counted at':20} {'payload MB':>12} {'Table III MB':>13} {'match':>6} {'per worker MB':>14} "
             f"{'serialized MB':>14} {'overhead':>9} {'x fp32':>7}"]
    for r in report["rows"]:
        overhead = "-" if r["overhead"] is None else f"{100 * r['overhead']:.2f}%"
        ratio = "-" if r.get("ratio_to_fp32") is None else f"{r['ratio_to_fp32']:.4f}"
        lines.append(f"{ARROWS[r['direction']]:5} {r['counted_at']:20} {r['payload_bytes'] / mb:12.3f} "
                     f"{r['formula_bytes'] / mb:13.3f} {'yes' if r['payload_matches_formula'] else 'NO':>6} "
                     f"{r['per_worker_bytes'] / mb:14.3f} {r['message_bytes'] / mb:14.3f} {overhead:>9} {ratio:>7}")
    return "\n".join(lines)
