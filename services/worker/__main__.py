"""mdgan-worker: loads its data, serves the Peer service, joins the server and trains.

Its data is either the site's own (the default: everything under --data-root is this worker's,
whatever its size) or, to emulate sites from one shared dataset as in the paper (--num-shards N),
shard --shard-index of N cut from it."""

from __future__ import annotations

import asyncio
import fcntl
import json
import logging
import os
import re
import signal
import socket
import sys
import uuid

import grpc

from mdgan import devices
from mdgan.settings import DURABLE, EMULATION
from mdgan.config import ConfigError, TrainingConfig
from mdgan.data import load_shard, load_stored_dataset
from mdgan.sites import load_site
from mdgan.run import refuse_a_file_on_the_way
from services.common import scheduling
from services.common.settings import (add_setting_arguments, add_version, command_settings, EnvArgumentParser, add_affinity_argument, add_data_arguments, add_scheduling_argument,
                            add_threads_argument, configure_compute, data_config, dial_address, listen_address,
                            log_level, port_number, positive_seconds)
from services.common import codec, pki, rpc, tls
from services.common.proto import peer_pb2_grpc
from services.common.telemetry import Telemetry
from mdgan.checkpoint import CheckpointError
from services.worker.algorithms.base import RunFailed, WorkerFailed
from services.worker.node import (FINAL_REFUSALS, JoinRefused, ServerGone, ServerLink, SitePolicy, WorkerData,
                                  WorkerNode, WorkerState)
from services.worker.peer import PEER_SERVICE, PeerServicer
from services.worker.node import SWAP_PATHS

log = logging.getLogger("mdgan.worker")
LOG_FORMAT = "%(asctime)s %(name)s %(levelname)s %(message)s"


