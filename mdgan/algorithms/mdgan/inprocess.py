"""MD-GAN in one process: every worker a DiscriminatorSide behind an in-process handle, swaps through
a mailbox board, and the whole `mdgan simulate` run (churn, crashes, checkpoints and resume) over the
same Trainer and Roster as the gRPC server's."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
from typing import Callable

import torch

from mdgan import compression, devices, privacy
from mdgan.algorithms.base import InProcessRun, RunResult, WorkerLost, crashing
from mdgan.algorithms.mdgan.checkpoints import ServerCheckpoints
from mdgan.algorithms.mdgan.options import MDGANOptions
from mdgan.algorithms.mdgan.private_feedback import PrivateFeedbackSide, worker_side
from mdgan.algorithms.mdgan.swapcheck import SwapCheck, check_incoming
from mdgan.algorithms.mdgan.trainer import (COPY, SWAP, SwapOrder, SwapReport, Trainer, TrainerHooks, TrainerPlan,
                                           WorkerHandle)
from mdgan.checkpoint import CheckpointStore
from mdgan.config import ConfigError, TrainingConfig, named
from mdgan.cuda_lanes import Lanes
from mdgan.gan import DiscriminatorSide, WorkerBatch
from mdgan.privacy_ledger import site_ledger
from mdgan.roster import Roster
from mdgan.step_results import StepResult

log = logging.getLogger(__name__)




class InProcessSwapBoard:
    """Peer-to-peer delivery between in-process workers: one mailbox per (round, receiver)."""

    def __init__(self) -> None:
        self._boxes: dict[tuple[int, str], asyncio.Future] = {}

    def _box(self, swap_round: int, receiver: str) -> asyncio.Future:
        return self._boxes.setdefault((swap_round, receiver), asyncio.get_running_loop().create_future())

    def deliver(self, swap_round: int, receiver: str, sender: str, state: dict[str, torch.Tensor] | None) -> None:
        """`state` None: the sender left, nothing will come."""
        box = self._box(swap_round, receiver)
        if not box.done():
            box.set_result((sender, state))

    async def collect(self, swap_round: int, receiver: str, timeout: float) -> tuple[str, dict[str, torch.Tensor]]:
        try:
            return await asyncio.wait_for(self._box(swap_round, receiver), timeout)
        finally:
            self._boxes.pop((swap_round, receiver), None)


class InProcessWorker(WorkerHandle):
    def __init__(self, side: DiscriminatorSide | PrivateFeedbackSide, board: InProcessSwapBoard, swap_timeout: float = 60.0,
                 state: CheckpointStore | None = None,
                 attack: Callable[[torch.Tensor], torch.Tensor] | None = None,
                 swap_check: SwapCheck = SwapCheck(),
                 discriminator_attack: Callable[[dict], dict] | None = None, lanes: Lanes | None = None):
        self.side = side
        self.lanes = lanes or Lanes(devices.resolve(side.config.device))
        self.lane = self.lanes.lane()  # on CUDA, its steps on a stream of their own (mdgan/cuda_lanes.py)
        self.attack = attack  # an emulated Byzantine worker (mdgan/attacks.py) replaces its feedback
        self.discriminator_attack = discriminator_attack  # ... or the discriminator it pushes at a swap
        self.swap_check = swap_check  # what it installs (mdgan/algorithms/mdgan/swapcheck.py)
        self.board = board
        self.swap_timeout = swap_timeout
        self.shard_index = side.shard_index
        self.worker_id = f"worker-{side.shard_index}"
        self.shard = side.shard
        self.shard_size = len(self.shard)
        self.crashed = False
        self.state = state  # where this worker saves its checkpoints (its own state dir)
        self._sent: dict[int, int] = {}  # swap round -> payload bytes sent, until the round is installed
        self.on_budget_spent: Callable[[str], None] | None = None  # told why, when the site stops at its budget

    def crash(self) -> None:
        """Emulate the paper's crash experiment: the worker and its data leave the run."""
        self.crashed = True

    async def step(self, iteration: int, batch: WorkerBatch) -> StepResult:
        if self.crashed:
            raise WorkerLost(f"{self.worker_id} crashed")
        private = self.side.private
        refusal = privacy.over_budget(private) if private is not None else None
        if refusal is not None:  # the site stops answering; the run goes on without it as membership says
            self.crashed = True
            log.warning("%s: %s", self.worker_id, refusal)
            if self.on_budget_spent is not None:
                self.on_budget_spent(refusal)
            raise WorkerLost(f"{self.worker_id}: {refusal}")
        # The same rounding at the same points as over gRPC: the batches, then the feedback.
        wire = self.side.config.wire_dtype
        inputs = [batch.generated, batch.generated_labels, batch.discriminated, batch.discriminated_labels]
        with self.lane.step((iteration, batch.generation), inputs):
            result = self.side.step(dataclasses.replace(
                batch, generated=compression.round_trip(batch.generated, wire),
                discriminated=compression.round_trip(batch.discriminated, wire)))
            feedback = result.feedback if self.attack is None else self.attack(result.feedback)
            result = dataclasses.replace(result, feedback=compression.round_trip(feedback, wire))
        self.lane.handover([result.feedback, result.disc_loss, result.gen_loss, result.real_accuracy,
                            result.fake_accuracy])
        return privacy.released(result, self.side.config.privacy)  # (what a private site's message carries)

    async def send_step(self, iteration: int, batch: WorkerBatch) -> asyncio.Future:
        """In one process the step is taken now, in the order sent, as a worker takes its batches."""
        answer = asyncio.get_running_loop().create_future()
        answer.set_result(await self.step(iteration, batch))  # (crashed: WorkerLost, raised here)
        return answer

    async def swap(self, order: SwapOrder) -> SwapReport:
        if self.crashed:
            raise WorkerLost(f"{self.worker_id} crashed")
        if order.kind == COPY:
            return await self._copy(order)
        await self.send_swap(order)
        return await self.install_swap(order)

    async def send_swap(self, order: SwapOrder) -> None:
        if self.crashed:
            raise WorkerLost(f"{self.worker_id} crashed")
        state, sent = self._outgoing_state(self.discriminator_attack)
        self.board.deliver(order.swap_round, order.send_to, self.worker_id, state)
        self._sent[order.swap_round] = sent

    async def install_swap(self, order: SwapOrder) -> SwapReport:
        if self.crashed:
            raise WorkerLost(f"{self.worker_id} crashed")
        sent = self._sent.pop(order.swap_round)
        try:
            sender, incoming = await self.board.collect(order.swap_round, self.worker_id, self.swap_timeout)
        except asyncio.TimeoutError:
            return SwapReport(order.swap_round, True, False, sent, "no discriminator arrived")
        if sender != order.receive_from or incoming is None:
            return SwapReport(order.swap_round, True, False, sent, f"nothing usable from {sender}")
        if self.swap_check.enabled:  # against our D as it is now, about to be replaced (on every transport)
            verdict = check_incoming(self.side, incoming, self.swap_check)
            if verdict.refused:  # we keep our own D for this round
                return SwapReport(order.swap_round, True, False, sent,
                                  f"refused the discriminator from {sender}: {verdict.refused}", refused=verdict.refused)
        self.side.import_state(incoming)
        return SwapReport(order.swap_round, True, True, sent)

    def _outgoing_state(self, attack=None) -> tuple[dict[str, torch.Tensor], int]:
        """This worker's D as its receiver gets it (rounded to the wire dtype, as over gRPC), and the
        payload bytes that travel; `attack`: an emulated Byzantine worker's replacement of it."""
        wire = self.side.config.wire_dtype
        exported = self.side.export_state()
        packed = compression.pack_state(exported if attack is None else attack(exported), wire)
        return compression.unpack_state(packed, self.side.state_layout(), wire), compression.state_nbytes(packed)

    @staticmethod
    def _mailbox(swap_round: int, kind: str) -> int:
        """The board's key: copies have their own mailboxes, apart from swap rounds."""
        return -swap_round if kind == COPY else swap_round

    async def _copy(self, order: SwapOrder) -> SwapReport:
        key = self._mailbox(order.swap_round, COPY)
        if order.send_to:
            state, sent = self._outgoing_state()
            self.board.deliver(key, order.send_to, self.worker_id, state)
            return SwapReport(order.swap_round, True, False, sent)
        try:
            sender, incoming = await self.board.collect(key, self.worker_id, self.swap_timeout)
        except asyncio.TimeoutError:
            return SwapReport(order.swap_round, False, False, 0, "no discriminator arrived")
        if sender != order.receive_from or incoming is None:
            return SwapReport(order.swap_round, False, False, 0, f"nothing usable from {sender}")
        self.side.adopt(incoming)
        return SwapReport(order.swap_round, False, True, 0)

    async def cancel_swap(self, swap_round: int, sender: str, reason: str, kind: str = SWAP) -> None:
        self.board.deliver(self._mailbox(swap_round, kind), self.worker_id, sender, None)

    async def checkpoint(self, iteration: int) -> str | None:
        if self.crashed:
            raise WorkerLost(f"{self.worker_id} crashed")
        if self.state is None:
            return "this worker keeps no state"
        self.state.save(iteration, "worker", self.side.state_dict())
        self.state.prune(marker=None)
        return None

    async def stop(self, reason: str) -> None:
        return None




