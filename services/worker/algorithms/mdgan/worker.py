"""MD-GAN on a worker: a discriminator on the local shard. Takes batches (answers feedback) and
checkpoint orders; swap orders, installs and cancels go to the session's WorkerSwaps (swaps.py).
Emulates a Byzantine worker or a straggler on demand."""

from __future__ import annotations

import asyncio
import logging
import math
import time

from mdgan import compression
from mdgan.algorithms.mdgan.private_feedback import worker_side
from mdgan.attacks import make_attacks
from mdgan.config import ConfigError, TrainingConfig
from mdgan.data import Shard
from mdgan.gan import WorkerBatch
from mdgan import privacy
from mdgan.step_results import STATS, read_stats
from services.common import codec
from services.common.proto import coordinator_pb2 as pb
from services.common import wire as wire_traffic
from services.worker.algorithms.base import BudgetSpent, ServerGone, WorkerAlgorithm
from services.worker.algorithms.mdgan.swaps import WorkerSwaps

log = logging.getLogger("mdgan.worker")


def wire_stats(result) -> pb.StepStats:
    """What a step's StepStats carry: its released statistics (a withheld one, NaN, is left out: 0 on the wire), and
    what the site has spent (epsilon, delta; 0 and 0 when not private) and whether its noise was fixed."""
    stats = {name: value for name in STATS if math.isfinite(value := getattr(result, name))}
    if math.isfinite(result.delta):
        stats.update(epsilon=result.epsilon, delta=result.delta, fixed_noise=result.fixed_noise)
    return pb.StepStats(**stats)


