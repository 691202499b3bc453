"""mdgan-server: holds the generator, waits for the workers, trains, writes the run directory."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys

import grpc

from mdgan.config import DATASETS, ConfigError
from mdgan.baselines import FederatedTrainer
from mdgan.cluster import IterationRecord, Trainer
from mdgan.mdgan import GeneratorSide, derive_seed
from mdgan.models import build_discriminator
from mdgan.run import RunRecorder, make_evaluator, write_outputs
from mdgan.settings import (EnvArgumentParser, add_evaluation_arguments, add_site_arguments, add_threads_argument,
                            add_training_arguments, apply_threads, class_names, training_config)
from services.common import codec, rpc
from services.common.proto import coordinator_pb2, coordinator_pb2_grpc
from services.common.telemetry import Telemetry, counter_total
from services.server.servicer import Coordinator

log = logging.getLogger("mdgan.server")
SERVICE = coordinator_pb2.DESCRIPTOR.services_by_name["Coordinator"].full_name


def build_parser() -> EnvArgumentParser:
    parser = EnvArgumentParser(prog="mdgan-server", description=__doc__)
    parser.add_argument("--listen", default="0.0.0.0:50051", help="host:port to serve the Coordinator on (port 0: any)")
    parser.add_argument("--out", default="runs/server", help="run directory (summary, history, samples, checkpoint)")
    parser.add_argument("--port-file", default=None, help="write the bound port here once serving")
    parser.add_argument("--join-timeout", type=float, default=600.0, help="seconds to wait for all workers to join")
    parser.add_argument("--step-timeout", type=float, default=60.0, help="deadline for a worker's feedback (s)")
    parser.add_argument("--swap-timeout", type=float, default=120.0, help="deadline for a discriminator swap (s)")
    parser.add_argument("--heartbeat-interval", type=float, default=5.0, help="idle heartbeat period (s)")
    parser.add_argument("--liveness-timeout", type=float, default=None,
                        help="drop a worker silent this long (s; default: step timeout + 3 heartbeats)")
    parser.add_argument("--metrics-port", type=int, default=9100, help="HTTP port of /metrics (0: none)")
    parser.add_argument("--metrics-address", default="0.0.0.0", help="address /metrics listens on")
    parser.add_argument("--metrics-dump", default=None,
                        help="write the final metrics exposition to this file (default: OUT/metrics/server.prom)")
    parser.add_argument("--progress", action="store_true", help="show a progress bar on stderr")
    parser.add_argument("--log-level", default="INFO", help="logging level")
    parser.add_argument("--algorithm", choices=("mdgan", "flgan"), default="mdgan",
                        help="MD-GAN, or the FL-GAN baseline (FedAvg of whole GANs) over the same services")
    parser.add_argument("--round-timeout", type=float, default=3600.0,
                        help="FL-GAN: deadline for a worker's local round (s)")
    parser.add_argument("--dataset", choices=DATASETS, default=None,
                        help="the kind of data the workers hold (sets the sample shape; default: the architecture's)")
    parser.add_argument("--eval-data-root", default=None,
                        help="folder holding MNIST/raw: score the generator (MNIST score, FID) against its test set")
    add_threads_argument(parser, default=0)
    add_training_arguments(parser)
    add_site_arguments(parser, launcher=False)
    add_evaluation_arguments(parser)
    return parser


async def serve(args) -> dict:
    config = training_config(args)
    liveness = args.liveness_timeout or (args.step_timeout + 3 * args.heartbeat_interval)
    telemetry = Telemetry("server")
    telemetry.serve(args.metrics_port, args.metrics_address)
    initial_discriminator = build_discriminator(config.model, derive_seed(config.seed, "discriminator-init"))
    generator = GeneratorSide(config)
    layouts = {"generator": codec.layout_of(generator.generator.state_dict()),
               "discriminator": codec.layout_of(initial_discriminator.state_dict())}
    coordinator = Coordinator(config, telemetry=telemetry, heartbeat_interval=args.heartbeat_interval,
                              swap_timeout=args.swap_timeout, liveness_timeout=liveness, algorithm=args.algorithm,
                              model_layouts=layouts, class_names=class_names(args))
    server = grpc.aio.server(options=rpc.options())
    coordinator_pb2_grpc.add_CoordinatorServicer_to_server(coordinator, server)
    health = rpc.add_health_and_reflection(server, [SERVICE])
    port = server.add_insecure_port(args.listen)
    await server.start()
    await rpc.set_serving(health, [SERVICE], True)
    log.info("serving %s on port %d; waiting for %d workers", SERVICE, port, config.workers)
    if args.port_file:
        with open(args.port_file + ".tmp", "w") as fh:
            fh.write(str(port))
        os.replace(args.port_file + ".tmp", args.port_file)

    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stopping.set)
    try:
        workers = await _until(coordinator.wait_for_workers(args.join_timeout), stopping)
        evaluator = make_evaluator(generator, args.eval_data_root, args.eval_every, args.eval_samples,
                                   args.eval_reference)
        recorder = RunRecorder(args.out, config.iterations, args.progress, "mdgan-server", evaluator)

        def on_iteration(record: IterationRecord) -> None:
            recorder(record)
            observe_iteration(telemetry, record, len(trainer.active))
            observe_scores(telemetry, recorder.scores)

        def on_swap(record: dict) -> None:
            recorder.swap(record)
            complete = all(w["sent"] and w["received"] for w in record["workers"].values())
            telemetry.swaps.labels("complete" if complete else "incomplete").inc()

        if args.algorithm == "flgan":
            trainer = FederatedTrainer(config, generator, workers, initial_discriminator.state_dict(),
                                       round_timeout=args.round_timeout, on_iteration=on_iteration,
                                       on_round=recorder.swap)
        else:
            trainer = Trainer(config, generator, workers, step_timeout=args.step_timeout,
                              swap_timeout=args.swap_timeout + args.step_timeout, on_iteration=on_iteration,
                              on_swap=on_swap)
        result = None
        try:
            result = await _until(trainer.run(), stopping)
        finally:
            wall = recorder.close(result.iterations if result else None)
        observe_scores(telemetry, recorder.scores)
        summary = write_outputs(args.out, config, generator, result, wall, "grpc", scores=recorder.scores, extra={
            "algorithm": args.algorithm,
            "worker_sizes": {w.worker_id: w.shard_size for w in workers},  # each worker's m
            "message_bytes": {
                "server_to_worker": counter_total(telemetry.message_bytes, direction="server_to_worker", side="sender"),
                "worker_to_server": counter_total(telemetry.message_bytes, direction="worker_to_server",
                                                  side="receiver"),
                "worker_to_worker": sum(w.swap_message_bytes for w in coordinator.workers.values()),
            },
        })
        log.info("done: %d iterations, %d/%d workers alive, generator %s", result.iterations, result.workers_alive,
                 result.workers, summary["generator_sha256"][:16])
        return summary
    finally:
        telemetry.dump(args.metrics_dump or os.path.join(args.out, "metrics", "server.prom"))
        await rpc.set_serving(health, [SERVICE], False)
        await server.stop(grace=5)


def observe_scores(telemetry: Telemetry, scores: dict | None) -> None:
    for metric, value in (scores or {}).items():
        if metric != "eval_iteration":
            telemetry.score.labels(metric).set(value)


def observe_iteration(telemetry: Telemetry, record: IterationRecord, alive: int) -> None:
    telemetry.iterations.inc()
    telemetry.iteration_seconds.observe(record.seconds)
    for phase, seconds in (("generate", record.generate_seconds), ("wait_feedback", record.wait_seconds),
                           ("update", record.update_seconds)):
        telemetry.phase_seconds.labels(phase).observe(seconds)
    if record.swap_round is not None:
        telemetry.phase_seconds.labels("swap").observe(record.swap_seconds)
    if record.answered:
        telemetry.generator_loss.set(record.gen_loss)
        telemetry.discriminator_loss.set(record.disc_loss)
        telemetry.discriminator_accuracy.labels("real").set(record.real_accuracy)
        telemetry.discriminator_accuracy.labels("generated").set(record.fake_accuracy)
    if record.late:
        telemetry.late_feedback.inc(record.late)
    telemetry.workers_alive.set(alive)
    telemetry.last_iteration.set_to_current_time()



async def _until(work, stopping: asyncio.Event):
    """Run `work`, or give up when a termination signal arrives."""
    task = asyncio.ensure_future(work)
    stop = asyncio.ensure_future(stopping.wait())
    done, _ = await asyncio.wait({task, stop}, return_when=asyncio.FIRST_COMPLETED)
    if task in done:
        stop.cancel()
        return task.result()
    task.cancel()
    raise SystemExit("terminated by signal")


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    apply_threads(args.threads)
    try:
        rpc.run(serve(args))
    except (ConfigError, TimeoutError) as exc:
        log.error("%s", exc)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
