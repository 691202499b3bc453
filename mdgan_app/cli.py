"""The `mdgan` command: run a local gRPC cluster, simulate in one process, list the models.

`mdgan local` starts the real services (mdgan-server and N mdgan-worker processes) on loopback;
this module never imports gRPC itself.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sys
import warnings

from services.common import scheduling
from mdgan.config import GAN_KINDS, SPLITS, ConfigError, ModelSpec, check_device

from mdgan_app.run_folder import run_dir_lock, save_launch_settings, take_launch_settings

def show_progress(args) -> bool:
    """Progress bars on a terminal only (not in the logs of compose, CI or nohup), unless --no-progress."""
    return not args.no_progress and sys.stderr.isatty()


def _print_summary(summary: dict, out: str) -> None:
    """What a person wants at the end of a run: how far it got, the scores, where the files are
    (every figure is in OUT/summary.json, docs/OUTPUTS.md)."""
    wall, per = summary.get("wall_seconds") or 0.0, summary.get("seconds_per_iteration")
    print(f"{summary.get('algorithm') or 'mdgan'} ({summary.get('mode')}): {summary.get('iterations')} iterations, "
          f"{summary.get('workers_alive')} of {summary.get('workers')} workers alive at the end, {wall:.1f} s"
          + (f" ({1000 * per:.0f} ms an iteration)" if per else "")
          + (f"; stopped early: {summary['stopped_early']}" if summary.get("stopped_early") else ""))
    scores = summary.get("scores") or {}
    if scores.get("mnist_score") is not None:
        print(f"final generator: MNIST score {scores['mnist_score']:.2f}, FID {scores['fid']:.1f} (higher score, "
              f"lower FID are better: real MNIST images score 9.6, noise 1.0 with a FID of about 1,000; "
              f"docs/RESULTS.md)")
    else:
        print("final generator: not scored (scores need MNIST-shaped samples and the MNIST test set under "
              "--data-root)")
    mb = {k: v / 1e6 for k, v in (summary.get("payload_bytes") or {}).items()}
    if any(mb.values()):
        print("payload on the wire: " + ", ".join(f"{k.replace('_to_', ' -> ').replace('_', ' ')} {v:.1f} MB"
                                                  for k, v in mb.items()))
    print(f"generator sha256 {summary.get('generator_sha256', '')[:16]}...; samples.png, summary.json, history.jsonl "
          f"in {out}")


def cmd_simulate(args) -> int:
    from mdgan.algorithms.mdgan.inprocess import parse_churn
    from mdgan.run import check_out_dir
    from mdgan.run_spec import RunSpec
    from mdgan.simulation import train
    from services.common.settings import class_names, configure_compute

    if args.resume:
        take_launch_settings(args)
    configure_compute(args.threads)
    _resolve_workers(args)
    resume = "yes" if args.resume else "no"
    spec = RunSpec.from_values({**vars(args), "resume": resume, "churn": parse_churn(args.churn),
                                "classes": class_names(args)}, command=True)

    with contextlib.ExitStack() as held:
        def accepted() -> None:  # every setting accepted: the run folder is ours from here on
            held.enter_context(run_dir_lock(args.out, "simulate"))
            check_out_dir(args.out, resume, args.overwrite)  # (again, now that no other command can write there)
            save_launch_settings(args)

        summary = train(spec, args.out, progress=show_progress(args), before_writing=accepted)
    _print_summary(summary, args.out)
    return 0


def _resolve_workers(args) -> None:
    """--workers: the number of site folders with --site-dirs (which an explicit --workers must match), else 4.
    With --site-dirs and no --dataset, the sites' format is read from the first site's folder (what
    `mdgan split` writes is an image folder)."""
    from mdgan.sites import count_sites, site_dir

    if args.site_dirs and "dataset" not in getattr(args, "given", set()):
        first = site_dir(args.site_dirs, 0)
        found = ("mnist" if os.path.isdir(os.path.join(first, "MNIST", "raw")) else
                 "cifar10" if os.path.isdir(os.path.join(first, "cifar-10-batches-py")) else "imagefolder")
        if found != args.dataset:
            print(f"mdgan {args.command}: --site-dirs {args.site_dirs} holds {found} sites: --dataset {found}",
                  file=sys.stderr)
            args.dataset = found
    if args.site_dirs:
        sites = count_sites(args.site_dirs)
        if args.workers is not None and args.workers != sites:
            raise ConfigError(f"--workers {args.workers}, but --site-dirs {args.site_dirs} holds {sites} sites")
        args.workers = sites
    elif args.workers is None:
        args.workers = 4


def cmd_local(args) -> int:
    from mdgan.data import check_stored_dataset
    from mdgan.run import check_out_dir
    from mdgan.run_spec import RunSpec
    from mdgan_app.launcher import MACHINE_PORTS, workers_per_process
    from services.common.settings import class_names

    if args.resume:  # the run's own settings, from its run directory
        take_launch_settings(args)
    _resolve_workers(args)
    resume = "yes" if args.resume else "no"
    # every setting checked here, with a clear message, rather than in a child process
    RunSpec.from_values({**vars(args), "resume": resume, "classes": class_names(args)},
                        command=True).validate(in_process=False)
    if not args.site_dirs:  # emulation: every worker reads the shared dataset (a site kit's own folder is checked)
        check_stored_dataset(args.dataset, args.data_root)
    check_out_dir(args.out, resume, args.overwrite)
    if not 0 <= args.relayed <= args.workers:
        raise ConfigError(f"--relayed must be in 0..{args.workers} (the workers), not {args.relayed}")
    if args.relayed and args.insecure:
        raise ConfigError("--relayed needs mutual TLS (relayed discriminators are sealed between the sites' "
                          "certificates): leave out --insecure")
    workers_per_process(args.workers, args.workers_per_process)  # a bad value fails here
    needed = 2 * args.workers + 2  # each service's /metrics, each worker's Peer service, the server's gRPC
    if needed > MACHINE_PORTS:
        raise ConfigError(f"--workers {args.workers}: a cluster on one machine needs {needed} ports (a /metrics "
                          f"port and a Peer service port per worker) and a machine has {MACHINE_PORTS}")
    with run_dir_lock(args.out, "local"):
        check_out_dir(args.out, "yes" if args.resume else "no", args.overwrite)  # (again, under the lock)
        return _run_local(args)


def _run_local(args) -> int:
    from mdgan_app.launcher import (LocalCluster, ServiceFailed, Terminated, _how_it_ended, _log_tail, _raise_terminated,
                                    last_log_message)

    cluster = LocalCluster(args)
    previous = {sig: signal.signal(sig, _raise_terminated) for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)}
    terminate = stop_now = False  # terminate: a signal, or a failure before the start (both said already)
    try:
        server = cluster.start()
        code = cluster.follow(server)
        # A server that failed stopped no worker: they would try to reconnect until the grace ran out.
        stop_now = code != 0
    except Terminated as exc:
        print(f"mdgan local: {exc}: stopping the cluster", file=sys.stderr)
        code, terminate = 128 + exc.signum, True
    except ServiceFailed as exc:
        print(f"mdgan local: {exc}\nmdgan local: stopping the cluster; logs in {cluster.logs}", file=sys.stderr)
        code, terminate = 1, True
    finally:
        # A second signal while we stop must not leave processes behind: stop() runs to the end.
        for sig in previous:
            signal.signal(sig, signal.SIG_IGN)
        now = terminate or stop_now
        try:
            codes = cluster.stop(grace=10.0 if now else 30.0, terminate=now)
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
    if code != 0:
        if terminate:
            pass  # (said already)
        elif code == 1:  # the server ended its log with the one line that says why
            print(f"mdgan local: {last_log_message(cluster.log_path('server'))}\nlogs in {cluster.logs}",
                  file=sys.stderr)
        else:
            print(f"mdgan local: the server {_how_it_ended(code)}; the end of its log:\n"
                  f"{_log_tail(cluster.log_path('server'))}\nlogs in {cluster.logs}", file=sys.stderr)
        return code if code > 0 else 1  # (a signal's negative code is no exit status)
    with open(os.path.join(cluster.out, "summary.json")) as fh:
        summary = json.load(fh)
    summary["mode"] = "local"
    summary["exit_codes"] = codes
    # what `mdgan audit` recovers each worker's members from (the server knows the split, not the data's folder)
    summary["site_dirs"] = os.path.abspath(args.site_dirs) if args.site_dirs else None
    if summary.get("data"):
        summary["data"]["data_root"] = os.path.abspath(args.data_root)
    from mdgan.checkpoint import atomic_write_json

    atomic_write_json(os.path.join(cluster.out, "summary.json"), summary)
    _print_summary(summary, args.out)
    return 0


def cmd_certs(args) -> int:
    # cryptography only; imported here so that other commands do not need it
    from services.common import pki

    if args.certs_command == "kit":
        return _certs_kit(args)
    if args.certs_command == "secrets":
        return _certs_secrets(args)
    try:
        if args.certs_command == "init":
            path = pki.init_ca(args.dir, days=args.days, overwrite=args.overwrite)
            print(f"CA certificate: {path}\nCA key:         {pki.ca_paths(args.dir)[1]}  (keep it safe; only "
                  f"`mdgan certs issue` needs it)")
        else:
            role = "server" if args.server else "worker"
            paths = pki.issue(args.dir, args.name, role, sans=args.san, days=args.days, overwrite=args.overwrite)
            print(f"{role} {args.name}: --tls-ca {paths['ca']} --tls-cert {paths['cert']} --tls-key {paths['key']}")
    except pki.PKIError as exc:
        raise ConfigError(str(exc)) from None
    return 0


def _certs_kit(args) -> int:
    from mdgan_app import kits
    from services.common import pki

    try:
        if args.server:
            if args.advertise or args.slot != "assign" or args.swaps != "auto":
                raise ConfigError("--advertise, --slot and --swaps are a site's: the server is reached at "
                                  "--server-address")
            folder = kits.server_kit(args.dir, args.name, args.server_address, workers=args.workers,
                                     metrics_port=args.metrics_port or kits.SERVER_METRICS_PORT, out=args.out,
                                     days=args.days, overwrite=args.overwrite, tag=args.tag)
        else:
            if args.workers is not None:
                raise ConfigError("--workers is the server's kit's (--server): a site's kit is one worker")
            if args.swaps == "relay" and args.advertise:
                raise ConfigError("--advertise is the address other sites dial, and a --swaps relay site is dialled by "
                                  "nobody: give one or the other")
            folder = kits.site_kit(args.dir, args.name, args.server_address, args.advertise, swaps=args.swaps,
                                   metrics_port=args.metrics_port or kits.DEFAULT_METRICS_PORT, slot=args.slot,
                                   out=args.out, days=args.days, overwrite=args.overwrite, tag=args.tag)
    except pki.PKIError as exc:
        raise ConfigError(str(exc)) from None
    print(f"{'server' if args.server else 'site'} kit {args.name}: {folder} (copy this folder to its machine; "
          f"{os.path.join(folder, 'README.txt')} says what to run there)")
    return 0


def _certs_secrets(args) -> int:
    from mdgan_app.kube_secrets import KubeAPI, ensure_secrets

    api = KubeAPI.in_cluster(args.api_server, args.token_file, args.api_ca, args.namespace)
    written = ensure_secrets(api, ca_secret=args.ca_secret, server_secret=args.server_secret,
                             server_name=args.server_name, server_sans=args.server_san,
                             workers_secret=args.workers_secret, worker_prefix=args.worker_prefix,
                             workers=args.workers, days=args.days,
                             labels=dict(label.split("=", 1) for label in args.label))
    for secret, keys in written.items():
        print(f"Secret {secret}: wrote {', '.join(keys)}")
    if not written:
        print("every Secret and certificate was there already: nothing to do")
    return 0


def cmd_split(args) -> int:
    from mdgan.config import DataConfig
    from mdgan.run import refuse_a_file_on_the_way
    from mdgan.sites import split_to_sites

    if args.workers < 1:
        raise ConfigError(f"--workers must be at least 1, got {args.workers}")
    refuse_a_file_on_the_way(args.out, "out")
    data = DataConfig(args.dataset, args.data_root, args.workers, args.split_seed, split=args.split,
                      dirichlet_alpha=args.alpha).validate()
    sites = split_to_sites(data, args.out, samples=args.samples)
    print(json.dumps(sites, indent=2))
    print(f"{len(sites)} site folders in {args.out}: train on them with "
          f"`mdgan local --dataset imagefolder --site-dirs {args.out}`", file=sys.stderr)
    return 0


def cmd_models(args) -> int:
    from mdgan.models import ARCHITECTURES, parameter_report

    report = {arch: {gan: parameter_report(ModelSpec(architecture=arch, gan=gan)) for gan in GAN_KINDS}
              for arch in ARCHITECTURES}
    print(json.dumps(report, indent=2))
    return 0


def cmd_traffic(args) -> int:
    from mdgan_app.traffic import format_formulas, format_table, traffic_report

    if args.run is None:  # the formulas alone
        report = _traffic_formulas(args)
        print(json.dumps(report, indent=2) if args.json else format_formulas(report))
        return 0
    report = traffic_report(args.run)
    print(json.dumps(report, indent=2) if args.json else format_table(report))
    relay = report["relay"]
    return 0 if all(r["payload_matches_formula"] for r in report["rows"]) and (
        relay is None or relay["forwarded_matches_reported"]) else 1


# the declared settings `mdgan traffic` takes for its formulas (the others: their defaults)
TRAFFIC_SETTINGS = ("workers", "batch_size", "disc_steps", "swap_epochs", "swap_every", "swap_optimizer_state",
                    "architecture", "gan", "wire_dtype")


def _traffic_formulas(args) -> dict:
    from mdgan import settings
    from mdgan.algorithms import SERVED
    from mdgan_app.traffic import DATASET_TRAIN_SIZES, formula_table
    from services.common.settings import algorithm_options

    if args.shard_size is None and args.dataset not in DATASET_TRAIN_SIZES:
        raise ConfigError(f"--dataset {args.dataset}: give the worker's shard size with --shard-size")
    # the run the formulas describe: the settings given, the others at their defaults (one iteration)
    given = {key: getattr(args, key) for key in TRAFFIC_SETTINGS}
    config = settings.training_config({**settings.defaults(), **given, "iterations": 1}, dataset=args.dataset)
    if args.shard_size is not None and args.shard_size < 1:
        raise ConfigError(f"--shard-size must be at least 1, got {args.shard_size}")
    shard_size = args.shard_size or DATASET_TRAIN_SIZES[args.dataset] // args.workers
    if shard_size < 1:
        raise ConfigError(f"--workers {args.workers}: {args.dataset}'s {DATASET_TRAIN_SIZES[args.dataset]:,} training "
                          "images leave each worker none (give --shard-size)")
    names = list(SERVED) if args.algorithm == "all" else [args.algorithm]
    return formula_table({name: algorithm_options(name, args, alone=False) for name in names}, config, shard_size)


def cmd_experiment(args) -> int:
    from mdgan_app.experiment import run_experiment
    from mdgan_app.launcher import Terminated, _raise_terminated
    from services.common.settings import configure_compute

    configure_compute(args.threads)
    if args.dry_run:
        if args.time_limit is not None:
            raise ConfigError("--time-limit is for runs to train: not with --dry-run (which trains none)")
        from mdgan_app.experiment import dry_run, dry_run_header, dry_run_row, dry_run_totals

        if args.json:
            print(json.dumps(dry_run(args.config, device=args.device, probe=args.probe, jobs=args.jobs), indent=2))
            return 0
        # each run's line as soon as it is timed (a slow probe, a GPU lent for minutes: what was timed is shown)
        width = 4

        def start(report: dict, names: list[str]) -> None:
            nonlocal width
            width = max(map(len, names), default=width)
            print(dry_run_header(report), flush=True)

        report = dry_run(args.config, device=args.device, probe=args.probe, jobs=args.jobs, on_start=start,
                         on_row=lambda row: print(dry_run_row(row, width), flush=True))
        print(dry_run_totals(report))
        return 0
    if args.time_limit is not None and args.plot_only:
        raise ConfigError("--time-limit is for runs to train: not with --plot-only")
    previous = signal.signal(signal.SIGTERM, _raise_terminated)  # stop the runs under way too, as Ctrl-C does
    try:
        result = run_experiment(args.config, progress=show_progress(args), only_plot=args.plot_only,
                                jobs=args.jobs, threads=args.threads, keep=args.keep, device=args.device,
                                time_limit=args.time_limit, probe=args.probe, on_plan=_say_plan)
    except Terminated as exc:
        print(f"mdgan experiment: {exc}: stopped; run it again to resume", file=sys.stderr)
        return 128 + exc.signum
    finally:
        signal.signal(signal.SIGTERM, previous)
    print(json.dumps(result, indent=2))
    left = [*result.get("stopped", []), *result.get("later", [])]
    if left:  # (only with --time-limit)
        print(f"mdgan experiment: --time-limit {args.time_limit:g} s: {result['ran']} runs finished now, "
              f"{len(left)} left ({', '.join(left)}); run it again to go on", file=sys.stderr)
        return EXIT_RUNS_LEFT
    return 0


EXIT_RUNS_LEFT = 3  # mdgan experiment --time-limit ended with runs not finished


def _say_plan(expected, started) -> None:
    """--time-limit: each run's estimate as it is probed, then what starts and what is left for later."""
    from mdgan_app.experiment import format_duration

    about = f"about {format_duration(expected.seconds)} ({expected.iterations_left:,} iterations)"
    if started is None:
        print(f"mdgan experiment: probed {expected.name}: {expected.seconds_per_iteration * 1000:.1f} ms an "
              f"iteration, {about}", file=sys.stderr, flush=True)
    else:
        print(f"mdgan experiment: {'start' if started else 'later'} {expected.name}: {about}"
              f"{'' if started else ', past the time limit'}", file=sys.stderr, flush=True)


