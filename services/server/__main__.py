"""mdgan-server: holds the generator, waits for the workers, trains, writes the run directory."""

from __future__ import annotations

import asyncio
import logging
import math
import os
import signal
import sys


from mdgan import algorithms, devices
from mdgan.checkpoint import CheckpointError
from mdgan.settings import DURABLE, EVALUATION, TRACKING
from mdgan.config import DATASETS, ConfigError
from mdgan.algorithms.base import IterationRecord
from mdgan.gan import GeneratorSide, derive_seed
from mdgan.models import build_discriminator
from mdgan.roster import Roster, WorkersFailed
from mdgan.run import (RESUME_MODES, RunRecorder, finished_run_ids, make_evaluator, plan_run, start_run,
                       write_outputs)
from mdgan.algorithms.mdgan.checkpoints import ServerCheckpoints
from services.common import scheduling
from services.common.settings import (add_version, EnvArgumentParser, add_affinity_argument, add_algorithm_argument,
                                      add_algorithm_options, add_scheduling_argument, add_setting_arguments,
                                      add_setting_groups, add_site_arguments, add_stop_grace_argument,
                                      add_threads_argument, command_settings,
                                      add_training_arguments, class_names, configure_compute, listen_address,
                                      log_level, port_number, positive_seconds,
                                      training_config)
from services.common import codec, rpc, tls
from services.common.proto import coordinator_pb2, coordinator_pb2_grpc, peer_pb2_grpc
from services.common.telemetry import Telemetry, counter_total
from services.server.algorithms import ALGORITHMS
from services.server.context import ServerContext
from services.server.admission import Admission, PeerProbe
from services.server.coordinator import Coordinator, Deadlines
from services.server.relay import RelayServicer

log = logging.getLogger("mdgan.server")
LIVENESS_STEP_CAP = 30.0  # s: a long --step-timeout (a slow site) does not delay finding a gone one
SERVICE = coordinator_pb2.DESCRIPTOR.services_by_name["Coordinator"].full_name


