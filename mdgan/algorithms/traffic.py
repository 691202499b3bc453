"""What the algorithms' traffic formulas share: the bytes of a model on the wire, an option of a
finished run, and the per-iteration formula of the round-based algorithms summed over a run.

Each algorithm's formulas live in its own room (`per_worker_per_iteration`, its run's formula); the
`mdgan traffic` report (mdgan_app/traffic.py) holds them against the Prometheus counters.
"""

from __future__ import annotations

from typing import Callable

from mdgan.algorithms.base import DIRECTIONS


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


def option_of_run(summary: dict, algorithm: str, key: str):
    """An algorithm option of a run: summary[algorithm][key] (simulate), else the config's (a spec's)."""
    for source in (summary.get(algorithm) or {}, summary["config"]):
        if key in source:
            return source[key]
    raise ValueError(f"the run's summary.json names no {algorithm} {key!r}: its traffic formula needs it")


def rounds_run_traffic(per_iteration: Callable[[dict, int], dict[str, int]]):
    """pwgan, psgan: the formula of `workers` workers answering, summed over the history's iterations.
    An iteration in which a worker was lost or rejected (its messages stop in the round it fails,
    which the history does not record) is bounded instead: at least the formula for the workers that
    answered, at most for those asked."""

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