def build_parser() -> EnvArgumentParser:
    parser = EnvArgumentParser(prog="mdgan-worker", description=__doc__, config_file=True)
    add_version(parser, "mdgan-worker")
    parser.add_argument("--server", type=dial_address, default="localhost:50051", help="host:port of the mdgan server")
    parser.add_argument("--listen", type=listen_address, default="0.0.0.0:50052", help="host:port to serve the Peer service on (port 0: any)")
    parser.add_argument("--advertise-address", default=None,
                        help="HOST or HOST:PORT peers use to reach this worker (default: this host's name; the port "
                             "defaults to the bound one)")
    parser.add_argument("--swaps", choices=SWAP_PATHS, default="auto",
                        help="how discriminators reach this site: direct (peers push to its Peer service at "
                             "--advertise-address, which they must be able to dial), relay (through the server's relay, "
                             "over this site's own outbound connection: no port to open; needs mutual TLS), auto "
                             "(direct when the server can dial it at join, else relayed; the default)")
    parser.add_argument("--shard-index", default="auto",
                        help="this worker's slot (rank), and with --num-shards N > 1 the shard of the shared data it "
                             "keeps: a number; 'auto', the trailing number of the host name (a StatefulSet pod's "
                             "ordinal); or 'assign', the lowest free slot, chosen by the server")
    parser.add_argument("--num-shards", type=int, default=None,
                        help="emulation: --data-root is a dataset shared by N workers, cut into N shards (--split, "
                             "--split-seed), and this worker keeps one; unset (default): all of --data-root is this "
                             "site's own data")
    parser.add_argument("--connect-timeout", type=positive_seconds, default=300.0, help="seconds to keep trying the server")
    parser.add_argument("--server-timeout", type=positive_seconds, default=120.0,
                        help="leave when no server of our run has been heard for this long (s): a broken stream "
                             "is retried (exponential backoff with jitter) until then")
    parser.add_argument("--state-dir", default=None,
                        help="where this worker keeps its run id and checkpoints (D, Adam, sampler state); "
                             "without it the worker cannot take part in checkpoints or restore after a crash")
    add_setting_arguments(parser, command_settings("worker", DURABLE), keep_checkpoints="saved states kept in --state-dir")
    parser.add_argument("--run-id", default=None,
                        help="join this run only (default: the run recorded in --state-dir, else any)")
    parser.add_argument("--metrics-port", type=port_number, default=9101, help="HTTP port of /metrics (0: none)")
    parser.add_argument("--metrics-address", default="0.0.0.0", help="address /metrics listens on")
    parser.add_argument("--metrics-dump", default=None, help="write the final metrics exposition to this file")
    parser.add_argument("--log-level", type=log_level, default="INFO", help="logging level")
    parser.add_argument("--name", default=None,
                        help="the identity this worker claims with --insecure (default: worker-<shard index>; with "
                             "--shard-index assign, the server names it after the shard it assigns); under mutual TLS the identity is the "
                             "name in --tls-cert")
    parser.add_argument("--tls-server-name", default=None,
                        help="the name the server's certificate must carry (default: the host in --server)")
    tls.add_tls_arguments(parser)
    add_threads_argument(parser, default=0)
    add_scheduling_argument(parser, default="normal")
    add_affinity_argument(parser)
    add_data_arguments(parser)
    parser.add_argument("--swap-check", choices=("run", "on", "off"), default="run",
                        help="MD-GAN: check a discriminator pushed to this worker before it replaces ours (norm, "
                             "direction and loss on our own data; docs/PRIVACY.md): run (as the server's run says), "
                             "on or off; a refused one is answered PERMISSION_DENIED and we keep our own")
    parser.add_argument("--dp-max-epsilon", type=float, default=0.0,
                        help="in a differentially private run (docs/PRIVACY.md): leave the run, saying so, rather "
                             "than take a step that would spend more than this epsilon (0: no limit of this site's; "
                             "the run's --dp-target-epsilon is a limit too)")
    parser.add_argument("--privacy-dir", default=None,
                        help="in a differentially private run: the folder of this site's privacy ledger, which counts "
                             "every step or answer it releases before it leaves and holds the secret its noise comes "
                             "from (docs/PRIVACY.md); keep it across restarts (default: --state-dir; a private run "
                             "needs one of the two)")
    parser.add_argument("--dp-fixed-noise", type=int, default=None,
                        help="research and tests only: this site's DP noise and sampling come from this number and its "
                             "slot instead of a secret it makes itself; the guarantee then holds only against those "
                             "who do not know the number, and the server's privacy record says it was set")
    g = parser.add_argument_group("emulation, for experiments and tests only")
    add_setting_arguments(g, command_settings("worker", EMULATION), attack=(
        "behave as a Byzantine worker: send sign-flipped (-F), scaled (10 F), both (-10 F), noise (10x F's RMS) or "
        "zero (free-ride) feedback instead of F, or (swap-*) push a zeroed, sign-flipped, scaled (10x) or random "
        "discriminator at each swap (mdgan/attacks.py)"))
    g.add_argument("--slow-factor", type=float, default=1.0,
                   help="behave as a straggler: every iteration takes this many times as long (waits "
                        "(F - 1) x the time its compute took before answering)")
    return parser


def resolve_shard_index(value: str, ordinal_required: bool = True) -> int | None:
    """The shard index (a site's: its slot), or None when the server is to assign one.

    'auto' without a trailing number in the host name: an error for a shard of a shared dataset,
    'assign' for a site (whose data does not depend on its slot)."""
    if value == "assign":
        return None
    if value != "auto":
        try:
            return int(value)
        except ValueError:
            raise ConfigError(f"--shard-index must be a number or 'auto', got {value!r}") from None
    match = re.search(r"-(\d+)$", socket.gethostname())
    if not match and not ordinal_required:
        return None
    if not match:
        raise ConfigError(f"--shard-index auto: host name {socket.gethostname()!r} does not end in -<number>")
    return int(match.group(1))


def worker_identity(args, credentials: tls.TLSConfig | None, index: int | None) -> str:
    """Under mTLS the certificate's name; with --insecure the claimed --name (or a default)."""
    if credentials is not None:
        if args.name and args.name != credentials.identity:
            log.warning("--name %r ignored: under mutual TLS this worker is %r, the name in its certificate",
                        args.name, credentials.identity)
        return credentials.identity
    # Without --name: worker-<shard index>, or (shard assigned by the server) no name at all, and the
    # server names it after the shard it gets (several workers on one host must not share a name).
    name = args.name or (f"worker-{index}" if index is not None else "")
    if name and not pki.NAME_PATTERN.match(name):
        raise ConfigError(f"--name {name!r}: letters, digits, '.', '_' and '-' only")
    return name


_held_locks = []  # open lock files: a folder stays ours as long as this process lives