class MDGANWorker(WorkerAlgorithm):
    name = "mdgan"

    def __init__(self, node, config: TrainingConfig, shard: Shard):
        super().__init__(node, config, shard)
        self.side = worker_side(config, shard, node.run_state.privacy_ledger(config))
        if self.side.private is not None:
            site = self.side.private.site
            cap = privacy.budget(site, node.policy.dp_max_epsilon)
            log.info("differentially private (%s, %d discriminator%s): sigma %.4g, C %g, q %.4g, delta %g, budget %s; "
                     "spent so far %.4g; withheld from the server: %s", site.mechanism, site.discriminators,
                     "s" if site.discriminators > 1 else "", site.noise_multiplier, site.max_grad_norm,
                     site.sample_rate, site.delta, f"{cap:g}" if math.isfinite(cap) else "none",
                     self.side.private.epsilon(), ", ".join(privacy.withheld_stats(config.privacy)))
        # Emulation for experiments (mdgan-worker --attack, --slow-factor): a Byzantine worker, a straggler.
        self.attack, self.discriminator_attack = make_attacks(node.policy.attack, config.seed, shard.index)
        if node.policy.attack:
            log.warning("emulating a Byzantine worker: %s %s", node.policy.attack,
                        "discriminators" if self.discriminator_attack else "feedback")
        self.slow_factor = node.policy.slow_factor
        self.swaps = WorkerSwaps(node, self.side, self.discriminator_attack)  # the session's (welcome)

    def final_discriminator(self) -> dict:
        return self.side.discriminator.state_dict()

    def continues(self, config: TrainingConfig) -> bool:
        return self.side.config == config  # back in the same run: keep our discriminator

    async def welcome(self, welcome: pb.Welcome) -> None:
        """The swap rounds done, our own saved state or a copy to wait for."""
        node = self.node
        try:
            swap_check = codec.options_from_spec(welcome.spec, "mdgan", swap_check=node.policy.swap_check).as_check()
        except ConfigError as exc:
            raise ServerGone(f"the server's swap check settings are invalid: {exc}") from exc
        await self.swaps.end()
        self.swaps = WorkerSwaps(node, self.side, self.discriminator_attack, swap_check, welcome.swap_round,
                                 welcome.copy, welcome.members)
        node.run_state.remember()
        if welcome.restore_iteration:
            store = node.run_state.store()
            if store is None:
                raise ServerGone(f"asked to restore iteration {welcome.restore_iteration} but keeping no state")
            state = await asyncio.to_thread(store.load, welcome.restore_iteration, "worker")
            self.side.load_state_dict(state)
            self.trained_iteration = welcome.restore_iteration
            log.info("restored our state of iteration %d", welcome.restore_iteration)
        elif welcome.copy:
            log.info("waiting for a copy of a live peer's discriminator")

    def receivers(self):
        return {"batches": self._on_batches, "checkpoint": self._on_checkpoint,
                "swap_order": self._on_swap_order, "swap_install": self._on_swap_install,
                "swap_cancel": self._on_swap_cancel}

    def peer_inbox(self) -> WorkerSwaps:
        return self.swaps

    async def _on_swap_order(self, call, order: pb.SwapOrder) -> None:
        await self.swaps.on_order(call, order)

    async def _on_swap_install(self, call, install: pb.SwapInstall) -> None:
        await self.swaps.on_install(call, install)

    async def _on_swap_cancel(self, call, cancel: pb.SwapCancel) -> None:
        await self.swaps.on_cancel(call, cancel)

    traffic = staticmethod(wire_traffic.mdgan)  # (kind, payload bytes) of its messages, as both sides count them

    async def end_session(self) -> None:
        await self.swaps.end()

    # -- batches -> feedback -----------------------------------------------------------------
    async def _on_batches(self, call, batches: pb.Batches) -> None:
        config = self.side.config
        shape = (config.batch_size, *config.model.sample_shape)
        classes, conditional = config.model.num_classes, config.model.conditional
        wire = config.wire_dtype
        try:  # the server's input is checked like anyone's
            batch = WorkerBatch(
                generated=codec.decode_packed(batches.generated, shape=shape, wire_dtype=wire, field="generated"),
                generated_labels=codec.decode_labels(batches.generated_labels, shape[0], classes, "generated_labels")
                if conditional else None,
                discriminated=codec.decode_packed(batches.discriminated, shape=shape, wire_dtype=wire,
                                                  field="discriminated"),
                discriminated_labels=codec.decode_labels(batches.discriminated_labels, shape[0], classes,
                                                         "discriminated_labels") if conditional else None,
                generated_index=0)
        except codec.InvalidTensor as exc:
            raise ServerGone(f"the server sent an invalid batch: {exc}") from exc
        # One yield after decoding and one before writing: workers sharing a process
        # (--workers-per-process) get their batches together, so the loop then decodes them all,
        # steps them all, and encodes and writes them all, each phase's code warm in the caches,
        # instead of alternating message code and torch worker by worker: about 3% less CPU per
        # iteration at N=10 (docs/PERFORMANCE.md). No message of the server's is read
        # meanwhile (the read loop awaits this handler); what a background task does during a yield
        # (a peer's push, a late swap) is as if done before this batch (the decoded batch does not
        # depend on our D) or after this feedback (computed before the second yield).
        await asyncio.sleep(0)
        private = self.side.private
        refusal = privacy.over_budget(private, self.node.policy.dp_max_epsilon) if private is not None else None
        if refusal is not None:  # the site stops answering and leaves; the run goes on as membership says
            raise BudgetSpent(f"iteration {batches.iteration}: {refusal}")
        started = time.perf_counter()
        # On the event loop's own thread: a step takes milliseconds, and a hop to a worker thread
        # and back (two thread wake-ups per iteration) cost a measurable share of them. Peers and
        # heartbeats wait at most one step; the server sends nothing else until this feedback.
        (result,) = read_stats([self.side.step(batch)])  # (the wire carries them: one read a step)
        self.trained_iteration = batches.iteration
        if self.slow_factor > 1:  # an emulated straggler
            await asyncio.sleep((self.slow_factor - 1) * (time.perf_counter() - started))
        feedback = result.feedback if self.attack is None else self.attack(result.feedback)
        await asyncio.sleep(0)  # the other workers' steps first (above)
        await self.node.write(call, pb.WorkerMessage(feedback=pb.Feedback(
            iteration=batches.iteration, gradient=codec.encode_packed(compression.pack(feedback, wire)),
            stats=wire_stats(privacy.released(result, config.privacy)))))
        t = self.node.telemetry
        t.iterations.inc()
        t.iteration_seconds.observe(time.perf_counter() - started)
        t.phase_seconds.labels("disc_steps").observe(result.disc_seconds)
        t.phase_seconds.labels("feedback").observe(result.feedback_seconds)
        t.generator_loss.set(result.gen_loss)
        t.discriminator_loss.set(result.disc_loss)
        t.discriminator_accuracy.labels("real").set(result.real_accuracy)
        t.discriminator_accuracy.labels("generated").set(result.fake_accuracy)
        if private is not None:
            t.privacy_epsilon.set(result.epsilon)
        t.last_iteration.set_to_current_time()

    # -- checkpoints -------------------------------------------------------------------------
    async def _on_checkpoint(self, call, order: pb.CheckpointOrder) -> None:
        node, error = self.node, ""
        if not node.run_state.state_dir:
            error = "this worker keeps no state (no --state-dir)"
        elif order.run_id != node.run_state.run_id:
            error = f"checkpoint for run {order.run_id!r}, this worker is in run {node.run_state.run_id!r}"
        else:
            try:  # in a thread: the event loop goes on serving peers and heartbeats
                await asyncio.to_thread(self._save_state, order.iteration)
            except OSError as exc:
                error = f"could not write state: {exc}"
        if error:
            log.error("checkpoint %d: %s", order.iteration, error)
        await node.write(call, pb.WorkerMessage(checkpoint_done=pb.CheckpointDone(
            iteration=order.iteration, ok=not error, error=error)))

    def _save_state(self, iteration: int) -> None:
        store = self.node.run_state.store()
        store.save(iteration, "worker", self.side.state_dict())
        store.prune(marker=None)

