"""What every algorithm's training loop shares: its errors, its records, and the one way to ask a set of
workers something at once and sort their answers.

The loops of every algorithm (mdgan/algorithms/*) run against abstract worker handles: an object in
this process (`mdgan simulate`) or a gRPC stream (services/server). A handle answers, or raises one of
the two errors below; `ask_all` turns a round of such calls into (answers, rejections, losses), in the
rank order of the workers asked, so that every loop sums what came back in the same order whatever the
transport (Flower's `fit_clients` / `_handle_finished_future_after_fit` do the same for its clients).
"""

from __future__ import annotations

import os
import uuid

import asyncio
import dataclasses
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Awaitable, Callable, Generic, Sequence, TypeVar

if TYPE_CHECKING:
    from mdgan.config import TrainingConfig
    from mdgan.data import Shard
    from mdgan.gan import GeneratorSide
    from mdgan.run import RunRecorder, RunStart

log = logging.getLogger(__name__)


class WorkerLost(Exception):
    """The worker is gone (crashed, disconnected, or missed its deadline): it leaves the run."""


class InputRejected(Exception):
    """The worker answered with input that failed validation: this iteration goes on without it."""

    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


DIRECTIONS = ("server_to_worker", "worker_to_server", "worker_to_worker")
RUN_FINISHED = "run finished"  # the stop reason of a run that completed
RUN_FAILED = "the server stopped the run"  # how a worker told that the run failed on the server says so


@dataclass
class Traffic:
    """Payload bytes (tensor data) by direction, plus the ACGAN labels that ride with the batches."""

    payload_bytes: dict[str, int] = field(default_factory=lambda: dict.fromkeys(DIRECTIONS, 0))
    label_bytes: int = 0


@dataclass
class IterationRecord:
    iteration: int
    active_workers: int
    answered: int
    rejected: int
    lost: int
    gen_loss: float
    disc_loss: float
    real_accuracy: float
    fake_accuracy: float
    swap_round: int | None
    seconds: float
    # phases of `seconds`: generating the k batches, waiting for the workers, updating G, swapping
    generate_seconds: float = 0.0
    wait_seconds: float = 0.0
    update_seconds: float = 0.0
    swap_seconds: float = 0.0
    late: int = 0  # --sync quorum|async: answers that came too late to count (dropped)
    # DP: worker id -> {"epsilon", "delta"} each site last reported (None: not private); history.jsonl
    # carries it on the lines with evaluations, swaps and the last one
    privacy: dict | None = None


@dataclass
class RunResult:
    iterations: int
    workers: int
    workers_alive: int
    swaps: int
    rejections: int
    swap_period: int | None  # None: no swaps (private feedback)
    traffic: Traffic
    last: IterationRecord | None
    stopped_early: str | None = None
    alive: list[str] | None = None  # worker ids connected at the end
    swaps_refused: int = 0  # MD-GAN: received discriminators the receivers' checks refused (swapcheck.py)
    privacy: dict | None = None  # DP: worker id -> {"epsilon", "delta"} it last reported (mdgan/privacy.py)


def option(default, flag: str, help: str, short: str = "", **argparse_kwargs):
    """A field of an algorithm's options dataclass, with the flag that sets it (and its MDGAN_* variable):
    the services, the command line and experiments make their settings from these fields, so each is
    defined once. short: the symbol in a run's name (experiments)."""
    return field(default=default, metadata={"flag": flag, "help": help, "short": short, **argparse_kwargs})


def option_key(option_field) -> str:
    """The setting's name where settings are a mapping (argparse's dest, an experiment's key)."""
    return option_field.metadata["flag"].lstrip("-").replace("-", "_")


def mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


async def with_deadline(awaitable, timeout: float | None):
    """Await, within `timeout` seconds when one is given (raises asyncio.TimeoutError).

    asyncio.timeout, not wait_for: the same deadline without a task of its own for the awaitable
    (wait_for makes one per call, and this runs N times an iteration)."""
    if not timeout:
        return await awaitable
    async with asyncio.timeout(timeout):
        return await awaitable