def build_parser() -> EnvArgumentParser:
    parser = EnvArgumentParser(prog="mdgan-server", description=__doc__, config_file=True)
    add_version(parser, "mdgan-server")
    parser.add_argument("--listen", type=listen_address, default="0.0.0.0:50051", help="host:port to serve the Coordinator on (port 0: any)")
    parser.add_argument("--out", default="runs/server", help="run directory (summary, history, samples, checkpoint)")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace a finished run in --out with a new one (without it the server refuses to start "
                             "there, and the finished run is left as it is)")
    parser.add_argument("--port-file", default=None, help="write the bound port here once serving")
    parser.add_argument("--join-timeout", type=positive_seconds, default=600.0, help="seconds to wait for all workers to join")
    parser.add_argument("--step-timeout", type=positive_seconds, default=60.0, help="deadline for a worker's feedback (s)")
    parser.add_argument("--swap-timeout", type=positive_seconds, default=120.0, help="deadline for a discriminator swap (s)")
    parser.add_argument("--heartbeat-interval", type=positive_seconds, default=5.0, help="idle heartbeat period (s)")
    parser.add_argument("--liveness-timeout", type=positive_seconds, default=None,
                        help="drop a worker silent this long while it owes no answer (s; default: the step timeout, "
                             "at most 30 s, + 3 heartbeats). A worker busy with a long step is not silent: its "
                             "step is bounded by --step-timeout, and a dead connection is found by keepalive pings")
    parser.add_argument("--metrics-port", type=port_number, default=9100, help="HTTP port of /metrics (0: none)")
    parser.add_argument("--metrics-address", default="0.0.0.0", help="address /metrics listens on")
    parser.add_argument("--metrics-dump", default=None,
                        help="write the final metrics exposition to this file (default: OUT/metrics/server.prom)")
    parser.add_argument("--progress", action="store_true", help="show a progress bar on stderr")
    parser.add_argument("--log-level", type=log_level, default="INFO", help="logging level")
    add_algorithm_argument(parser, tuple(ALGORITHMS))
    parser.add_argument("--round-timeout", type=positive_seconds, default=3600.0,
                        help="FL-GAN: deadline for a worker's local round (s)")
    parser.add_argument("--dataset", choices=DATASETS, default=None,
                        help="the kind of data the workers hold (sets the sample shape; default: the architecture's)")
    parser.add_argument("--eval-data-root", default=None,
                        help="folder holding MNIST/raw: score the generator (MNIST score, FID) against its test set")
    parser.add_argument("--peer-check", choices=("dial", "off"), default="dial",
                        help="dial: at its join, dial each MD-GAN worker's advertised Peer address as its peers will, "
                             "and refuse the join with the reason when it cannot be reached; off: take it on trust")
    parser.add_argument("--allowed-workers", default=None,
                        help="comma-separated identities (certificate names) that may join; default: any worker "
                             "certificate the run's CA signed")
    tls.add_tls_arguments(parser)
    durable = parser.add_argument_group("durable, elastic runs")
    durable.add_argument("--run-id", default=None, help="the run's id (default: a new random one, or the resumed run's)")
    durable.add_argument("--resume", nargs="?", const="yes", default="no", choices=RESUME_MODES,
                         help="continue the run in --out from its last complete checkpoint: 'yes' (bare --resume) "
                              "fails if there is none, 'auto' starts a new run then (for restart policies), 'no' "
                              "always starts a new run")
    add_setting_arguments(durable, command_settings("server", DURABLE),
                          keep_checkpoints="complete checkpoints kept in OUT/checkpoints")
    add_stop_grace_argument(durable)
    durable.add_argument("--min-workers", type=int, default=None,
                         help="start once this many workers joined, go on while this many are alive, pause below "
                              "(default: start with all, go on while one is alive)")
    durable.add_argument("--pause-timeout", type=positive_seconds, default=600.0,
                         help="give up after this long paused below --min-workers (s)")
    add_threads_argument(parser, default=0)
    add_scheduling_argument(parser, default="normal")
    add_affinity_argument(parser)
    add_training_arguments(parser)
    add_site_arguments(parser, launcher=False)
    add_algorithm_options(parser)
    # the declared run settings the server takes (mdgan/settings.py `commands`), in their help groups
    add_setting_groups(parser, command_settings("server", EVALUATION, TRACKING))
    return parser


def message_limits(config) -> tuple[int, int]:
    """(receive, send) message bounds of the Coordinator, sized to this run's model: feedback and
    FL-GAN model parts up; batches (X_g, X_d and their labels) and model parts down."""
    sample_bytes = 4 * math.prod(config.model.sample_shape)
    receive = rpc.message_bytes_for(config.batch_size * sample_bytes, codec.CHUNK_BYTES)
    send = rpc.message_bytes_for(2 * config.batch_size * (sample_bytes + 8), codec.CHUNK_BYTES)
    return receive, send


