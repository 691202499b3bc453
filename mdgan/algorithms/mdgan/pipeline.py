"""--pipeline-depth D: D iterations of batches in flight, so a round trip to the workers no longer
sets the pace of G.

Iteration t sends the batches of iteration t (from the current G) to every member, then updates G
with the feedback on the batches of iteration t - D: their noise (and labels) through the current G,
the feedback summed in rank order as in the paper's iteration. A worker answers its batches in the
order they came, and whatever else the server sends it (a swap order, a copy, a checkpoint order)
comes after the batches before it, on the same stream; in one process `send_step` computes at once.
So every D step, swap and checkpoint happens at the same point on every transport: `mdgan local` ==
`mdgan simulate` bit for bit at any depth.

Iterations 1..D update no G (the pipeline fills), and the feedback on the last D iterations' batches
trains no G (those batches trained the discriminators). A checkpoint at boundary t waits for every
answer out and keeps the ones not used yet (iterations t-D+1..t) with their noise, so a resumed run
goes on as the uninterrupted one would. An answer is due `step_timeout` seconds after its batches left.
Depth 0 is not this module: iterations.py's Synchronous, the paper's protocol.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from dataclasses import dataclass, field

import torch

from mdgan.algorithms.base import InputRejected, WorkerLost, sort_replies, why_lost
from mdgan.algorithms.mdgan.exchange import Exchanged, IterationStrategy
from mdgan.algorithms.mdgan.handle import WorkerHandle
from mdgan.gan import GeneratedBatches, WorkerBatch
from mdgan.step_results import StepResult, read_stats

log = logging.getLogger("mdgan.algorithms.mdgan.trainer")  # (the training loop's lines, one logger)


@dataclass
class Sent:
    """One worker's batches of an iteration, and its answer to come: a StepResult, or WorkerLost,
    InputRejected or asyncio.TimeoutError."""

    worker: WorkerHandle | None  # None: restored from a checkpoint (its outcome is in)
    worker_id: str
    generated_index: int  # which of the kappa batches its feedback is on
    answer: asyncio.Future | None = None  # the answer to come (None: `outcome` holds it)
    outcome: object = None

    @property
    def settled(self) -> bool:
        return self.answer is None or self.answer.done()

    def reply(self) -> object:
        """The answer or its exception (settled only)."""
        if self.answer is None:
            return self.outcome
        return self.answer.exception() or self.answer.result()


@dataclass
class InFlight:
    """An iteration's batches, sent; their feedback moves G D iterations later."""

    iteration: int
    batches: GeneratedBatches  # no graph: the noise goes through G again when the feedback is used
    sent: list[Sent] = field(default_factory=list)  # rank order
    due: float = float("inf")  # the event loop's time by which every answer is due