def claim_state_dir(root: str) -> tuple[str, dict]:
    """A sub-folder of `root` locked for this process: an unlocked one of an unfinished run if any
    (its current.json is returned), else a new one."""
    os.makedirs(root, exist_ok=True)

    def lock(folder: str) -> bool:
        fh = open(os.path.join(folder, ".lock"), "a")
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            fh.close()
            return False
        _held_locks.append(fh)
        return True

    candidates = []
    for name in sorted(os.listdir(root)):
        folder = os.path.join(root, name)
        try:
            with open(os.path.join(folder, "current.json")) as fh:
                saved = json.load(fh)
        except (OSError, ValueError):
            continue
        if not saved.get("finished"):
            candidates.append((folder, saved))
    for folder, saved in candidates:
        if lock(folder):
            return folder, saved
    folder = os.path.join(root, f"worker-{uuid.uuid4().hex[:8]}")
    os.makedirs(folder)
    lock(folder)
    return folder, {}


def advertise_address(value: str | None, bound_port: int) -> str:
    host = value or socket.gethostname()
    return host if re.search(r":\d+$", host) else f"{host}:{bound_port}"


async def serve(args) -> str:
    own_data = args.num_shards is None
    data = data_config(args, 1 if own_data else args.num_shards)
    TrainingConfig(device=args.device).validate()  # a CUDA device that is not there: say so before joining
    devices.deterministic(args.device)
    if not args.slow_factor >= 1:
        raise ConfigError(f"--slow-factor must be >= 1, got {args.slow_factor}")
    if args.dp_fixed_noise is not None and args.dp_fixed_noise < 0:
        raise ConfigError(f"--dp-fixed-noise must be a whole number >= 0, got {args.dp_fixed_noise}")
    if args.state_dir:
        refuse_a_file_on_the_way(args.state_dir, "state_dir")
    index = resolve_shard_index(args.shard_index, ordinal_required=not own_data)
    credentials = tls.from_args(args, "mdgan-worker")
    if args.swaps == "relay" and credentials is None:
        raise ConfigError("--swaps relay needs mutual TLS (relayed discriminators are sealed between the sites' "
                          "certificates): give --tls-ca, --tls-cert and --tls-key, or --swaps direct")
    # the ports bound before the state folder is touched: an address this host cannot listen on is a setting refused
    telemetry = Telemetry("worker")
    guard = rpc.HostileInputGuard(on_reject=lambda reason: telemetry.rejected.labels(reason).inc())
    # A peer sends one chunk (<= 1 MiB) or one header per message: nothing bigger is accepted.
    server = rpc.make_server(max_receive_bytes=rpc.message_bytes_for(codec.CHUNK_BYTES), guard=guard,
                             max_send_bytes=rpc.message_bytes_for(0), max_concurrent_streams=8)
    port = tls.add_port(server, args.listen, credentials)
    telemetry.serve(args.metrics_port, args.metrics_address)
    if args.state_dir and index is None:
        # Replicas without an ordinal share one state volume: each locks a folder of its own in it,
        # and one restarted after a crash takes back the folder (and the shard) of an unfinished run.
        args.state_dir, saved = claim_state_dir(args.state_dir)
        if saved.get("shard_index") is not None and not saved.get("finished"):
            index = int(saved["shard_index"])
            log.info("state %s: back in run %s with shard %d", args.state_dir, saved.get("run_id"), index)
    if own_data:  # a site: all of its data is this worker's, whatever its size
        site = load_site(data.dataset, data.data_root, args.bad_images)
        source = {"site": site, "slot": index}
        classes = (f"{len(site.class_names)} classes" if site.class_names else "unlabelled") \
            if site.class_names is not None else f"{site.num_classes} numbered classes"
        log.info("this site holds %d samples (%s, %s)%s", len(site), classes, site.image_shape,
                 f"; {len(site.skipped)} unusable images skipped" if site.skipped else "")
    elif index is None and data.split != "iid":
        raise ConfigError("--shard-index assign works with --split iid only (the server sizes the shards it "
                          "assigns from the i.i.d. split); give each worker its --shard-index")
    elif index is None:
        images, labels = load_stored_dataset(data)  # uint8 where stored so: 4x less until the shard is cut
        source = {"dataset": (images, labels, data)}
        log.info("loaded %d samples; the server will assign a shard", images.shape[0])
    else:
        shard = load_shard(data, index)
        source = {"shard": shard, "split": data}
        log.info("holding shard %d of %d (%d samples)", shard.index, shard.num_shards, len(shard))

    identity = worker_identity(args, credentials, index)
    node = WorkerNode(
        ServerLink(args.server, credentials, identity, args.tls_server_name, args.connect_timeout, args.server_timeout),
        WorkerData(**source), telemetry=telemetry, device=args.device,
        state=WorkerState(args.state_dir, args.keep_checkpoints, args.run_id),
        policy=SitePolicy(None if args.swap_check == "run" else args.swap_check, args.dp_max_epsilon,
                          os.path.abspath(args.privacy_dir) if args.privacy_dir else None, args.dp_fixed_noise,
                          args.attack, args.slow_factor))
    node.peer_servicer = PeerServicer(node)
    node.swaps = args.swaps
    # (relayed: it still listens, for its own healthcheck on this host, but tells nobody the address)
    peer_pb2_grpc.add_PeerServicer_to_server(node.peer_servicer, server)
    health = rpc.add_health_and_reflection(server, [PEER_SERVICE])
    await server.start()
    await rpc.set_serving(health, [PEER_SERVICE], True)
    if args.swaps == "relay":
        log.info("serving %s on port %d for this host only (--swaps relay): discriminators come through the "
                 "server's relay", PEER_SERVICE, port)
    else:
        node.advertise_address = advertise_address(args.advertise_address, port)
        log.info("serving %s on port %d, advertised as %s", PEER_SERVICE, port, node.advertise_address)

    try:
        return await node.run()
    finally:
        telemetry.dump(args.metrics_dump)
        await rpc.set_serving(health, [PEER_SERVICE], False)
        await server.stop(grace=2)