async def serve(args) -> dict:
    credentials = tls.from_args(args, "mdgan-server")
    allowed = [n.strip() for n in (args.allowed_workers or "").split(",") if n.strip()] or None
    run = plan_run(args.out, training_config(args), args.resume, args.run_id, args.overwrite)
    config = run.config
    algorithm = ALGORITHMS[args.algorithm]
    algorithms.refuse(algorithms.get(args.algorithm, served=True), checkpoint_every=args.checkpoint_every,
                      resume=run.state is not None, in_process=False, private=config.privacy.active_mechanism)
    algorithm.check(args, run)
    if config.privacy.enabled:  # the layers here; each site checks its own size's budget at its welcome
        from mdgan import privacy

        privacy.check_run(config, [])
    # the ports bound before the run folder is touched: an address this machine cannot listen on is a setting refused
    telemetry = Telemetry("server")
    receive, send = message_limits(config)
    guard = rpc.HostileInputGuard(on_reject=lambda reason: telemetry.rejected.labels(reason).inc())
    server = rpc.make_server(max_receive_bytes=receive, max_send_bytes=send, guard=guard)
    port = tls.add_port(server, args.listen, credentials)
    telemetry.serve(args.metrics_port, args.metrics_address)
    start_run(args.out, run)  # every setting accepted: the run folder is written from here on
    devices.deterministic(config.device)
    log.info("run %s%s", run.run_id, f", resumed from iteration {run.resumed_from}" if run.resuming else "")
    liveness = args.liveness_timeout or (min(args.step_timeout, LIVENESS_STEP_CAP) + 3 * args.heartbeat_interval)
    telemetry.run_info.labels(run.run_id).set(1)
    initial_discriminator = build_discriminator(config.model, derive_seed(config.seed, "discriminator-init"))
    generator = GeneratorSide(config)
    layouts = {"generator": codec.layout_of(generator.generator.state_dict()),
               "discriminator": codec.layout_of(initial_discriminator.state_dict())}
    try:
        roster = Roster(config.workers, args.min_workers, args.pause_timeout,
                        copies=not config.privacy.keeps_discriminators)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    try:
        evaluator = make_evaluator(generator, args.eval_data_root, args.eval_every, args.eval_samples,
                                   args.eval_reference)
    except (ConfigError, OSError) as exc:  # (a compose or Helm default folder without MNIST in it, say)
        log.warning("--eval-data-root %s: %s; the generator is not scored (put MNIST/raw there for scores)",
                    args.eval_data_root, exc)
        evaluator = None
    from mdgan.tracking import Tracking

    tracking = Tracking.open(run.run_id, args.tensorboard, args.mlflow)
    recorder = RunRecorder(args.out, config.iterations, args.progress, "mdgan-server", evaluator,
                           resume_at=run.resumed_from, tracking=tracking)
    saver = ServerCheckpoints(args.out, run.run_id, args.keep_checkpoints)

    def on_iteration(record: IterationRecord, alive: int) -> None:
        recorder(record)
        observe_iteration(telemetry, record, alive)
        observe_scores(telemetry, recorder.scores)

    session = algorithm(ServerContext(args, config, run, telemetry, generator, initial_discriminator.state_dict(),
                                      roster, recorder, saver, on_iteration))
    admission = Admission(authenticated=credentials is not None, allowed_workers=tuple(allowed) if allowed else None,
                          finished_runs=frozenset(finished_run_ids(args.out)),
                          peer_probe=PeerProbe(credentials) if args.peer_check == "dial" else None)
    coordinator = Coordinator(config, telemetry=telemetry, algorithm=args.algorithm, model_layouts=layouts,
                              deadlines=Deadlines(args.heartbeat_interval, args.swap_timeout, liveness),
                              admission=admission, roster=roster, run_id=run.run_id, swap_round=session.swap_round,
                              class_names=class_names(args), describe_run=getattr(session, "describe", None))
    coordinator_pb2_grpc.add_CoordinatorServicer_to_server(coordinator, server)
    peer_pb2_grpc.add_RelayServicer_to_server(RelayServicer(telemetry, authenticated=credentials is not None,
                                                            members=coordinator.member_identities), server)
    health = rpc.add_health_and_reflection(server, [SERVICE])
    await server.start()
    await rpc.set_serving(health, [SERVICE], True)
    log.info("serving %s on port %d (%s); waiting for %d workers", SERVICE, port,
             "mutual TLS" if credentials else "PLAINTEXT", roster.start_quorum)
    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stopping.set)
    result, failure = None, None
    try:  # (from here on, whatever happens stops the gRPC server before the event loop closes)
        if args.port_file:
            with open(args.port_file + ".tmp", "w") as fh:
                fh.write(str(port))
            os.replace(args.port_file + ".tmp", args.port_file)
        result, wall = await session.run(coordinator, stopping)
        observe_scores(telemetry, recorder.scores)
        summary = write_outputs(args.out, config, generator, result, wall, "grpc", scores=recorder.scores,
                                tracking=tracking, extra={
            "algorithm": args.algorithm,
            **(session.summary_fields() if hasattr(session, "summary_fields") else {}),  # its options, say
            "run_id": run.run_id,
            "resumed_from": run.resumed_from,
            "worker_sizes": {w.worker_id: w.shard_size for w in coordinator.workers.values()},  # each worker's m
            "data": shared_split(coordinator.workers.values(), config.workers),  # what `mdgan audit` recovers
            "message_bytes": {
                "server_to_worker": counter_total(telemetry.message_bytes, direction="server_to_worker", side="sender"),
                "worker_to_server": counter_total(telemetry.message_bytes, direction="worker_to_server",
                                                  side="receiver"),
                "worker_to_worker": session.worker_to_worker_bytes(coordinator),
            },
        })
        log.info("done: run %s, %d iterations, %d/%d workers alive, generator %s", run.run_id, result.iterations,
                 result.workers_alive, result.workers, summary["generator_sha256"][:16])
        if result.stopped_early and not session.stop_requested:
            failures = coordinator.roster.failures()
            why = result.stopped_early if failures in result.stopped_early else f"{result.stopped_early}: {failures}"
            raise RunStopped(f"the run stopped early ({result.iterations} of {config.iterations} iterations): {why}")
        return summary
    except RunStopped:
        raise
    except Exception as exc:
        failure = exc
        raise
    finally:
        telemetry.dump(args.metrics_dump or os.path.join(args.out, "metrics", "server.prom"))
        await rpc.set_serving(health, [SERVICE], False)
        if failure is not None:  # nobody will resume it by itself: the workers exit too
            await coordinator.fail_run(f"the server failed: {rpc.one_line(failure)}")
        coordinator.end_streams()
        await server.stop(grace=5 if result is not None and not session.stop_requested else 1)


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