async def tell_to_stop(worker, reason: str, timeout: float = 5.0) -> None:
    """Best effort: a worker being dropped may already be gone, and then there is nobody to tell."""
    try:
        await asyncio.wait_for(worker.stop(reason), timeout)
    except Exception as exc:
        log.debug("could not stop %s: %s", worker.worker_id, exc)


def why_lost(error: BaseException, default: str = "missed its deadline") -> str:
    """What to say of a lost worker: its WorkerLost's text, or `default` for a deadline (which has none)."""
    return str(error) or default


W = TypeVar("W")
R = TypeVar("R")


@dataclass
class Replies(Generic[W, R]):
    """The answers to one round of calls, each list in the rank order of the workers asked."""

    good: list[tuple[W, R]] = field(default_factory=list)
    rejected: list[tuple[W, InputRejected]] = field(default_factory=list)
    lost: list[tuple[W, BaseException]] = field(default_factory=list)  # WorkerLost or asyncio.TimeoutError

    @property
    def answers(self) -> list[R]:
        return [reply for _, reply in self.good]


def sort_replies(workers: Sequence[W], replies: Sequence[object],
                 check: Callable[[object], None] | None = None) -> Replies:
    """Sort what each worker gave (an answer, or the exception its call raised) into good, rejected
    (InputRejected, or an answer `check` refused) and lost (WorkerLost, a missed deadline). Any other
    exception is a bug of ours, not the worker's: it is raised."""
    sorted_replies: Replies = Replies()
    for worker, reply in zip(workers, replies):
        if not isinstance(reply, BaseException) and check is not None:
            try:
                check(reply)
            except InputRejected as exc:
                reply = exc
        if not isinstance(reply, BaseException):
            sorted_replies.good.append((worker, reply))
        elif isinstance(reply, InputRejected):
            sorted_replies.rejected.append((worker, reply))
        elif isinstance(reply, (WorkerLost, asyncio.TimeoutError)):
            sorted_replies.lost.append((worker, reply))
        else:
            raise reply
    return sorted_replies


async def ask_all(workers: Sequence[W], call: Callable[[W], Awaitable[R]], timeout: float | None,
                  check: Callable[[R], None] | None = None) -> Replies[W, R]:
    """call(worker) for every worker at once, each within `timeout`; the answers sorted (sort_replies)."""
    replies = await asyncio.gather(*(with_deadline(call(w), timeout) for w in workers), return_exceptions=True)
    return sort_replies(workers, replies, check)


def crashing(on_iteration: Callable[[IterationRecord], None] | None, crash_every: int | None,
             alive: Callable[[], list],
             crash: Callable[[Any, int], None] | None = None) -> Callable[[IterationRecord], None]:
    """The paper's crash experiment in one process: after every `crash_every` iterations the last live
    worker by rank (`alive()`, handles with crash()) fails, and its data leave with it. `crash(worker,
    iteration)`: how it fails, where more than `worker.crash()` is needed (MD-GAN: it leaves the roster)."""
    fail = crash or (lambda worker, t: worker.crash())

    def after(record: IterationRecord) -> None:
        if on_iteration is not None:
            on_iteration(record)
        if crash_every and record.iteration % crash_every == 0:
            living = alive()
            if living:
                fail(living[-1], record.iteration)

    return after


@dataclass(frozen=True)
class Emulation:
    """Failures and attackers emulated in a run.

    crash_every: the paper's crash experiment (the algorithms whose registry entry has `crashes`): every
    this many iterations one more worker fails (the last by rank), and its data leaves with it.
    churn: durable algorithms (MD-GAN), [(iteration, "leave" | "join", slot)]: at that iteration boundary
    the worker of that slot leaves, or comes back (with its saved state if it has one, else a copy of a
    live peer's discriminator), through the same roster as over gRPC.
    byzantine, attack: MD-GAN, the last `byzantine` workers by rank send wrong feedback (mdgan/attacks.py),
    to measure the robust aggregation rules."""

    crash_every: int | None = None
    churn: list[tuple[int, str, int]] | None = None
    byzantine: int = 0
    attack: str | None = None


