"""Every Prometheus metric of mdgan is declared here, and only here.

Names follow Prometheus' conventions: `mdgan_` prefix, base units (bytes, seconds), `_total` on
counters. Wire traffic is counted where it is sent (side="sender") and where it is received
(side="receiver"), by direction and kind:

  direction  server_to_worker | worker_to_server | worker_to_worker
  kind       batches | feedback | discriminator | generator (FL-GAN) | potentials | counts (P-WGAN)
             | control

`*_payload_bytes_total` counts the tensors of the paper's Table III (generated samples, feedback
gradients, discriminator states); `*_message_bytes_total` counts whole serialized messages
(payload, ACGAN labels, framing and control).
"""

from __future__ import annotations

import logging

from prometheus_client import (GC_COLLECTOR, PLATFORM_COLLECTOR, PROCESS_COLLECTOR, CollectorRegistry, Counter, Gauge,
                               Histogram, disable_created_metrics, generate_latest, start_http_server)

from mdgan.checkpoint import atomic_write_bytes
from mdgan.config import ConfigError

log = logging.getLogger(__name__)
disable_created_metrics()  # no `_created` series beside every counter: less noise, same information

DIRECTIONS = ("server_to_worker", "worker_to_server", "worker_to_worker")
KINDS = ("batches", "feedback", "discriminator", "generator", "potentials", "counts", "control")
SIDES = ("sender", "receiver")
SERVER_PHASES = ("generate", "wait_feedback", "update", "swap")
WORKER_PHASES = ("disc_steps", "feedback", "swap")