class Pipeline(IterationStrategy):
    """The batches in flight of a run with --pipeline-depth D > 0, oldest first."""

    def __init__(self, depth: int):
        self.depth = depth
        self.flights: list[InFlight] = []

    async def exchange(self, trainer, t: int) -> Exchanged:
        """Iteration t: its batches out, and G updated with the feedback on those of t - D."""
        started = time.perf_counter()
        active = [w for w in trainer.roster.members() if not w.needs_copy]
        lost = await self.send(trainer, t, active)
        sent = time.perf_counter()
        used = await self.use(trainer, t)
        used.stats = read_stats(used.stats)
        used.issued, used.lost, used.generate_seconds = len(active), lost + used.lost, sent - started
        return used

    async def send(self, trainer, t: int, active: list[WorkerHandle]) -> int:
        """The batches of iteration t, from the current G, to `active` (rank order); the workers lost."""
        with torch.no_grad():  # (no graph is kept: the feedback is pushed through a fresh one)
            batches = trainer.generator.generate(min(trainer.config.kappa, len(active)))
        timeout = trainer.step_timeout
        flight = InFlight(t, batches, due=asyncio.get_running_loop().time() + timeout if timeout else float("inf"))
        sent_batches = [batches.for_worker(rank) for rank in range(len(active))]
        flight.sent = list(await asyncio.gather(*(self._send(worker, t, batch)
                                                  for worker, batch in zip(active, sent_batches))))
        for batch in sent_batches:
            trainer.count_batch(batch)
        self.flights.append(flight)
        lost = 0
        for sent in flight.sent:  # a stream found broken on sending: the worker leaves now
            if isinstance(sent.outcome, WorkerLost):
                lost += await trainer.lose(sent.worker, why_lost(sent.outcome))
        return lost

    @staticmethod
    async def _send(worker: WorkerHandle, t: int, batch: WorkerBatch) -> Sent:
        sent = Sent(worker, worker.worker_id, batch.generated_index)
        try:
            sent.answer = await worker.send_step(t, batch)
        except WorkerLost as lost:  # (the worker leaves at once: send)
            sent.outcome = lost
        return sent

    async def use(self, trainer, t: int) -> Exchanged:
        """Iteration t's update of G: with the feedback on the batches of t - D, once every answer is in (the
        answers used, refused and lost, the seconds waiting and updating)."""
        if not self.flights or self.flights[0].iteration > t - self.depth:
            return Exchanged()
        flight = self.flights.pop(0)
        started = time.perf_counter()
        await self._settle(flight)
        waited = time.perf_counter()
        replies = sort_replies(flight.sent, [sent.reply() for sent in flight.sent])
        used = Exchanged(rejected=len(replies.rejected))
        feedback = []
        for sent, reply in replies.good:
            trainer.count_feedback(reply, sent.worker_id)
            feedback.append((sent.generated_index, reply.feedback))
            used.stats.append(reply)
        for sent, why in replies.rejected:
            log.warning("iteration %d: the answer of %s on the batches of iteration %d was refused (%s)", t,
                        sent.worker_id, flight.iteration, why)
        for sent, error in replies.lost:
            if sent.worker is not None:
                used.lost += await trainer.lose(sent.worker, why_lost(error))
        if feedback:  # rank order: the order the batches were sent in
            trainer.generator.update(trainer.generator.regenerate(flight.batches), feedback)
        used.wait_seconds, used.update_seconds = waited - started, time.perf_counter() - waited
        return used

    @staticmethod
    async def _settle(flight: InFlight) -> None:
        """Every answer of `flight` in, or failed: asyncio.TimeoutError once it is due."""
        pending = [sent.answer for sent in flight.sent if not sent.settled]
        if not pending:
            return
        try:
            async with asyncio.timeout_at(flight.due):
                await asyncio.wait(pending)
        except TimeoutError:
            for answer in pending:
                if not answer.done():
                    answer.set_exception(asyncio.TimeoutError())

    async def drain(self) -> None:
        """Every answer out in (a checkpoint holds them, not the futures that bring them)."""
        for flight in self.flights:
            await self._settle(flight)

    async def close(self, trainer, stopped: bool) -> None:
        if stopped:
            self.abandon()
        else:  # the feedback on the last D iterations' batches moves no G
            await self.finish(trainer)

    async def finish(self, trainer) -> None:
        """The run's end: the answers on the last D iterations' batches come in (the workers finish their
        steps before they hear the run is over) and are counted; they move no G."""
        await self.drain()
        for flight in self.flights:
            for sent in flight.sent:
                reply = sent.reply()
                if isinstance(reply, StepResult):
                    trainer.count_feedback(reply, sent.worker_id)
        self.flights.clear()

    def abandon(self) -> None:
        """The run ends with batches in flight: nobody uses their feedback (retrieved, so that no
        failed answer is reported as never retrieved)."""
        for flight in self.flights:
            for sent in flight.sent:
                if sent.answer is not None:
                    sent.answer.add_done_callback(lambda answer: answer.cancelled() or answer.exception())
        self.flights.clear()

    # -- durable state (settled first: drain) ---------------------------------------------------
    def state(self) -> dict:
        return {"pipeline": self.state_dict()}

    def restore(self, state: dict, generator) -> None:
        if "pipeline" not in state:
            raise ValueError("this checkpoint was written without --pipeline-depth: resume it with the depth "
                             "it was started with")
        self.load_state_dict(state["pipeline"], generator.device)

    def state_dict(self) -> list[dict]:
        """The batches in flight, each answer's outcome with them: a good one's feedback and stats, or why
        it failed."""
        flights = []
        for flight in self.flights:
            answers = []
            for sent in flight.sent:
                reply = sent.reply()
                entry = {"worker_id": sent.worker_id, "generated_index": sent.generated_index}
                if isinstance(reply, InputRejected):
                    entry["rejected"] = [reply.reason, reply.detail]
                elif isinstance(reply, BaseException):
                    entry["lost"] = why_lost(reply)
                else:
                    (result,) = read_stats([reply])
                    entry["result"] = {f.name: getattr(result, f.name) for f in dataclasses.fields(result)}
                answers.append(entry)
            batches = flight.batches
            flights.append({"iteration": flight.iteration, "samples": batches.samples, "labels": batches.labels,
                            "noise": batches.noise, "answers": answers})
        return flights

    def load_state_dict(self, flights: list[dict], device: torch.device) -> None:
        self.flights = []

        def on_device(tensor: torch.Tensor | None) -> torch.Tensor | None:
            return None if tensor is None else tensor.to(device)

        for state in flights:
            flight = InFlight(int(state["iteration"]), GeneratedBatches(
                on_device(state["samples"]), on_device(state["labels"]), on_device(state["noise"])))
            for entry in state["answers"]:
                if "result" in entry:
                    outcome = StepResult(**{**entry["result"], "feedback": on_device(entry["result"]["feedback"])})
                elif "rejected" in entry:
                    outcome = InputRejected(*entry["rejected"])
                else:
                    outcome = WorkerLost(entry["lost"])
                flight.sent.append(Sent(None, entry["worker_id"], int(entry["generated_index"]), outcome=outcome))
            self.flights.append(flight)