def _trained_on(run: str) -> str | None:
    """The dataset a finished run trained on, as its summary.json says (None where it does not)."""
    from mdgan.sampling import read_summary

    try:
        data = read_summary(run).get("data")
    except ConfigError:
        return None
    return data.get("dataset") if isinstance(data, dict) else None


def cmd_score(args) -> int:
    import torch

    from mdgan.checkpoint import atomic_write_json
    from mdgan.evaluation import ScoreEvaluator
    from mdgan.sampling import load_generator

    if args.samples < 2:
        raise ConfigError(f"--samples must be at least 2, got {args.samples}")
    check_device(args.device)
    generator = load_generator(args.run, args.device)
    spec = generator.spec
    if tuple(spec.sample_shape) != (784,):
        raise ConfigError(f"the scores are MNIST's: this run's samples have shape {tuple(spec.sample_shape)}")
    if _trained_on(args.run) == "synthetic":  # (MNIST's shape, but no digits to score against)
        raise ConfigError("the scores are MNIST's: this run trained on the synthetic dataset")
    noise = torch.Generator().manual_seed(args.seed)
    z = torch.randn(args.samples, spec.latent_dim, generator=noise).to(args.device)
    labels = torch.arange(args.samples, device=args.device) % spec.num_classes if spec.conditional else None
    with torch.no_grad():
        images = generator(z, labels)  # (n, 784) in [-1, 1]
    scorer = ScoreEvaluator.from_mnist_test(args.data_root, n=args.reference, seed=0, device=args.device)
    scores = {"samples": args.samples, **scorer.evaluate(images)}
    if args.downstream:
        from mdgan.downstream import downstream_accuracy

        result = downstream_accuracy(generator, args.data_root, samples=args.downstream_samples,
                                     epochs=args.downstream_epochs, seed=args.seed, device=args.device)
        scores.update(downstream_accuracy=result.accuracy, downstream_samples=result.samples,
                      downstream_epochs=result.epochs)
    out = args.out or os.path.join(args.run, "scores.json")
    atomic_write_json(out, scores)
    print(json.dumps(scores, indent=2))
    print(f"wrote {out}", file=sys.stderr)
    return 0


