"""A worker's connection to the server: join, welcome, heartbeats, reconnects with backoff, stop.

What the server's messages mean is the business of the run's algorithm (services/worker/algorithms/,
picked by the welcome's spec.algorithm): the node hands each message body to it. MD-GAN's
peer-to-peer part (the Peer service, mailboxes, push) is in services/worker/peer.py."""

from __future__ import annotations

import asyncio
import logging
import os
import random
import shutil
import time

import grpc
import torch

from dataclasses import dataclass, replace

from mdgan import checkpoint
from mdgan.checkpoint import CheckpointError, CheckpointStore
from mdgan.config import ConfigError, DataConfig, TrainingConfig
from mdgan.privacy_ledger import LedgerError, PrivacyLedger
from mdgan.data import Shard, take_shard
from mdgan.images import NUMERIC_CLASSES, SiteData
from mdgan.sites import map_labels
from mdgan.algorithms.base import RUN_FAILED, RUN_FINISHED
from services.common import rpc, tls as tls_, training_spec
from services.common.proto import coordinator_pb2 as pb
from services.common.proto import coordinator_pb2_grpc
from services.common.telemetry import Telemetry
from services.common.tls import TLSConfig
from services.worker.algorithms import ALGORITHMS
from services.worker.algorithms.base import (BudgetSpent, RunFailed, ServerGone, StreamBroken, WorkerAlgorithm,
                                             WorkerFailed)
from services.worker.faults import FaultReport
from services.worker.peer import PeerInbox

log = logging.getLogger("mdgan.worker")


class JoinRefused(Exception):
    """The server refused this worker for good (another run, another identity, a bad join)."""


class DroppedByServer(StreamBroken):
    """The server stopped this worker before the run's end: it missed a deadline, or its swap or
    checkpoint failed. Each is passing, and the run is elastic: the worker rejoins as after a broken
    stream, keeping its discriminator."""


class RunEnded(Exception):
    """The server says the run this worker holds has ended: it was away at the end and never told."""

    def __init__(self, run_id: str):
        super().__init__(run_id)
        self.run_id = run_id


# How a session ends on purpose; any other exception in the worker's own code is a fault (WorkerNode.fail).
ENDINGS = (ServerGone, BudgetSpent, JoinRefused, RunEnded, RunFailed, WorkerFailed)


# Join refusals that retrying cannot change; anything else (UNAVAILABLE while the server restarts,
# ALREADY_EXISTS while it has not yet noticed our previous stream died, ...) is retried.
FINAL_REFUSALS = {grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.PERMISSION_DENIED,
                  grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.UNAUTHENTICATED,
                  grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNIMPLEMENTED}


CONNECT_TRY_S = 5.0  # how long one connection attempt may take


def backoff_delays(base: float = 0.5, cap: float = 10.0):
    """Exponential backoff with jitter: 0.5, 1, 2, ... capped at 10 s, each scaled by U(0.5, 1) so
    workers that lost the same server do not all knock again at the same instant."""
    attempt = 0
    while True:
        yield min(cap, base * 2 ** attempt) * random.uniform(0.5, 1.0)
        attempt += 1


