"""The algorithms, one room each, and the one registry that says which exist.

- ``mdgan/``: MD-GAN (the paper): one generator on the server, a discriminator per worker, swaps.
- ``flgan``: FL-GAN, federated averaging of whole GANs (the paper's baseline).
- ``standalone``: one G and one D on the whole dataset (the paper's other baseline; no workers).
- ``pwgan``: the parallel Wasserstein GAN (parallel-wgan.txt, Algorithms 1 and 2).
- ``psgan``: the synchronous parameter-server GAN (Figure 1a of the same paper).

Each room holds both sides of its algorithm, its training loop over abstract worker handles (base.py
has what they share), its in-process run, its per-iteration traffic formula and its options. Nothing
here knows how the sides talk: the services (services/server/algorithms/, services/worker/algorithms/)
adapt each loop to gRPC. Every consumer (simulate, the command line's choices and refusals,
experiments, the traffic report, the services) reads ALGORITHMS; no other list of names exists.
Adding an algorithm: docs/ALGORITHMS.md, "How to add an algorithm".
"""

from __future__ import annotations

from typing import Callable, Mapping

from mdgan.algorithms import psgan, flgan, pwgan, standalone
from mdgan.algorithms import mdgan as mdgan_room
from mdgan.algorithms.base import Algorithm, option_key
from mdgan.config import ConfigError, named
from mdgan.renames import RENAMED, RENAMED_SETTINGS, canonical, renamed_settings  # noqa: F401


ALGORITHMS: dict[str, Algorithm] = {a.name: a for a in (
    mdgan_room.ALGORITHM,
    flgan.ALGORITHM,
    standalone.ALGORITHM,
    pwgan.ALGORITHM,
    psgan.ALGORITHM,
)}

NAMES = tuple(ALGORITHMS)
SERVED = tuple(name for name, a in ALGORITHMS.items() if a.served)  # what mdgan local and mdgan-server run


def _names(which: Callable[[Algorithm], bool]) -> str:
    return ", ".join(a.name for a in ALGORITHMS.values() if which(a))


def durable_names() -> str:
    return "--algorithm " + _names(lambda a: a.durable)


def get(name: str, served: bool = False) -> Algorithm:
    """The algorithm called `name` (served: one the services run); one clear line for any other name."""
    name = canonical(name)
    choices = SERVED if served else NAMES
    if name not in choices:
        raise ConfigError(f"unknown algorithm {name!r}; choose from {', '.join(choices)}")
    return ALGORITHMS[name]


def refuse_foreign_options(name: str, settings: Mapping) -> None:
    """One clear line for an option of another algorithm than `name` set away from its default (it would
    be ignored). `settings`: keyed by option_key, as parsed flags or an experiment's run are."""
    name = canonical(name)
    for other in ALGORITHMS.values():
        if other.name == name:
            continue
        for field in other.option_fields():
            key = option_key(field)
            if key in settings and settings[key] is not None and settings[key] != field.default:
                raise ConfigError(f"{named(key)} is an option of {named('algorithm')} {other.name}, not of "
                                  f"{named('algorithm')} {name}: drop it, or run {other.name}")


def refuse(algorithm: Algorithm, *, checkpoint_every: int = 0, resume: bool = False, churn: bool = False, byzantine: int = 0,
           crash_every: int | None = None, site_dirs: str | None = None, in_process: bool = True,
           private: str | None = None) -> None:
    """One clear line (ConfigError) for the first thing asked of `algorithm` that it cannot do: the one place
    that says which algorithm refuses what (simulate, mdgan local, experiments and mdgan-server ask it)."""
    if not (in_process or algorithm.served):
        raise ConfigError(f"{algorithm.title} has no workers: run it with `mdgan simulate {named('algorithm')} {algorithm.name}`")
    if not algorithm.durable and churn:
        raise ConfigError(f"{named('churn')} works with {durable_names()} only, not {named('algorithm')} {algorithm.name}")
    if (checkpoint_every or resume) and not (algorithm.resumable if in_process else algorithm.durable):
        where, which = ("in one process", lambda a: a.resumable) if in_process else ("on the services", lambda a: a.durable)
        raise ConfigError(f"{named('checkpoint_every')} and {named('resume')} work {where} with --algorithm "
                          f"{_names(which)} only, not {named('algorithm')} {algorithm.name}")
    if not algorithm.attackers and byzantine:
        raise ConfigError(f"emulated attackers ({named('byzantine')}) apply to {_names(lambda a: a.attackers)} runs, "
                          f"not {named('algorithm')} {algorithm.name}")
    if not algorithm.crashes and crash_every:
        raise ConfigError(f"crash schedules apply to {_names(lambda a: a.crashes)} runs, not {named('algorithm')} "
                          f"{algorithm.name}")
    if private and not algorithm.private:
        raise ConfigError(f"differential privacy (--dp-*) is implemented for {_names(lambda a: a.private)} only, "
                          f"not {named('algorithm')} {algorithm.name} (its workers' real-data steps are not clipped and "
                          "noised): run one of those, or drop the --dp-* flags")
    if private and private not in algorithm.private:
        raise ConfigError(f"{named('dp_mechanism')} {private} is implemented for "
                          f"{_names(lambda a: private in a.private)} only, not {named('algorithm')} {algorithm.name}")
    if algorithm.whole_dataset and site_dirs:
        raise ConfigError(f"{algorithm.title} trains on one dataset: give it {named('data_root')}, not {named('site_dirs')}")