def cmd_sample(args) -> int:
    from mdgan.sampling import sample_run

    written = sample_run(args.run, args.n, args.out, seed=args.seed)
    print(f"wrote {written} samples to {args.out}")
    return 0


def cmd_audit(args) -> int:
    from mdgan.audit import AuditSettings, audit, table, write_report

    if args.server_view:
        return _server_view_audit(args)
    for flag in ("members", "nonmembers", "generated"):
        if getattr(args, flag) < 2:
            raise ConfigError(f"--{flag} must be at least 2, got {getattr(args, flag)}")
    if args.bootstrap < 0:
        raise ConfigError(f"--bootstrap must be >= 0, got {args.bootstrap}")
    settings = AuditSettings(args.members, args.nonmembers, args.generated, args.bootstrap, args.seed, args.data_root)
    if args.site_data or args.held_out:
        if not (args.site_data and args.held_out):
            raise ConfigError("a site's own audit needs both --site-data (its training images) and --held-out "
                              "(images of its own it never trained on)")
        from mdgan.audit import audit_site

        report = audit_site(args.run, args.site_data, args.held_out, args.dataset, args.state_dir, settings)
    elif args.state_dir:
        raise ConfigError("--state-dir goes with a site's own audit (--site-data, --held-out)")
    else:
        report = audit(args.run, settings)
    written = write_report(report, args.out or os.path.join(args.run, "audit"))
    print(table(report))
    if not report["discriminators"]:
        print("(no discriminators attacked: run `mdgan simulate --save-discriminators`, or give a site's audit its "
              "worker's --state-dir, for the D attacks)")
    print("wrote " + ", ".join(written))
    return 0