def shared_split(workers, shards: int) -> dict | None:
    """The split of the shared dataset into the run's `shards` that every worker reported (DataConfig's
    fields; data_root None: where the data is is each machine's own), or None: sites with their own data,
    or workers that disagree. (A worker the server assigns its shard knows the count only at its welcome.)"""
    splits = [{**w.connection.split, "num_shards": shards} if w.connection.split else None for w in workers]
    if not splits or any(s is None or s != splits[0] for s in splits):
        return None
    return {**splits[0], "data_root": None}


class RunStopped(Exception):
    """The run ended before its last iteration (its workers failed or left): outputs written, exit 1."""


def exit_code(exc: Exception) -> int:
    """How the server exits when serve() raised `exc`, its cause logged as the log's last line: 1 the run
    stopped early, its workers failed, or the server did; 2 a configuration, a checkpoint or the system
    (a folder it cannot make, a full disk) refused it."""
    if isinstance(exc, ConfigError):
        log.error("%s", exc.for_flags())  # a setting named by its flag, as the operator gave it
        return 2
    if isinstance(exc, (CheckpointError, OSError)):
        log.error("%s", exc or type(exc).__name__)
        return 2
    if isinstance(exc, (RunStopped, WorkersFailed)):
        log.error("%s", exc)
        return 1
    log.error("traceback of the failure", exc_info=exc)  # a bug of ours: its traceback, then the line
    log.error("the server failed: %s", rpc.one_line(exc))
    return 1


def main(argv: list[str] | None = None) -> int:
    """0 the run finished; otherwise exit_code's."""
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        configure_compute(args.threads, args.pin_cpu)
        scheduling.apply(args.cpu_scheduling)
        scheduling.apply_pin(args.pin_cpu)
        rpc.run(serve(args))
    except Exception as exc:
        return exit_code(exc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