def site_side(config: TrainingConfig, shard, sites_root: str | None, run_id: str):
    """Site k's discriminator side; a private site's ledger in its own folder, sites_root/worker-k (read back if
    the site has one: a rejoin, a resume), or in memory without a sites_root."""
    return worker_side(config, shard, site_ledger(config.privacy, shard.index, sites_root, run_id))


def build_in_process_workers(config: TrainingConfig, shards, state_root: str | None = None, keep: int = 3,
                             byzantine: int = 0, attack: str | None = None,
                             swap_check: SwapCheck = SwapCheck(), sites_root: str | None = None,
                             run_id: str = "") -> list[InProcessWorker]:
    """One in-process worker per shard; with state_root, worker k keeps its state in state_root/worker-k, with
    sites_root a private site its ledger in sites_root/worker-k; the last `byzantine` by rank replace their
    feedback (or the discriminator they push) by `attack`."""
    from mdgan.attacks import attackers, make_attacks

    bad = set(attackers(len(shards), byzantine)) if attack else set()
    board = InProcessSwapBoard()
    lanes = Lanes(devices.resolve(config.device))
    workers = []
    for shard in shards:
        feedback_attack, discriminator_attack = make_attacks(attack if shard.index in bad else None, config.seed,
                                                             shard.index)
        workers.append(InProcessWorker(
            site_side(config, shard, sites_root, run_id), board,
            state=CheckpointStore(f"{state_root}/worker-{shard.index}", keep) if state_root else None,
            attack=feedback_attack, swap_check=swap_check, discriminator_attack=discriminator_attack, lanes=lanes))
    return workers