def _server_view_audit(args) -> int:
    """`mdgan audit RUN --server-view`: the one-run canary audit of each site's noise (mdgan/privacy_audit.py)."""
    from mdgan import checkpoint, privacy_audit

    if args.site_data or args.held_out or args.state_dir:
        raise ConfigError("--server-view audits what the server holds: not with a site's own audit (--site-data, "
                          "--held-out, --state-dir)")
    report = privacy_audit.audit_run(args.run, args.canaries, args.guesses, args.seed)
    path = os.path.join(args.out or os.path.join(args.run, "audit"), "server_view.json")
    checkpoint.atomic_write_json(path, report)
    print(privacy_audit.table(report))
    print(f"wrote {path}")
    return 0


def add_certs_command(sub) -> None:
    """`mdgan certs`: needs none of the training code (main builds only this for it: no torch to import)."""
    from services.common.settings import certificate_days, served_port

    certs = sub.add_parser("certs", env_prefix=None, help="Provision a run's CA and the certificates of its server and workers.",
                           description="A CA in DIR (ca.crt, ca.key), then one key and certificate per identity "
                                       "in DIR/NAME/ (tls.crt, tls.key, ca.crt): the --tls-* files of the services.")
    certs_sub = certs.add_subparsers(dest="certs_command", required=True)
    init = certs_sub.add_parser("init", env_prefix=None, help="create the run's CA in DIR")
    init.add_argument("dir", help="directory of the run's PKI")
    issue = certs_sub.add_parser("issue", env_prefix=None, help="a key and certificate for NAME, signed by DIR's CA")
    issue.add_argument("dir", help="directory of the run's PKI (made by `mdgan certs init`)")
    issue.add_argument("name", help="the identity: a worker's name (its SAN), or the server's")
    role = issue.add_mutually_exclusive_group()
    role.add_argument("--worker", action="store_true", help="a worker's certificate (the default)")
    role.add_argument("--server", action="store_true",
                      help="the server's certificate (also valid for localhost, 127.0.0.1 and ::1)")
    issue.add_argument("--san", action="append", default=[],
                       help="another DNS name or IP address the certificate is valid for (repeatable), e.g. the "
                            "host name clients dial")
    kit = certs_sub.add_parser("kit", env_prefix=None, help="one machine's bundle: its key and certificate, the CA certificate, its settings and compose file",
        description="Write everything one machine of a consortium needs into one folder (default PKI/kits/NAME): "
                    "its key and certificate (issued now, valid for the name it is reached at, or checked if "
                    "PKI/NAME exists), the CA's certificate (never its key), mdgan.env, .env, docker-compose.yml "
                    "and a README. A site's kit runs one worker; the server's kit (--server) runs the server, "
                    "Prometheus (scraping every site that has a kit) and Grafana. Write the sites' kits first.")
    kit.add_argument("dir", metavar="PKI", help="directory of the run's PKI (made by `mdgan certs init`)")
    kit.add_argument("name", help="the identity: a site's name, or the server's")
    kit.add_argument("--server-address", required=True, metavar="HOST:PORT",
                     help="where the sites dial the server (the server's certificate is made valid for HOST)")
    kit.add_argument("--server", action="store_true", help="the server's kit (default: a site's)")
    kit.add_argument("--advertise", default=None, metavar="HOST[:PORT]",
                     help="a site's address as the other sites dial it for the swap (default: NAME:50052; the "
                          "certificate is made valid for HOST)")
    kit.add_argument("--swaps", choices=("auto", "direct", "relay"), default="auto",
                     help="how discriminators reach the site (mdgan-worker --swaps): relay for a site that takes no "
                          "inbound connection (no port to open: they come through the server's relay, sealed end to "
                          "end); auto (default): direct when the server can dial --advertise, else relayed")
    kit.add_argument("--slot", default="assign",
                     help="a site's rank in the run: a number, or 'assign' (default: the server gives the lowest free one)")
    kit.add_argument("--metrics-port", type=served_port, default=None, help="the /metrics port (default: 9101 a site, 9100 the server)")
    kit.add_argument("--workers", type=int, default=None,
                     help="the server's kit: the number of sites (default: the sites that have a kit in PKI)")
    kit.add_argument("--out", default=None, help="the kit's folder (default: PKI/kits/NAME)")
    kit.add_argument("--tag", default=None, help="the images' tag (default: this version's, as the Helm chart's)")
    secrets = certs_sub.add_parser("secrets", env_prefix=None, help="the Helm chart's PKI: make the run's CA and certificates into Kubernetes Secrets",
        description="Run inside the cluster (the chart's pre-install/pre-upgrade hook Job): makes whatever is "
                    "missing of the CA Secret, the server's Secret and the workers' Secret, through the Kubernetes "
                    "API with the pod's service account; never replaces what exists.")
    secrets.add_argument("--ca-secret", required=True, help="the Secret holding ca.crt and ca.key")
    secrets.add_argument("--server-secret", default=None, help="the server's Secret (ca.crt, tls.crt, tls.key)")
    secrets.add_argument("--server-name", default="mdgan-server", help="the server's identity")
    secrets.add_argument("--server-san", action="append", default=[], help="a name the server is reached at (repeatable)")
    secrets.add_argument("--workers-secret", required=True, help="the workers' Secret (ca.crt, <pod>.crt, <pod>.key)")
    secrets.add_argument("--worker-prefix", required=True, help="the worker pods' names without their ordinal")
    secrets.add_argument("--workers", type=int, required=True, help="the number of worker pods")
    secrets.add_argument("--label", action="append", default=[], metavar="KEY=VALUE", help="a label of the Secrets made")
    secrets.add_argument("--namespace", default=None, help="default: the pod's own")
    secrets.add_argument("--api-server", default=None, help="default: the cluster's (KUBERNETES_SERVICE_HOST)")
    secrets.add_argument("--token-file", default=None, help="default: the pod's service-account token")
    secrets.add_argument("--api-ca", default=None, help="default: the pod's service-account CA")
    for p in (init, issue, kit, secrets):
        p.add_argument("--days", type=certificate_days, default=365, help="validity in days")
    for p in (init, issue, kit):
        p.add_argument("--overwrite", action="store_true", help="replace existing files")
    certs.set_defaults(func=cmd_certs)


