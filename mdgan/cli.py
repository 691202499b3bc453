"""The `mdgan` command: run a local gRPC cluster, simulate in one process, list the models.

`mdgan local` starts the real services (mdgan-server and N mdgan-worker processes) on loopback;
this module never imports gRPC itself.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time

from mdgan.config import GAN_KINDS, ConfigError, ModelSpec

TRAINING_FLAGS = ("workers", "iterations", "batch_size", "kappa", "disc_steps", "swap_epochs", "swap_every",
                  "seed", "architecture", "gan", "loss", "gen_lr", "disc_lr", "beta1", "beta2")


def _print_summary(summary: dict) -> None:
    keys = ("mode", "iterations", "workers", "workers_alive", "wall_seconds", "seconds_per_iteration",
            "generator_sha256", "payload_bytes", "swaps", "final")
    print(json.dumps({k: summary.get(k) for k in keys}, indent=2))


def cmd_simulate(args) -> int:
    from mdgan.algorithms.options import dpgan_options, pwgan_options
    from mdgan.run import simulate
    from mdgan.settings import apply_threads, data_config, evaluation_options, training_config

    apply_threads(args.threads)
    config = training_config(args)
    summary = simulate(config, data_config(args, config.workers), args.out, progress=not args.no_progress,
                       evaluation=evaluation_options(args, _eval_root(args)), algorithm=args.algorithm,
                       pwgan=pwgan_options(args), dpgan=dpgan_options(args, config.workers))
    _print_summary(summary)
    print(f"run directory: {args.out}")
    return 0


def _eval_root(args) -> str | None:
    """Scores need the MNIST test set: only for MNIST runs."""
    return args.data_root if args.dataset == "mnist" and args.eval_every >= 0 else None


def _forwarded_training_flags(args) -> list[str]:
    flags = []
    for dest in TRAINING_FLAGS:
        value = getattr(args, dest)
        if value is not None:
            flags += [f"--{dest.replace('_', '-')}", str(value)]
    if args.swap_optimizer_state:
        flags.append("--swap-optimizer-state")
    return flags


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_for_file(path: str, process: subprocess.Popen, timeout: float) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if os.path.exists(path):
            with open(path) as fh:
                return fh.read().strip()
        if process.poll() is not None:
            raise RuntimeError(f"the server exited with code {process.returncode} before serving")
        time.sleep(0.05)
    raise RuntimeError(f"the server did not start within {timeout:.0f} s")


class LocalCluster:
    """A server and N worker processes on loopback; every process logs to DIR/logs/."""

    def __init__(self, args):
        self.args = args
        self.out = os.path.abspath(args.out)
        self.logs = os.path.join(self.out, "logs")
        self.processes: list[tuple[str, subprocess.Popen]] = []

    def _spawn(self, name: str, argv: list[str]) -> subprocess.Popen:
        log = open(os.path.join(self.logs, f"{name}.log"), "w")
        process = subprocess.Popen([sys.executable, "-m", *argv], stdout=log, stderr=subprocess.STDOUT,
                                   stdin=subprocess.DEVNULL)
        self.processes.append((name, process))
        return process

    def write_targets(self, groups: list[dict]) -> None:
        """metrics_targets.json, replaced atomically (Prometheus may read it at any moment)."""
        path = os.path.join(self.out, "metrics_targets.json")
        with open(path + ".tmp", "w") as fh:
            json.dump(groups, fh, indent=2)
        os.replace(path + ".tmp", path)

    def _metrics_flags(self, name: str, port: int) -> list[str]:
        return ["--metrics-port", str(port), "--metrics-address", "127.0.0.1",
                "--metrics-dump", os.path.join(self.out, "metrics", f"{name}.prom")]

    def start(self) -> subprocess.Popen:
        a = self.args
        os.makedirs(self.logs, exist_ok=True)
        port_file = os.path.join(self.out, "server.port")
        for stale in ("server.port", "history.jsonl", "swaps.jsonl", "summary.json"):  # from an earlier run here
            if os.path.exists(os.path.join(self.out, stale)):
                os.remove(os.path.join(self.out, stale))
        metrics_ports = {name: _free_port() for name in ["server", *(f"worker-{i}" for i in range(a.workers))]}
        # Prometheus file_sd targets, so a Prometheus can scrape this cluster while it runs.
        self.write_targets([{"targets": [f"127.0.0.1:{port}"],
                             "labels": {"job": "mdgan-server" if name == "server" else "mdgan-worker",
                                        "process": name}}
                            for name, port in metrics_ports.items()])
        server = self._spawn("server", [
            "services.server", "--listen", "127.0.0.1:0", "--port-file", port_file, "--out", self.out,
            "--threads", str(a.threads), "--device", a.device, "--step-timeout", str(a.step_timeout),
            "--swap-timeout", str(a.swap_timeout),
            "--heartbeat-interval", str(a.heartbeat_interval), *self._metrics_flags("server", metrics_ports["server"]),
            "--eval-every", str(a.eval_every), "--eval-samples", str(a.eval_samples),
            "--eval-reference", str(a.eval_reference), "--dataset", a.dataset, "--algorithm", a.algorithm,
            *(["--eval-data-root", _eval_root(a)] if _eval_root(a) else []), *_forwarded_training_flags(a)])
        port = _wait_for_file(port_file, server, 120)
        for index in range(a.workers):
            name = f"worker-{index}"
            self._spawn(name, [
                "services.worker", "--server", f"127.0.0.1:{port}", "--listen", "127.0.0.1:0",
                "--advertise-address", "127.0.0.1", "--shard-index", str(index), "--num-shards", str(a.workers),
                "--dataset", a.dataset, "--data-root", a.data_root, "--split-seed", str(a.split_seed),
                "--threads", str(a.threads), "--device", a.device, "--server-timeout", str(a.step_timeout + 60),
                *self._metrics_flags(name, metrics_ports[name])])
        return server

    def follow(self, server: subprocess.Popen) -> int:
        """Show progress from history.jsonl (read incrementally) until the server exits."""
        from tqdm import tqdm

        history = os.path.join(self.out, "history.jsonl")
        pending, handle = "", None
        with tqdm(total=self.args.iterations, desc="mdgan local", unit="it", disable=self.args.no_progress) as bar:
            try:
                while True:
                    done = server.poll() is not None
                    if handle is None and os.path.exists(history):
                        handle = open(history, encoding="utf-8")
                    if handle is not None:
                        pending += handle.read()
                        *lines, pending = pending.split("\n")
                        if lines:
                            bar.update(len(lines))
                            bar.set_postfix(workers=json.loads(lines[-1]).get("active_workers"), refresh=False)
                    if done:
                        return server.returncode
                    time.sleep(0.2)
            finally:
                if handle is not None:
                    handle.close()

    def stop(self, grace: float = 30.0) -> dict[str, int | None]:
        deadline = time.monotonic() + grace
        if os.path.exists(os.path.join(self.out, "metrics_targets.json")):
            self.write_targets([])  # the processes are gone: nothing left to scrape
        codes = {}
        for name, process in self.processes:
            try:
                codes[name] = process.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                process.send_signal(signal.SIGTERM)
                try:
                    codes[name] = process.wait(5)
                except subprocess.TimeoutExpired:
                    process.kill()
                    codes[name] = process.wait()
        return codes


def cmd_local(args) -> int:
    from mdgan.settings import training_config

    training_config(args)  # fail here, with a clear message, rather than in a child process
    if args.algorithm == "standalone":
        raise ConfigError("a standalone GAN has no workers: run it with `mdgan simulate --algorithm standalone`")
    if args.algorithm in ("pwgan", "dpgan"):  # docs/ALGORITHMS.md: what their transport needs
        raise ConfigError(f"--algorithm {args.algorithm} runs in `mdgan simulate` only for now")
    cluster = LocalCluster(args)
    try:
        server = cluster.start()
        code = cluster.follow(server)
    except KeyboardInterrupt:
        code = 130
        for _, process in cluster.processes:
            process.send_signal(signal.SIGTERM)
    except RuntimeError as exc:
        print(f"mdgan local: {exc}; see {cluster.logs}", file=sys.stderr)
        code = 1
    codes = cluster.stop()
    if code != 0:
        print(f"mdgan local: the server exited with {code}; logs in {cluster.logs}", file=sys.stderr)
        return code or 1
    with open(os.path.join(cluster.out, "summary.json")) as fh:
        summary = json.load(fh)
    summary["mode"] = "local"
    summary["exit_codes"] = codes
    with open(os.path.join(cluster.out, "summary.json"), "w") as fh:
        json.dump(summary, fh, indent=2)
        fh.write("\n")
    _print_summary(summary)
    print(f"run directory: {args.out}")
    return 0


def cmd_models(args) -> int:
    from mdgan.models import ARCHITECTURES, parameter_report

    report = {arch: {gan: parameter_report(ModelSpec(architecture=arch, gan=gan)) for gan in GAN_KINDS}
              for arch in ARCHITECTURES}
    print(json.dumps(report, indent=2))
    return 0


def cmd_traffic(args) -> int:
    # The report reads Prometheus expositions: a service-side module, imported only here.
    from services.common.traffic import format_table, traffic_report

    report = traffic_report(args.run)
    print(json.dumps(report, indent=2) if args.json else format_table(report))
    return 0 if all(r["payload_matches_formula"] for r in report["rows"]) else 1


def cmd_experiment(args) -> int:
    from mdgan.experiment import run_experiment
    from mdgan.settings import apply_threads

    apply_threads(args.threads)
    result = run_experiment(args.config, progress=not args.no_progress, only_plot=args.plot_only, jobs=args.jobs,
                            threads=args.threads)
    print(json.dumps(result, indent=2))
    return 0


def cmd_sample(args) -> int:
    from mdgan.sampling import sample_run

    written = sample_run(args.run, args.n, args.out, seed=args.seed)
    print(f"wrote {written} samples to {args.out}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    from mdgan.algorithms.options import add_algorithm_arguments
    from mdgan.run import ALGORITHMS
    from mdgan.settings import (EnvArgumentParser, add_data_arguments, add_evaluation_arguments, add_threads_argument,
                                add_training_arguments)

    parser = EnvArgumentParser(prog="mdgan", description="MD-GAN: one generator, many discriminators, spread data.")
    sub = parser.add_subparsers(dest="command", required=True)

    def run_parser(name: str, help_text: str):
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.add_argument("--algorithm", choices=ALGORITHMS, default="mdgan",
                       help="MD-GAN, or a baseline: FL-GAN (federated averaging of G and D every ceil(E*m/b) "
                            "iterations), a standalone GAN on the whole dataset, the parallel Wasserstein GAN "
                            "(pwgan) or the data-parallel parameter-server GAN (dpgan); see docs/ALGORITHMS.md")
        add_training_arguments(p)
        add_data_arguments(p)
        add_evaluation_arguments(p)
        add_algorithm_arguments(p)
        # One thread per process by default: the same arithmetic in every process, so the
        # in-process run and the gRPC cluster agree bit for bit.
        add_threads_argument(p, default=1)
        p.add_argument("--out", default=f"runs/{name}", help="run directory")
        p.add_argument("--no-progress", action="store_true", help="no progress bar")
        return p

    run_parser("simulate", "Train in one process: every worker is an object.").set_defaults(func=cmd_simulate)
    local = run_parser("local", "Train on a real gRPC cluster of processes on loopback.")
    local.add_argument("--step-timeout", type=float, default=60.0, help="deadline for a worker's feedback (s)")
    local.add_argument("--swap-timeout", type=float, default=120.0, help="deadline for a discriminator swap (s)")
    local.add_argument("--heartbeat-interval", type=float, default=5.0, help="idle heartbeat period (s)")
    local.set_defaults(func=cmd_local)
    sub.add_parser("models", help="Parameter counts of every architecture, as JSON.").set_defaults(func=cmd_models)
    traffic = sub.add_parser("traffic", help="A run's measured traffic against the paper's Table III.")
    traffic.add_argument("run", help="run directory of `mdgan local`")
    traffic.add_argument("--json", action="store_true", help="print the report as JSON")
    traffic.set_defaults(func=cmd_traffic)
    experiment = sub.add_parser("experiment", help="Run a grid of trainings and plot the paper's figures.")
    experiment.add_argument("config", help="experiment YAML (see experiments/)")
    experiment.add_argument("--plot-only", action="store_true", help="only collect the results and plot them")
    experiment.add_argument("--no-progress", action="store_true", help="no progress bars")
    experiment.add_argument("--jobs", type=int, default=1,
                            help="runs at once, each in its own process with --threads torch threads (same results)")
    add_threads_argument(experiment, default=1)
    experiment.set_defaults(func=cmd_experiment)
    sample = sub.add_parser("sample", help="Draw samples from a run's generator (class-balanced for ACGAN).")
    sample.add_argument("run", help="run directory (holding checkpoint.pt and summary.json)")
    sample.add_argument("--n", type=int, default=100, help="number of samples")
    sample.add_argument("--out", required=True, help="FILE.npy (float32 in [-1, 1], with labels in FILE.labels.npy "
                                                    "for ACGAN) or FILE.png (a grid)")
    sample.add_argument("--seed", type=int, default=0, help="noise seed")
    sample.set_defaults(func=cmd_sample)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except ConfigError as exc:
        parser.error(str(exc))
        return 2


if __name__ == "__main__":
    sys.exit(main())