@dataclass
class InProcessRun:
    """Everything an algorithm's in-process run (`mdgan simulate`) is given; what it does not use
    was refused before (mdgan.algorithms.refuse)."""

    config: TrainingConfig
    shards: list[Shard]  # worker i's data: shards[i]
    generator: GeneratorSide  # the server's G: the run's outputs and evaluation are taken from it
    recorder: RunRecorder  # history.jsonl, swaps.jsonl, the evaluations
    out_dir: str
    run: RunStart  # run id, and the checkpoint it resumes from (durable algorithms)
    options: Any = None  # the algorithm's own options (Algorithm.options), checked
    emulation: Emulation = Emulation()  # crashes, churn and attackers
    checkpoint_every: int = 0
    keep_checkpoints: int = 3
    # when given, filled at the end with worker id -> the discriminator each worker last held (MD-GAN,
    # the standalone GAN) or last sent to be averaged (FL-GAN): what `mdgan audit` attacks
    discriminators: dict | None = None
    # train only the run's first this many iterations (experiments/replay.py); None: all of config.iterations
    stop_after: int | None = None

    # the id the sites' ledgers are kept under when the run has none (an algorithm that does not resume)
    start_id: str = field(default_factory=lambda: f"start-{uuid.uuid4().hex[:12]}")

    def sites_root(self) -> str:
        """Where each in-process site keeps its own folder (worker-K: its privacy ledger)."""
        return os.path.join(self.out_dir, "sites")

    def ledger_run_id(self) -> str:
        """The run the sites' ledgers count for: the run's id, or this start's for a run without one."""
        return self.run.run_id or self.start_id


def last_iteration(config: TrainingConfig, stop_after: int | None) -> int:
    """Where a loop stops: the run's I, or its first `stop_after` iterations of it. The run stays one of I
    iterations (FL-GAN's rounds, async's last drain): its records up to there are the whole run's."""
    return config.iterations if stop_after is None else stop_after


@dataclass(frozen=True)
class Algorithm:
    """What the rest of the project needs to know of one algorithm."""

    name: str
    title: str  # for --help and reports
    run_in_process: Callable[[InProcessRun], RunResult]  # `mdgan simulate`: the whole run in this process
    # payload bytes one worker sends and receives per iteration, by direction: (config, shard size m, options)
    per_worker_per_iteration: Callable[[TrainingConfig, int, object], dict[str, float]]
    # a finished run's traffic by its formula: (summary, history, swaps) -> (formula, lower bound, at float32)
    run_traffic: Callable[[dict, list, list], tuple[dict, dict, dict]] | None = None
    options: type | None = None  # its own options: a dataclass whose fields carry their flag (see pwgan.py)
    served: bool = True  # runs over the services (mdgan local, mdgan-server); False: it has no workers
    durable: bool = False  # checkpoints and resume over the services too, and churn
    resumable: bool = False  # checkpoints and resume in one process (`mdgan simulate`, experiments)
    attackers: bool = False  # emulated Byzantine workers (--byzantine, --attack)
    crashes: bool = True  # the paper's crash experiment (a worker fails every I/N iterations)
    whole_dataset: bool = False  # one G and one D on the whole dataset: no sites, one "worker"
    private: tuple[str, ...] = ()  # the DP mechanisms it implements (--dp-mechanism, mdgan/privacy.py)

    def default_options(self):
        """Its options with their defaults (None: it has none)."""
        return None if self.options is None else self.options()

    def option_fields(self) -> tuple:
        return () if self.options is None else dataclasses.fields(self.options)

    def options_from(self, settings) -> object:
        """Its options from a mapping of settings keyed by option_key (parsed flags, an experiment's run);
        None when it has none."""
        if self.options is None:
            return None
        return self.options(**{f.name: settings[option_key(f)] for f in self.option_fields()})