def build_parser() -> argparse.ArgumentParser:
    from mdgan.algorithms import NAMES, SERVED
    from mdgan.settings import DURABLE, RUN_SETTINGS
    from services.common.settings import (EnvArgumentParser, add_algorithm_argument, add_algorithm_options,
                                          add_scheduling_argument, add_setting_arguments, add_setting_groups,
                                          add_site_arguments, add_stop_grace_argument, add_threads_argument,
                                          add_training_arguments, add_version, positive_seconds)

    # Each command reads its own variables (MDGAN_LOCAL_WORKERS, ...), never the services' MDGAN_<FLAG>:
    # a worker's MDGAN_SERVER must not become `certs issue`'s --server. `certs` reads none.
    parser = EnvArgumentParser(prog="mdgan", description="MD-GAN: one generator, many discriminators, spread data.",
                               env_prefix=None)
    add_version(parser, "mdgan")
    sub = parser.add_subparsers(dest="command", required=True)

    def command(name: str, **kwargs):
        return sub.add_parser(name, env_prefix=f"MDGAN_{name.upper()}_", **kwargs)

    def run_parser(name: str, help_text: str):
        p = command(name, help=help_text, description=help_text, config_file=True)
        add_algorithm_argument(p, NAMES if name == "simulate" else SERVED)  # a standalone GAN has no workers
        add_training_arguments(p)
        p.set_defaults(workers=None)  # 4, or the number of --site-dirs
        # every other declared setting this command takes (mdgan/settings.py: `commands`), in its help group
        groups = add_setting_groups(p, [s.key for s in RUN_SETTINGS if name in s.commands])
        add_site_arguments(p, launcher=True)
        add_algorithm_options(p)
        # One thread per process by default: the same arithmetic in every process, so the
        # in-process run and the gRPC cluster agree bit for bit.
        add_threads_argument(p, default=1)
        p.add_argument("--out", default=f"runs/{name}", help="run directory")
        p.add_argument("--overwrite", action="store_true",
                       help="replace a finished run in --out with this one (without it such a run is refused, and "
                            "the finished run is left as it is)")
        p.add_argument("--no-progress", action="store_true", help="no progress bar")
        durable = groups[DURABLE]
        if name == "local":
            add_stop_grace_argument(durable)
        durable.add_argument("--resume", metavar="RUN", default=None,
                             help="continue the run in directory RUN from its last complete checkpoint, with the "
                                  "settings it was launched with (RUN/launch.toml); an option given with --resume "
                                  "overrides one of them (a moved --data-root, say), except the training ones")
        durable.add_argument("--run-id", default=None, help="the run's id (default: a random one)")
        return p

    simulate = run_parser("simulate", "Train in one process: every worker is an object.")
    simulate.add_argument("--churn", default=None, metavar="EVENTS",
                          help="workers leaving and coming back, e.g. leave:300:2,join:450:2 (at the boundary after "
                               "iteration 300 the worker of slot 2 leaves; after 450 it comes back, with its saved "
                               "state or a copy of a live peer's discriminator)")
    simulate.set_defaults(func=cmd_simulate)
    local = run_parser("local", "Train on a real gRPC cluster of processes on loopback.")
    local.add_argument("--step-timeout", type=positive_seconds, default=60.0, help="deadline for a worker's feedback (s)")
    local.add_argument("--swap-timeout", type=positive_seconds, default=120.0, help="deadline for a discriminator swap (s)")
    local.add_argument("--heartbeat-interval", type=positive_seconds, default=5.0, help="idle heartbeat period (s)")
    local.add_argument("--relayed", type=int, default=0, metavar="K",
                       help="the last K workers take no inbound connection (mdgan-worker --swaps relay): their "
                            "discriminators come through the server's relay, sealed end to end (needs mutual TLS)")
    local.add_argument("--insecure", action="store_true",
                       help="plaintext gRPC between the processes (default: mutual TLS with a throwaway CA made in "
                            "OUT/tls/)")
    local.add_argument("--join-timeout", type=positive_seconds, default=600.0,
                       help="seconds the server waits for all workers to join")
    add_scheduling_argument(local, default="batch")  # for every service of the cluster
    local.add_argument("--workers-per-process", type=int, default=0, metavar="K",
                       help="run K workers in each worker process (each still its own worker: data, gRPC client, "
                            "certificate, /metrics, log); 0 (default): one process per core the launcher may use, "
                            "i.e. ceil(workers / cores) each, and one process per worker when there are enough "
                            "cores. On a machine with fewer cores than workers this costs less CPU and starts "
                            "faster; killing one such process stops all of its workers")
    local.add_argument("--pin-workers", choices=scheduling.PIN_WORKERS_CHOICES, default="auto",
                       help="auto (default): when there are cores enough, keep each worker process on --threads "
                            "cores of its own (the server is left free): about 6%% less time per iteration on 2 "
                            "cores; nothing is pinned with more worker processes x --threads than cores, or with "
                            "--threads 0; off: let the kernel place them (e.g. when other programs keep a core "
                            "busy)")
    local.set_defaults(func=cmd_local)
    add_certs_command(sub)

    split_help = ("Cut a dataset into one folder per site (OUT/site-0, site-1, ...: an ImageFolder of PNG files, every "
                  "class folder present), to try the real path, where every worker brings its own data, on one machine.")
    split = command("split", help=split_help, description=split_help)
    split.add_argument("dataset", choices=("mnist", "cifar10", "synthetic"), help="the dataset to cut")
    split.add_argument("--workers", type=int, required=True, help="number of sites")
    split.add_argument("--split", choices=SPLITS, default="iid",
                       help="iid: equal random parts; dirichlet: per class, proportions over the sites ~ Dir(alpha) "
                            "(sites of different sizes and label mixes)")
    split.add_argument("--dirichlet-alpha", "--alpha", dest="alpha", type=float, default=0.5,
                       help="dirichlet concentration (smaller: more skewed); the same name as training's")
    split.add_argument("--split-seed", type=int, default=0, help="seed of the split")
    split.add_argument("--data-root", default="data", help="folder holding MNIST/raw or cifar-10-batches-py")
    split.add_argument("--samples", type=int, default=None, help="use only the dataset's first N images (quick trials)")
    split.add_argument("--out", required=True, help="folder to write site-0, site-1, ... into")
    split.set_defaults(func=cmd_split)
    command("models", help="Parameter counts of every architecture, as JSON.").set_defaults(func=cmd_models)
    traffic = command(
        "traffic", help="A run's measured traffic against its algorithm's formula, or (without RUN) the formulas.",
        description="mdgan traffic RUN: the bytes the run's processes counted, next to the per-iteration formula of "
                    "its algorithm (docs/ALGORITHMS.md); exit status 1 if they differ. Without RUN: each algorithm's "
                    "payload bytes per iteration for the settings given (the flags below; a run's come from its "
                    "summary.json).")
    traffic.add_argument("run", nargs="?", default=None, help="run directory of `mdgan local`")
    traffic.add_argument("--json", action="store_true", help="print the report as JSON")
    formulas = traffic.add_argument_group("the formulas alone (without RUN)")
    formulas.add_argument("--algorithm", choices=("all", *SERVED), default="all",
                          help="one algorithm, or all of them side by side")
    add_setting_arguments(formulas, TRAFFIC_SETTINGS, workers="N (default here: the paper's 10)",
                          batch_size="b (pwgan: n_g = n_r = b)", disc_steps="L (psgan: D rounds per iteration)",
                          swap_epochs="E: S = ceil(E m / b) (MD-GAN swaps, FL-GAN rounds)")
    traffic.set_defaults(workers=10)
    formulas.add_argument("--dataset", choices=("mnist", "cifar10", "synthetic"), default="mnist",
                          help="sets d (and m, with --shard-size unset)")
    formulas.add_argument("--shard-size", type=int, default=None, help="m, samples per worker (default: the "
                                                                       "dataset's training set / N)")
    add_algorithm_options(traffic)  # each algorithm's own options (P-WGAN's T, ...)
    traffic.set_defaults(func=cmd_traffic)
    experiment = command("experiment", help="Run a grid of trainings and plot the paper's figures.")
    experiment.add_argument("config", help="experiment YAML (see experiments/)")
    experiment.add_argument("--plot-only", action="store_true", help="only collect the results and plot them")
    experiment.add_argument("--no-progress", action="store_true", help="no progress bars")
    experiment.add_argument("--jobs", type=int, default=1,
                            help="runs at once, each in its own process with --threads torch threads (same results)")
    experiment.add_argument("--keep", metavar="DIR", default=None,
                            help="copy each finished run's record (settings, summary, evaluations, samples) and "
                                 "the tables and plots into DIR, and take runs finished there as done: an "
                                 "experiment of many days on machines that keep nothing else")
    experiment.add_argument("--dry-run", action="store_true",
                            help="train nothing: time each unfinished run's first --probe iterations here (in a "
                                 "temporary folder) and print how long each and all would take on this device")
    experiment.add_argument("--time-limit", metavar="SECONDS", type=positive_seconds, default=None,
                            help="end within SECONDS: time each unfinished run's first --probe iterations, start "
                                 "only the runs expected to end in time (shortest first), stop those under way "
                                 "when the time is up; exit 3 when runs are left for another start (a machine "
                                 "lent for minutes)")
    experiment.add_argument("--probe", type=int, default=20,
                            help="--dry-run, --time-limit: iterations timed per run")
    experiment.add_argument("--json", action="store_true", help="--dry-run: print the estimate as JSON")
    add_threads_argument(experiment, default=1)
    # --device: every run's (cpu, cuda or cuda:N); unset, each run's own `device` (cpu by default). With
    # --jobs K on a GPU, K runs share the card.
    experiment.set_defaults(func=cmd_experiment, device=None)
    score = command("score", help="Score a run's generator: MNIST score and FID, and with --downstream the accuracy "
                                  "on real MNIST of a classifier trained on its images.")
    score.add_argument("run", help="run directory (holding checkpoint.pt)")
    score.add_argument("--data-root", default="data", help="folder holding MNIST/raw (its test set is the reference)")
    score.add_argument("--samples", type=int, default=500, help="generated images scored (the paper's 500)")
    score.add_argument("--reference", type=int, default=2000, help="MNIST test images FID compares against")
    score.add_argument("--downstream", action="store_true",
                       help="also train a fixed small CNN on --downstream-samples generated labelled images and test "
                            "it on the 10,000 real MNIST test images (ACGAN runs)")
    score.add_argument("--downstream-samples", type=int, default=60000, help="generated training images")
    score.add_argument("--downstream-epochs", type=int, default=2, help="epochs of the downstream classifier")
    score.add_argument("--seed", type=int, default=0, help="the noise, labels and classifier initialisation")
    score.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    score.add_argument("--out", default=None, help="where the scores go (default: RUN/scores.json)")
    score.set_defaults(func=cmd_score)

    sample = command("sample", help="Draw samples from a run's generator (class-balanced for ACGAN).")
    sample.add_argument("run", help="run directory (holding checkpoint.pt and summary.json)")
    sample.add_argument("--n", type=int, default=100, help="number of samples")
    sample.add_argument("--out", required=True, help="FILE.npy (float32 in [-1, 1], with labels in FILE.labels.npy "
                                                    "for ACGAN) or FILE.png (a grid)")
    sample.add_argument("--seed", type=int, default=0, help="noise seed")
    sample.set_defaults(func=cmd_sample)
    audit = command("audit", help="Membership inference against a run's discriminators and generator, per site "
                                  "(docs/PRIVACY.md): AUC and TPR at low FPR with bootstrap intervals.")
    audit.add_argument("run", help="a finished run's folder (summary.json, checkpoint.pt; the discriminators from "
                                   "--save-discriminators, or what the workers of `mdgan local` kept)")
    audit.add_argument("--data-root", default=None,
                       help="where the run's shared dataset is on this machine (default: where the run read it; a "
                            "run of the services records its split, not where the data is)")
    site = audit.add_argument_group("a site's own audit, on its own machine (RUN: the run's checkpoint.pt, from "
                                    "its server)")
    site.add_argument("--site-data", metavar="DIR", default=None,
                      help="the site's training images, as its worker read them: the members")
    site.add_argument("--held-out", metavar="DIR", default=None,
                      help="images of the site's own that it never trained on, in the same format: the non-members")
    site.add_argument("--dataset", choices=("imagefolder", "mnist", "cifar10", "synthetic"), default="imagefolder",
                      help="the format of both folders (the worker's --dataset)")
    site.add_argument("--state-dir", metavar="DIR", default=None,
                      help="the worker's --state-dir: the discriminator it held at the run's end is attacked too")
    audit.add_argument("--members", type=int, default=500, help="each site's training images attacked (at most)")
    audit.add_argument("--nonmembers", type=int, default=1000, help="held-out images attacked")
    audit.add_argument("--generated", type=int, default=5000,
                       help="samples of the generator the distance attack (GAN-Leaks) compares with")
    audit.add_argument("--bootstrap", type=int, default=200, help="bootstrap resamples for the intervals (0: none)")
    audit.add_argument("--seed", type=int, default=0, help="which images and noise the audit draws")
    audit.add_argument("--out", default=None, help="where audit.json and roc.png go (default: RUN/audit)")
    server = audit.add_argument_group("the server's view of a private run (docs/PRIVACY.md): canaries through each "
                                      "site's mechanism, one run, an empirical lower bound on epsilon")
    server.add_argument("--server-view", action="store_true",
                        help="audit each site's noise as an attacker holding what the server holds (its answers, the "
                             "settings and seed, a recorded --dp-fixed-noise): server_view.json")
    server.add_argument("--canaries", type=int, default=1000, help="canaries a site, each in with probability 1/2")
    server.add_argument("--guesses", type=int, default=200, help="the attacker's guesses ('in'), its surest")
    audit.set_defaults(func=cmd_audit)
    return parser