async def _why_unreachable(channel: grpc.aio.Channel) -> str:
    """': REASON' when a failed connection's cause means something to an operator (a TLS handshake that
    failed: another PKI's certificate, a clock, a name); '' for a server that is simply not there."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from services.common import pki

    try:
        await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=2.0)
    except grpc.aio.AioRpcError as exc:
        meaning = pki.explain_handshake(exc.details() or "")
        return f": {meaning}" if meaning else ""
    return ""


@dataclass(frozen=True)
class WorkerData:
    """What a worker trains on: exactly one of its site's own data (shaped for the model once the server's
    spec arrives; its slot chosen by the operator, or None: by the server), its shard of a shared dataset
    (emulation; index chosen by the operator), or the whole shared dataset it will cut its shard from
    once the server assigns an index."""

    shard: Shard | None = None
    dataset: tuple[torch.Tensor, torch.Tensor, DataConfig] | None = None
    site: SiteData | None = None
    slot: int | None = None
    # how the shared dataset an emulated worker's shard comes from was cut (the server records it for
    # `mdgan audit`); a worker assigned its shard has it with its dataset
    split: DataConfig | None = None

    def __post_init__(self):
        if sum(x is not None for x in (self.shard, self.dataset, self.site)) != 1:
            raise ValueError("give a site's data, a shard, or a dataset to take the assigned shard from")


@dataclass(frozen=True)
class ServerLink:
    """How a worker reaches its server, who it is to it, and how long it waits for it."""

    address: str
    tls: TLSConfig | None = None  # None: --insecure
    identity: str = ""  # "" : the certificate's
    server_name: str | None = None
    connect_timeout: float = 300.0
    server_timeout: float = 120.0
    run_deadline: float = 7 * 24 * 3600.0
    reconnect: bool = True


@dataclass(frozen=True)
class WorkerState:
    """Durable runs: where the worker keeps its state, how many checkpoints, and the run it is pinned to."""

    state_dir: str | None = None
    keep_checkpoints: int = 3
    run_id: str | None = None  # --run-id: join that run only


@dataclass(frozen=True)
class SitePolicy:
    """The site's own limits, and the emulations experiments use (mdgan-worker --attack, --slow-factor)."""

    swap_check: str | None = None  # this site's own --swap-check on|off; None: as the run says
    dp_max_epsilon: float = 0.0  # > 0: leave the run rather than spend more (DP runs)
    privacy_dir: str | None = None  # where the site keeps its privacy ledgers (None: its state dir)
    dp_fixed_noise: int | None = None  # research and tests only: the site's noise from this number, not a secret
    attack: str | None = None  # a Byzantine worker
    slow_factor: float = 1.0  # a straggler


SWAP_PATHS = ("auto", "direct", "relay")