def exit_code(exc: BaseException) -> int | None:
    """How a worker that ended with `exc` exits, its reason logged in one line: 0 stopped by a signal,
    1 this worker failed (told to the server) or the server stopped the run as failed, 2 a
    configuration, the system's or the server's fault, 3 refused by the server; None for an ending
    it does not know."""
    if isinstance(exc, (WorkerFailed, RunFailed)):
        log.error("%s", exc)
        return 1
    if isinstance(exc, JoinRefused):
        log.error("the server refused us: %s", exc)
        return 3
    if isinstance(exc, (ConfigError, ServerGone, CheckpointError)):
        log.error("%s", exc.for_flags() if isinstance(exc, ConfigError) else exc)
        return 2
    if isinstance(exc, grpc.aio.AioRpcError):
        log.error("the server refused us: %s %s", exc.code().name, exc.details())
        return 3 if exc.code() in FINAL_REFUSALS else 2  # 3: refused, as a JoinRefused
    if isinstance(exc, asyncio.CancelledError):
        log.info("terminated by signal")
        return 0
    if isinstance(exc, OSError):  # a folder it cannot make or write, a full disk: the system's words
        log.error("%s", exc or type(exc).__name__)
        return 2
    return None


async def until_signalled(*coroutines):
    """Run the coroutines as tasks that SIGTERM and SIGINT cancel; their outcomes, as gather's
    with return_exceptions (a cancelled one: its CancelledError)."""
    loop = asyncio.get_running_loop()
    tasks = [asyncio.ensure_future(c) for c in coroutines]
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, lambda: [t.cancel() for t in tasks])
    return await asyncio.gather(*tasks, return_exceptions=True)


def configure_process(args) -> None:
    """What is the process's, not one worker's: torch threads and the allocator, CPU scheduling and
    affinity. Raises ConfigError for a CPU this process may not use, or more threads than its CPUs."""
    configure_compute(args.threads, args.pin_cpu)
    scheduling.apply(args.cpu_scheduling)
    scheduling.apply_pin(args.pin_cpu)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level, format=LOG_FORMAT)
    try:
        configure_process(args)
    except ConfigError as exc:
        return exit_code(exc)
    (outcome,) = rpc.run(until_signalled(serve(args)))
    if isinstance(outcome, BaseException):
        code = exit_code(outcome)
        if code is None:
            raise outcome  # a bug: its traceback
        return code
    log.info("finished: %s", outcome)
    return 0


if __name__ == "__main__":
    sys.exit(main())