def build_certs_parser() -> argparse.ArgumentParser:
    """The parser of `mdgan certs` alone, as build_parser makes it."""
    from services.common.settings import EnvArgumentParser, add_version

    parser = EnvArgumentParser(prog="mdgan", env_prefix=None)
    add_version(parser, "mdgan")
    add_certs_command(parser.add_subparsers(dest="command", required=True))
    return parser


def _exit_status_of(exc: Exception) -> int | None:
    """2: a bad setting or input (ConfigError, a damaged or foreign checkpoint); 1: the system's refusal (OSError);
    None: neither. (mdgan.checkpoint imports torch, which `mdgan certs` never loads: asked only once imported.)"""
    checkpoints = sys.modules.get("mdgan.checkpoint")
    if isinstance(exc, ConfigError) or (checkpoints is not None and isinstance(exc, checkpoints.CheckpointError)):
        return 2
    return 1 if isinstance(exc, OSError) else None


def main(argv: list[str] | None = None) -> int:
    tokens = sys.argv[1:] if argv is None else list(argv)
    # `mdgan certs` runs where the certificates are made (a compose one-shot, a chart's hook Job, a
    # site's machine): it parses alone, without the training code's imports (torch: seconds a call)
    parser = build_certs_parser() if tokens[:1] == ["certs"] else build_parser()
    args = parser.parse_args(argv)
    from services.common import settings

    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
    after = tokens[tokens.index(args.command) + 1:] if args.command in tokens else tokens
    args.given = settings.given_options(commands[args.command], after)  # what this command chose (--resume keeps it)
    # What Ctrl-C leaves: the coroutine of a training step it cut short, never awaited. Not news.
    warnings.filterwarnings("ignore", message="coroutine .* was never awaited", category=RuntimeWarning)
    try:
        return args.func(args)
    except Exception as exc:
        # A bad value found while running (a data file, a flag combination, a damaged checkpoint; 2), or the
        # system's refusal (a folder that cannot be made, a full disk; 1): said under the subcommand's name,
        # without the top-level usage banner that would say nothing about it. Anything else is a bug: its traceback.
        status = _exit_status_of(exc)
        if status is None:
            raise
        # a setting named by its flag, as given here; an experiment's by its key, as its YAML file gives it
        message = exc.for_flags() if isinstance(exc, ConfigError) and args.command != "experiment" else exc
        print(f"{parser.prog} {args.command}: error: {message}", file=sys.stderr)
        return status
    except KeyboardInterrupt:  # Ctrl-C in a command that runs in this process (`local` stops its cluster itself)
        print(f"{parser.prog} {args.command}: interrupted", file=sys.stderr)
        return 128 + signal.SIGINT


if __name__ == "__main__":
    sys.exit(main())