class WorkerNode:
    """One worker's session with its server: what it trains on (WorkerData), how it reaches the server
    (ServerLink), its durable state (WorkerState) and its site's policy (SitePolicy)."""

    def __init__(self, link: ServerLink, data: WorkerData, *, advertise_address: str = "",
                 state: WorkerState = WorkerState(), policy: SitePolicy = SitePolicy(),
                 telemetry: Telemetry | None = None, device: str = "cpu"):
        self.shard = data.shard
        self.dataset = data.dataset
        self.split = data.split if data.split is not None else (data.dataset[2] if data.dataset is not None else None)
        self.site = data.site
        self._site_join: pb.Join | None = None  # a site's data facts, sent again on every rejoin
        self.slot = data.slot
        self.telemetry = telemetry or Telemetry("worker")
        self.device = device  # this worker's own choice; the run's spec does not carry one
        self.policy = policy
        self.server_address = link.address
        self.advertise_address = advertise_address  # (known once the Peer service listens)
        self.connect_timeout = link.connect_timeout
        self.server_timeout = link.server_timeout
        self.run_deadline = link.run_deadline
        self.algorithm: WorkerAlgorithm | None = None  # the run's, built at its first welcome
        self._traffic = WorkerAlgorithm.traffic
        self.worker_id = ""
        self._write_lock = asyncio.Lock()
        self.swap_timeout = 60.0
        self.tls = link.tls
        self.identity = link.identity or (link.tls.identity if link.tls else "")
        self.server_name = link.server_name
        # Durable runs: the run this worker is in, where it keeps its state, how far its D trained.
        self.state_dir = state.state_dir
        self.keep_checkpoints = state.keep_checkpoints
        self.reconnect = link.reconnect
        self.run_id = state.run_id or self._saved_run().get("run_id")
        self.pinned_run = state.run_id
        self.faults = FaultReport(lambda: self.worker_id or self.identity or "this worker", self.write)
        self._task: asyncio.Task | None = None  # the task running run(): a fault ends it
        self._call = None  # the Train stream of the session under way (None: between sessions)
        self.swaps = "direct"  # SWAP_PATHS: how discriminators reach this site
        self.peer_servicer = None  # the Peer service's receiving code, which relayed pushes go to as well
        self.server_channel: grpc.aio.Channel | None = None  # the session's channel (relayed pushes go over it)

    def peer_inbox(self):
        """The run's receiving side of pushed discriminators (the Peer service's; None: not an MD-GAN run)."""
        return self.algorithm if isinstance(self.algorithm, PeerInbox) else None

    # -- durable state ---------------------------------------------------------------------------
    def _saved_run(self) -> dict:
        """What the state dir says about the run this worker was last in ({} if nothing)."""
        if not self.state_dir:
            return {}
        try:
            saved = checkpoint.read_json(os.path.join(self.state_dir, "current.json"))
            return {} if saved.get("finished") else saved
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as exc:
            raise CheckpointError(f"{self.state_dir}/current.json is unreadable: {exc}") from exc

    def _forget_run(self) -> None:
        """The run is over: its states are of no more use, and the next run may take this worker."""
        if not (self.state_dir and self.run_id):
            return
        # (no shard yet: a restarted worker the server assigns its shard, refused before its welcome)
        index = self.shard.index if self.shard is not None else self._saved_run().get("shard_index")
        checkpoint.atomic_write_json(os.path.join(self.state_dir, "current.json"),
                                     {"run_id": self.run_id, "shard_index": index, "finished": True})
        shutil.rmtree(os.path.join(self.state_dir, self.run_id), ignore_errors=True)

    def _keep_final_discriminator(self) -> None:
        """The run finished: the discriminator this site holds at its end goes to
        STATE/finished/RUN/discriminator.pt (the newest few runs' kept), for the site's own audit
        (`mdgan audit --site-data`). Nothing leaves the site."""
        state = self.algorithm.final_discriminator() if self.algorithm is not None else None
        if not (self.state_dir and self.run_id) or state is None:
            return
        kept = os.path.join(self.state_dir, checkpoint.FINISHED_DIR)
        try:
            checkpoint.atomic_save({"discriminator": state, "run_id": self.run_id, "worker_id": self.worker_id,
                                    "algorithm": self.algorithm.name},
                                   os.path.join(kept, self.run_id, checkpoint.FINAL_DISCRIMINATOR_FILE))
            runs = sorted(os.scandir(kept), key=lambda e: e.stat().st_mtime)
            for old in runs[:-checkpoint.FINISHED_KEPT]:
                shutil.rmtree(old.path, ignore_errors=True)
        except OSError as exc:  # (a full disk): the run is done all the same
            log.warning("could not keep the final discriminator in %s: %s", kept, exc)

    def _start_afresh(self) -> None:
        """Out of an ended run: join the server's as a newcomer, with a new discriminator."""
        self._forget_run()
        self.run_id, self.algorithm, self.worker_id = None, None, ""

    def remember_run(self) -> None:
        """Record in the state dir the run this worker is in, and its slot (a restart comes back to it)."""
        if self.state_dir and self.run_id:
            checkpoint.atomic_write_json(os.path.join(self.state_dir, "current.json"),
                                         {"run_id": self.run_id, "shard_index": self.shard.index})

    def privacy_ledger(self, config: TrainingConfig) -> PrivacyLedger | None:
        """This site's privacy ledger for the run it is in (mdgan/privacy_ledger.py), read back if it has one;
        None in a run without DP. A private run needs a folder for it: the site cannot count what it spends
        otherwise."""
        if not config.privacy.enabled:
            return None
        folder = self.policy.privacy_dir or self.state_dir
        if not folder:
            raise ServerGone("this run is differentially private and this site has no folder for its privacy "
                             "ledger, which counts every step it releases: give --privacy-dir DIR (or --state-dir)")
        try:
            ledger = PrivacyLedger.open(folder, self.run_id or "unnamed-run", self.shard.index,
                                        config.privacy.mechanism, config.privacy.discriminators,
                                        self.policy.dp_fixed_noise)
        except (LedgerError, OSError) as exc:  # (a site's own problem: it leaves, saying why, exit 2)
            raise ServerGone(f"cannot keep this site's privacy ledger: {exc}") from None
        log.info("privacy ledger %s: %s noise, %d steps and %d answers counted before", ledger.path,
                 "FIXED (--dp-fixed-noise: no guarantee against whoever knows it)" if ledger.secret.fixed
                 else "secret", ledger.steps_taken, ledger.answers_given)
        return ledger

    def store(self) -> CheckpointStore | None:
        """Where this worker keeps its states for the run it is in; None: it keeps none."""
        if not (self.state_dir and self.run_id):
            return None
        return CheckpointStore(os.path.join(self.state_dir, self.run_id), self.keep_checkpoints)

    def _held(self) -> list[int]:
        store = self.store()
        return store.holding("worker") if store else []

    async def write(self, call, message: pb.WorkerMessage) -> None:
        try:
            async with self._write_lock:
                await call.write(message)
        except asyncio.InvalidStateError:
            # The server ended the stream while we stepped on a batch it had sent: it dropped us (we
            # were paused past its deadline) or it is gone. A broken stream, as if found by a read:
            # reconnect and rejoin (before, the worker ended with a traceback).
            code = await call.code()
            raise StreamBroken(f"the stream ended before our answer was sent (the server dropped us or is gone): "
                               f"{code.name} {await call.details()}") from None
        kind, payload = self._traffic(message.WhichOneof("body"), message)
        self.telemetry.count("worker_to_server", kind, "sender", message, payload)

    async def _read(self, call):
        try:
            async with asyncio.timeout(self.server_timeout):  # (wait_for would make a task per read)
                message = await call.read()
        except asyncio.TimeoutError:
            raise StreamBroken(f"no word from the server for {self.server_timeout:.0f} s") from None
        if message is grpc.aio.EOF:
            code = await call.code()
            raise StreamBroken(f"the server closed the stream: {code.name} {await call.details()}")
        kind, payload = self._traffic(message.WhichOneof("body"), message)
        self.telemetry.count("server_to_worker", kind, "receiver", message, payload)
        return message

    def _join_message(self) -> pb.WorkerMessage:
        if self.site is not None or self._site_join is not None:
            if self._site_join is None:  # what the site tells the server about its data, kept for rejoins
                site = self.site
                self._site_join = pb.Join(own_data=True, shard_size=len(site),
                                          num_classes=site.num_classes if site.labelled else 0,
                                          class_names=site.class_names or ())
                if site.files is not None:  # images: shaped for the model once its spec is known
                    self._site_join.image_shape.extend(site.image_shape)
                else:
                    self._site_join.sample_shape.extend(site.image_shape)
            join = pb.Join()
            join.CopyFrom(self._site_join)
            if self.shard is not None:  # back after a break: the slot this site held
                join.shard_index = self.shard.index
            elif self.slot is not None:
                join.shard_index = self.slot
        elif self.shard is not None:
            images, labels = self.shard.images, self.shard.labels
            join = pb.Join(shard_index=self.shard.index, shard_size=len(self.shard))
        else:
            images, labels, _ = self.dataset
            join = pb.Join(dataset_size=images.shape[0])
        if not join.own_data:
            join.sample_shape.extend(images.shape[1:])
            # the dataset's classes, not the shard's: a non-i.i.d. shard may lack the last ones
            join.num_classes = max(NUMERIC_CLASSES, int(labels.max()) + 1)
        if self.split is not None and not join.own_data:
            d = self.split
            join.split.CopyFrom(pb.EmulatedSplit(dataset=d.dataset, split=d.split, split_seed=d.split_seed,
                                                 dirichlet_alpha=d.dirichlet_alpha, max_samples=d.max_samples,
                                                 num_shards=d.num_shards))
        join.peer_address = "" if self.swaps == "relay" else self.advertise_address
        join.relayed = self.swaps == "relay"
        join.relay_fallback = self.swaps == "auto" and self.tls is not None
        join.name = self.identity
        if self.run_id:
            join.run_id = self.run_id
            join.checkpoints.extend(self._held())
            join.trained_iteration = self.algorithm.trained_iteration if self.algorithm is not None else 0
        return pb.WorkerMessage(join=join)

    async def run(self) -> str:
        """Join, train until told to stop; returns the stop reason. A broken stream is not the end:
        the worker reconnects (backoff with jitter) and rejoins the same run, until it has heard
        nothing from a server of its run for --server-timeout seconds."""
        deadline = time.monotonic() + self.connect_timeout  # the first contact
        delays = backoff_delays()
        self._task = asyncio.current_task()
        try:
            return await self._run(deadline, delays)
        except asyncio.CancelledError:
            if self.fault is None:  # a signal
                raise
            self._task.uncancel()
            raise self.faults.error() from None
        finally:
            self._task = None

    # -- faults (services/worker/faults.py) --------------------------------------------------------
    def fail(self, where: str, exc: BaseException) -> WorkerFailed:
        """This worker's own exception while `where` ("answering batches", ...): logged with its
        traceback, told to the server as a Fault, and the worker exits 1. Raised by the task that runs
        the worker, the WorkerFailed returned ends its session; from any other task (a swap, the Peer
        service) the Fault is written on the stream now, and the server ends the session."""
        trained = self.algorithm.trained_iteration if self.algorithm is not None else 0
        return self.faults.record(where, exc, trained, self._task, lambda: self._call)

    @property
    def fault(self) -> pb.Fault | None:
        return self.faults.fault

    async def _run(self, deadline: float, delays) -> str:
        while True:
            try:
                return await self._session(deadline)
            except JoinRefused:
                raise
            except BudgetSpent as spent:  # (the stream closes with the session: the server sees us leave)
                log.warning("leaving the run: %s", spent)
                return f"privacy budget: {spent}"
            except RunEnded as ended:
                if self.pinned_run:  # this worker joins that run only: its end is ours
                    log.info("run %s ended while we were away (the server says so): done", ended.run_id)
                    self._forget_run()
                    return RUN_FINISHED
                log.warning("run %s ended while we were away (the server says so): forgetting it and joining "
                            "the server's run as a newcomer", ended.run_id)
                self._start_afresh()
                continue
            except (StreamBroken, grpc.aio.AioRpcError) as exc:
                if self.fault is not None:  # the server ended the stream after our Fault
                    raise self.faults.error() from None
                if isinstance(exc, grpc.aio.AioRpcError) and exc.code() in FINAL_REFUSALS:
                    raise JoinRefused(f"{exc.code().name}: {exc.details()}") from None
                why = f"{exc.code().name}: {exc.details()}" if isinstance(exc, grpc.aio.AioRpcError) else str(exc)
                dropped = isinstance(exc, DroppedByServer)
                if not self.reconnect:
                    raise ServerGone(why) from None
                if self._contact is not None:  # we were in: from now on the server timeout bounds the wait
                    deadline = self._contact + self.server_timeout
                    self._contact = None
                    delays = backoff_delays()
                    self.telemetry.departures.labels("dropped" if dropped else "reconnect").inc()
                delay = next(delays)
                if time.monotonic() + delay >= deadline:
                    raise ServerGone(f"no server of our run came back in time (last: {why})") from None
                log.warning("%s (%s); reconnecting in %.1f s",
                            "the server dropped us before the run's end" if dropped else "lost the server", why, delay)
                await asyncio.sleep(delay)

    _contact: float | None = None  # monotonic time of the last message from the server, while joined

    async def _session(self, deadline: float) -> str:
        """One connection: join, train until stopped or the stream breaks."""
        async with tls_.channel(self.server_address, self.tls, rpc.options(), self.server_name) as channel:
            remaining = deadline - time.monotonic()
            try:  # a short try, then our own backoff: gRPC's would wait up to two minutes between tries
                await asyncio.wait_for(channel.channel_ready(), max(0.1, min(remaining, CONNECT_TRY_S)))
            except asyncio.TimeoutError:
                why = await _why_unreachable(channel)
                if remaining <= CONNECT_TRY_S:
                    raise ServerGone(f"could not reach the server at {self.server_address} in time{why}") from None
                raise StreamBroken(f"the server at {self.server_address} is not reachable{why}") from None
            call = coordinator_pb2_grpc.CoordinatorStub(channel).Train(timeout=self.run_deadline)
            await self.write(call, self._join_message())
            try:
                welcome = await self._read(call)
            except (StreamBroken, grpc.aio.AioRpcError):  # a refusal: an error status, with its trailing metadata
                code = await call.code()
                ended = (await call.trailing_metadata() or {}).get(rpc.FINISHED_RUN_KEY)
                if code == grpc.StatusCode.FAILED_PRECONDITION and ended and ended == self.run_id:
                    raise RunEnded(ended) from None
                if code in FINAL_REFUSALS:
                    raise JoinRefused(f"{code.name}: {await call.details()}") from None  # (exit_code says who)
                raise
            if welcome.WhichOneof("body") != "welcome":
                raise ServerGone(f"expected a welcome, got {welcome.WhichOneof('body')}")
            beats = relay = None
            self._call = call
            self.server_channel = channel
            try:
                try:
                    await self._on_welcome(welcome.welcome)
                except ENDINGS:
                    raise
                except Exception as exc:  # our own error setting up the run (a model on a device, a state)
                    raise self.fail("setting up the run", exc) from None
                self._contact = time.monotonic()
                beats = asyncio.create_task(self._heartbeats(call, welcome.welcome.heartbeat_interval_ms / 1000))
                if welcome.welcome.relayed:
                    relay = asyncio.create_task(self._attach_to_relay(channel, welcome.welcome.relay_reason))
                return await self._serve(call)
            except asyncio.CancelledError:
                if self.fault is None:  # a signal
                    raise
                asyncio.current_task().uncancel()  # a fault elsewhere, whose report got no answer
                raise self.faults.error() from None
            except WorkerFailed:
                await self.faults.report(call)
                raise
            finally:
                self._call = None
                self.server_channel = None
                for task in (beats, relay):
                    if task is not None:
                        task.cancel()
                if self.algorithm is not None:
                    await self.algorithm.end_session()

    async def _attach_to_relay(self, channel: grpc.aio.Channel, reason: str) -> None:
        """This session's attachment to the server's relay, attached again (with backoff) if it breaks."""
        from services.worker.relay import RelayInbox

        log.info("swaps through the server's relay: %s", reason)
        delays = backoff_delays()
        while True:
            inbox = RelayInbox(self.peer_servicer, self.tls, self.identity, self.swap_timeout)
            try:
                await inbox.run(channel)
            except grpc.aio.AioRpcError as exc:
                delay = next(delays)
                log.warning("the relay stream ended (%s: %s); attaching again in %.1f s", exc.code().name,
                            exc.details(), delay)
                await asyncio.sleep(delay)

    async def _on_welcome(self, welcome: pb.Welcome) -> None:
        if self.pinned_run and welcome.run_id != self.pinned_run:
            raise JoinRefused(f"the server runs run {welcome.run_id!r}, and this worker joins run "
                              f"{self.pinned_run!r} only (--run-id)")
        if self.run_id and welcome.run_id and welcome.run_id != self.run_id:
            raise JoinRefused(f"the server runs run {welcome.run_id!r}, this worker was in run {self.run_id!r}")
        config = replace(training_spec.config_from_spec(welcome.spec), device=self.device).validate()
        if welcome.run_id:
            self.run_id = welcome.run_id
        name = welcome.spec.algorithm or "mdgan"
        if self.algorithm is not None and self.algorithm.name == name and self.algorithm.continues(config):
            # Back in the same run: keep our discriminator unless the server says to restore a saved one.
            await self._restore(welcome)
            return
        if self.site is not None:
            site, classes = self.site, tuple(welcome.spec.class_names) or None
            try:
                images, labels = site.conform(config.model.sample_shape), map_labels(site, classes)
            except ConfigError as exc:
                raise ServerGone(f"this site's data does not fit the run: {exc}") from exc
            self.shard = Shard(images, labels, welcome.shard_index, config.workers)
            self.site = None  # keep only the shaped samples
            log.info("slot %d of %d: this site's %d samples, shaped %s", welcome.shard_index, config.workers,
                     len(self.shard), tuple(config.model.sample_shape))
        elif self.shard is None:
            images, labels, data = self.dataset
            data = replace(data, num_shards=config.workers)
            self.shard = take_shard(images, labels, welcome.shard_index, data, config.model.sample_shape)
            self.dataset = None  # keep only our shard
            log.info("the server assigned shard %d of %d (%d samples)", self.shard.index, config.workers,
                     len(self.shard))
        elif self.shard.num_shards != config.workers:
            raise ServerGone(f"this worker cut the data into {self.shard.num_shards} shards but the run has "
                             f"{config.workers} workers: set --num-shards {config.workers}")
        self.worker_id = welcome.worker_id
        self.swap_timeout = welcome.swap_timeout_ms / 1000 or self.swap_timeout
        if name not in ALGORITHMS:
            raise ServerGone(f"the server runs {welcome.spec.algorithm!r}, which this worker does not know")
        self.algorithm = ALGORITHMS[name](self, config, self.shard)
        self._traffic = self.algorithm.traffic
        log.info("joined run %s as %s: %s, b=%d, L=%d", self.run_id or "(no id)", self.worker_id,
                 config.model.architecture, config.batch_size, config.disc_steps)
        await self._restore(welcome)

    async def _restore(self, welcome: pb.Welcome) -> None:
        """Set up what the welcome says; the algorithm sets up its own part (saved state, ...)."""
        self.worker_id = welcome.worker_id
        self.swap_timeout = welcome.swap_timeout_ms / 1000 or self.swap_timeout
        self.identity = welcome.identity or self.identity
        await self.algorithm.welcome(welcome)

    async def _serve(self, call) -> str:
        receivers = self.algorithm.receivers()
        while True:
            message = await self._read(call)
            self._contact = time.monotonic()
            body = message.WhichOneof("body")
            receive = receivers.get(body)
            if receive is not None:
                try:
                    await receive(call, getattr(message, body))
                except BudgetSpent as spent:  # told to the server, which names it where the run ends
                    await self._say_budget_spent(call, f"answering {body}", spent)
                    raise
                except (*ENDINGS, grpc.aio.AioRpcError):
                    raise
                except Exception as exc:  # our own error answering the server
                    raise self.fail(f"answering {body}", exc) from None
            elif body == "heartbeat":
                continue
            elif body == "rejection":
                r = message.rejection
                log.error("the server rejected our input at iteration %d: %s (%s)", r.iteration, r.message, r.reason)
            elif body == "stop":
                await call.done_writing()
                if message.stop.failed:
                    raise RunFailed(f"{RUN_FAILED}: {message.stop.reason}")
                if message.stop.reason != RUN_FINISHED:
                    raise DroppedByServer(message.stop.reason)
                log.info("stopped by the server: %s", message.stop.reason)
                self._keep_final_discriminator()
                self._forget_run()
                return message.stop.reason
            else:  # another algorithm's message, or one that has no place after the welcome
                raise ServerGone(f"the server sent a {body!r} message, which a {self.algorithm.name} worker does "
                                 "not take")

    async def _say_budget_spent(self, call, where: str, spent: BudgetSpent) -> None:
        """This site leaves at its privacy budget: a Fault (RESOURCE_EXHAUSTED) tells the server why, so that it
        does not wait for the site to come back (best effort: the site leaves all the same)."""
        trained = self.algorithm.trained_iteration if self.algorithm is not None else 0
        try:
            async with asyncio.timeout(5):
                await self.write(call, pb.WorkerMessage(fault=pb.Fault(
                    code=grpc.StatusCode.RESOURCE_EXHAUSTED.value[0], message=rpc.bounded(str(spent)), where=where,
                    iteration=trained)))
                await call.done_writing()
        except Exception as exc:  # (the stream is gone)
            log.debug("the end of our budget was not told: %r", exc)

    async def _heartbeats(self, call, interval: float) -> None:
        while True:
            await asyncio.sleep(interval or 5.0)
            try:
                await self.write(call, pb.WorkerMessage(heartbeat=pb.Heartbeat(unix_ms=int(time.time() * 1000))))
            except Exception:  # the stream is closing; the main loop reports why
                return