_DURATION_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class Telemetry:
    """The metrics of one process (role "server" or "worker"), in a registry of its own."""

    def __init__(self, role: str):
        self.role = role
        self.registry = CollectorRegistry()
        r = self.registry
        # The standard process_* (CPU, memory, open files, start time), python_info and python_gc_*
        # series, as every Prometheus client exposes them by default: dashboards and alerts expect them.
        for standard in (PROCESS_COLLECTOR, PLATFORM_COLLECTOR, GC_COLLECTOR):
            r.register(standard)
        wire = ["direction", "kind", "side"]
        self.payload_bytes = Counter("mdgan_wire_payload_bytes_total",
                                     "Tensor bytes of Table III (samples, feedback, discriminators) on the wire",
                                     wire, registry=r)
        self.message_bytes = Counter("mdgan_wire_message_bytes_total", "Serialized message bytes on the wire",
                                     wire, registry=r)
        self.messages = Counter("mdgan_wire_messages_total", "Messages on the wire", wire, registry=r)

        self.iterations = Counter("mdgan_iterations_total", "Global iterations completed (server) or served (worker)",
                                  registry=r)
        self.iteration_seconds = Histogram("mdgan_iteration_duration_seconds", "Wall time of one global iteration",
                                           buckets=_DURATION_BUCKETS, registry=r)
        self.phase_seconds = Histogram("mdgan_iteration_phase_duration_seconds",
                                       "Wall time of the phases of an iteration (server: generate, wait_feedback, "
                                       "update, swap; worker: disc_steps, feedback, swap)",
                                       ["phase"], buckets=_DURATION_BUCKETS, registry=r)
        self.generator_loss = Gauge("mdgan_generator_loss",
                                    "J_gen on X_g (worker: its own; server: mean over answering workers)", registry=r)
        self.discriminator_loss = Gauge("mdgan_discriminator_loss", "J_disc of the last discriminator step",
                                        registry=r)
        self.discriminator_accuracy = Gauge("mdgan_discriminator_accuracy",
                                            "Share of samples the discriminator classifies right, by data",
                                            ["data"], registry=r)
        self.workers_alive = Gauge("mdgan_workers_alive", "Workers taking part in the run", registry=r)
        self.workers_expected = Gauge("mdgan_workers_expected", "Workers the run was configured for", registry=r)
        self.joins = Counter("mdgan_worker_joins_total", "Workers admitted", registry=r)
        self.departures = Counter("mdgan_worker_departures_total", "Workers that left the run, by reason",
                                  ["reason"], registry=r)
        self.swaps = Counter("mdgan_swaps_total",
                             "Discriminator swap rounds (server) or swaps taken part in (worker), by outcome",
                             ["outcome"], registry=r)
        self.relayed_bytes = Counter("mdgan_relayed_bytes_total",
                                     "Sealed discriminator bytes the relay forwarded, by sending and receiving site",
                                     ["sender", "receiver"], registry=r)
        self.relayed_pushes = Counter("mdgan_relayed_pushes_total", "Discriminator pushes through the relay, by outcome "
                                      "(the receiver's status code name)", ["outcome"], registry=r)
        self.swap_paths = Counter("mdgan_swap_paths_total", "Discriminators pushed (worker: by this worker), by path",
                                  ["path"], registry=r)
        self.rejected = Counter("mdgan_rejected_inputs_total", "Inputs refused by validation, by reason",
                                ["reason"], registry=r)
        self.late_feedback = Counter("mdgan_late_feedback_total",
                                     "Feedback that came too late to count (--sync quorum|async), dropped",
                                     registry=r)
        self.score = Gauge("mdgan_evaluation_score", "Latest evaluation score of the generator", ["metric"],
                           registry=r)
        self.last_iteration = Gauge("mdgan_last_iteration_timestamp_seconds",
                                    "Unix time of the last completed iteration", registry=r)
        # (a worker's: each site accounts for its own data)
        self.privacy_epsilon = Gauge("mdgan_privacy_epsilon", "DP runs: the epsilon this site has spent so far "
                                     "(its own accountant, at its delta; docs/PRIVACY.md)",
                                     registry=r if role == "worker" else None)
        self.run_iterations = Gauge("mdgan_run_iterations", "Iterations the run is configured for", registry=r)
        self.run_info = Gauge("mdgan_run_info", "The run this process is in (1, labelled by its id)", ["run_id"],
                              registry=r)
        self.checkpoints = Counter("mdgan_checkpoints_total", "Checkpoints taken, by outcome (complete: the server "
                                   "and every live worker saved their state)", ["outcome"], registry=r)
        self._wire_series: dict[tuple[str, str, str], tuple] = {}  # (direction, kind, side) -> its three series
        self._prime()

    def _prime(self) -> None:
        # Every series exists from the start (at 0), so rates and alerts see it before the first event.
        for direction in DIRECTIONS:
            for kind in KINDS:
                for side in SIDES:
                    for metric in (self.payload_bytes, self.message_bytes, self.messages):
                        metric.labels(direction, kind, side)
        for phase in SERVER_PHASES if self.role == "server" else WORKER_PHASES:
            self.phase_seconds.labels(phase)
        for data in ("real", "generated"):
            self.discriminator_accuracy.labels(data)
        for outcome in ("complete", "incomplete"):
            self.swaps.labels(outcome)
            if self.role == "server":
                self.checkpoints.labels(outcome)

    # -- wire accounting ---------------------------------------------------------------------
    def count(self, direction: str, kind: str, side: str, message, payload: int = 0,
              message_bytes: int | None = None) -> None:
        """One message: its serialized size is `message_bytes` when the caller knows it (a chunk of a
        megabyte, whose ByteSize() would serialize it again), else message.ByteSize()."""
        key = (direction, kind, side)
        series = self._wire_series.get(key)
        if series is None:  # labels() validates and locks on every call: look each series up once
            series = self._wire_series[key] = (self.messages.labels(*key), self.message_bytes.labels(*key),
                                               self.payload_bytes.labels(*key))
        series[0].inc()
        series[1].inc(message.ByteSize() if message_bytes is None else message_bytes)
        if payload:
            series[2].inc(payload)

    # -- exposition ----------------------------------------------------------------------------
    def serve(self, port: int, addr: str = "0.0.0.0") -> int | None:
        """Expose /metrics over HTTP; returns the bound port (None: port 0 disables it)."""
        if port <= 0:
            return None
        try:
            server, _ = start_http_server(port, addr, registry=self.registry)
        except OSError as exc:
            raise ConfigError(f"--metrics-port {port}: cannot serve /metrics on {addr}:{port} "
                              f"({exc.strerror or exc})") from None
        bound = server.server_port
        log.info("metrics on http://%s:%d/metrics", addr, bound)
        return bound

    def exposition(self) -> bytes:
        return generate_latest(self.registry)

    def dump(self, path: str | None) -> None:
        """Write the current exposition to a file (the run's record of this process). A failure (a
        full disk) is logged, not raised: this runs as the service stops, in a `finally`, and must
        neither hide why it stops nor keep its gRPC server from being stopped."""
        if not path:
            return
        try:
            atomic_write_bytes(path, self.exposition())
        except OSError as exc:
            log.error("could not write the final metrics to %s: %s", path, exc)


def counter_total(counter: Counter, **labels: str) -> int:
    """A counter's value summed over the series whose labels match `labels`."""
    return int(sum(sample.value for metric in counter.collect() for sample in metric.samples
                   if sample.name.endswith("_total") and all(sample.labels.get(k) == v for k, v in labels.items())))