def parse_churn(text: str | None) -> list[tuple[int, str, int]]:
    """--churn "leave:300:2,join:450:2": (iteration boundary, leave|join, slot), in order."""
    events = []
    for item in filter(None, (text or "").replace(" ", "").split(",")):
        parts = item.split(":")
        if len(parts) != 3 or parts[0] not in ("leave", "join") or not parts[1].isdigit() or not parts[2].isdigit():
            raise ConfigError(f"{named('churn')}: {item!r} is not leave:ITERATION:SLOT or join:ITERATION:SLOT")
        events.append((int(parts[1]), parts[0], int(parts[2])))
    return sorted(events)


def run_in_process(run: InProcessRun) -> RunResult:
    """MD-GAN in one process (`mdgan simulate`): every worker an object, the same Trainer and Roster as
    the gRPC server's; churn, crashes, checkpoints and resume as run asks."""
    return asyncio.run(_run(run))


async def _run(run: InProcessRun) -> RunResult:
    config, shards, generator_side, recorder = run.config, run.shards, run.generator, run.recorder
    keep, checkpoint_every, churn = run.keep_checkpoints, run.checkpoint_every, list(run.emulation.churn or [])
    state_root = os.path.join(run.out_dir, "workers", run.run.run_id)
    options = run.options or MDGANOptions()
    swap_check = options.as_check()
    sites_root = run.sites_root()
    workers = build_in_process_workers(config, shards, state_root, keep, run.emulation.byzantine,
                                       run.emulation.attack, swap_check, sites_root, run.ledger_run_id())
    by_slot = {w.shard_index: w for w in workers}
    roster = Roster(config.workers, pause_timeout=0, copies=not config.privacy.keeps_discriminators)
    saver = ServerCheckpoints(run.out_dir, run.run.run_id, keep)
    plan = TrainerPlan(checkpoint_every=checkpoint_every, swap_lag=options.swap_lag,
                       pipeline_depth=options.pipeline_depth, stop_after=run.stop_after)
    hooks = TrainerHooks(on_swap=recorder.swap,
                         save_checkpoint=lambda t, ok: saver.save(t, ok, generator_side, trainer, recorder))
    trainer = Trainer(config, generator_side, roster=roster, plan=plan, hooks=hooks)
    if run.run.state is not None:
        ServerCheckpoints.restore(run.run.state, generator_side, trainer, recorder)

    def arrive(worker) -> None:
        plan = roster.rejoin_plan(worker.state.holding("worker"), trained=0)
        if plan.restore:
            worker.side.load_state_dict(worker.state.load(plan.restore, "worker"))
        worker.needs_copy = plan.copy
        worker.on_budget_spent = lambda _why: roster.fault(worker.shard_index, worker.worker_id,
                                                           "stopped at their privacy budget")
        roster.arrive(worker.shard_index, worker.worker_id, worker)

    alive_at_start = roster.expected if roster.expected is not None else set(by_slot)
    for slot in sorted(alive_at_start):
        arrive(by_slot[slot])

    def leave(worker, t: int, why: str) -> None:
        # Off the roster at once (a churn departure, a crash): otherwise the next iteration still generates
        # its batches, unless a checkpoint at this iteration found it gone first (and was incomplete for
        # it), so where the checkpoints fall would change the run.
        if roster.depart(worker):
            worker.crash()
            log.info("%s: %s leaves after iteration %d", why, worker.worker_id, t)

    on_iteration = crashing(recorder, run.emulation.crash_every, roster.alive, lambda worker, t: leave(worker, t, "crash"))

    def on_boundary(t: int) -> None:
        for _ in range(len(churn)):
            if churn[0][0] > t:
                break
            at, action, slot = churn.pop(0)
            if at < t:
                continue  # before the checkpoint this run resumed from
            if slot not in by_slot:
                raise ConfigError(f"{named('churn')}: no slot {slot} in a run of {config.workers} workers")
            current = by_slot[slot]
            if action == "leave":
                leave(current, t, "churn")
            elif action == "join" and roster.slot_of(current) is None:
                fresh = type(current)(site_side(config, current.shard, sites_root, run.ledger_run_id()), current.board,
                                      current.swap_timeout, state=current.state, attack=current.attack,
                                      swap_check=current.swap_check, discriminator_attack=current.discriminator_attack,
                                      lanes=current.lanes)
                by_slot[slot] = fresh
                arrive(fresh)
                log.info("churn: worker-%d joins at iteration %d (%s)", slot, t,
                         "copy" if fresh.needs_copy else "own state")

    trainer.on_iteration = on_iteration
    trainer.on_boundary = on_boundary
    result = await trainer.run()
    if run.discriminators is not None:
        for slot, worker in sorted(by_slot.items()):
            run.discriminators[worker.worker_id] = {k: v.detach().clone()
                                                    for k, v in worker.side.discriminator.state_dict().items()}
    return result
