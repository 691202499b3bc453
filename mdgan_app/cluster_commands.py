"""What each service of `mdgan local`'s cluster is told: mdgan-server's and each mdgan-worker's command line,
made from the launcher's arguments (the declared settings the server takes as they are, the data each worker
reads, the deadlines, the telemetry), and the throwaway PKI whose flags they carry. Nothing here starts a process.
"""

from __future__ import annotations

import os

from mdgan.settings import RUN_SETTINGS, TRACKING, TRAINING_KEYS


def eval_root(args) -> str | None:
    """Scores need the MNIST test set: only for MNIST runs (with --site-dirs, --data-root may still hold it)."""
    if args.dataset == "mnist" and args.eval_every >= 0 and not args.site_dirs:
        return args.data_root
    if args.eval_every >= 0 and args.site_dirs and os.path.isdir(os.path.join(args.data_root, "MNIST", "raw")):
        return args.data_root
    return None


# the declared settings `mdgan local` hands its server as they are (mdgan/settings.py `commands`; the server defines
# their flags): training's, the run settings both take (but the tracking paths, made absolute below), and the dataset
# (which sets the server's sample shape)
SERVER_SETTINGS = (*TRAINING_KEYS, *(s.key for s in RUN_SETTINGS if {"local", "server"} <= set(s.commands)
                                     and s.group != TRACKING), "dataset")


def forwarded_training_flags(args) -> list[str]:
    """The run's declared settings the server takes, as mdgan-server's flags."""
    from mdgan.settings import EVERY_SETTING

    flags = []
    for key in SERVER_SETTINGS:
        setting, value = EVERY_SETTING[key], getattr(args, key)
        if setting.kind is bool:
            flags += [] if value is None else [setting.flag if value else "--no-" + setting.flag[2:]]
        elif value is not None:
            flags += [setting.flag, str(value)]
    return flags


def metrics_flags(out: str, name: str, port: int) -> list[str]:
    """A service's telemetry: its /metrics on loopback, dumped into OUT/metrics/NAME.prom as it ends."""
    return ["--metrics-port", str(port), "--metrics-address", "127.0.0.1",
            "--metrics-dump", os.path.join(out, "metrics", f"{name}.prom")]


def security_flags(args, out: str) -> dict[str, list[str]]:
    """Per service ("server", "worker-I"): the --tls-* flags of a throwaway PKI made in OUT/tls/ (a new CA every
    run), or --insecure for everyone when the user asked for plaintext."""
    names = ["server", *(f"worker-{i}" for i in range(args.workers))]
    if args.insecure:
        return {name: ["--insecure"] for name in names}
    from services.common import pki  # cryptography only; no gRPC here

    identities = {"server": "mdgan-server", **{n: n for n in names[1:]}}
    issued = pki.provision_run(os.path.join(out, "tls"), names[1:], server=identities["server"])
    return {name: ["--tls-ca", issued[identities[name]]["ca"], "--tls-cert", issued[identities[name]]["cert"],
                   "--tls-key", issued[identities[name]]["key"]] for name in names}


class ClusterCommands:
    """The services' command lines for a cluster of `args` in the run folder `out`: the server's module and flags,
    a worker's flags (its module depends on where it is placed)."""

    def __init__(self, args, out: str):
        self.args = args
        self.out = out

    def server(self, port_file: str, security: list[str], metrics_port: int) -> list[str]:
        """mdgan-server's: it listens on a port of loopback the kernel picks, and writes it into `port_file`."""
        from services.common.settings import algorithm_flags

        a = self.args
        return [
            "services.server", "--listen", "127.0.0.1:0", "--port-file", port_file, "--out", self.out,
            "--threads", str(a.threads), "--cpu-scheduling", a.cpu_scheduling,  # few cores for many: batch
            "--device", a.device, "--step-timeout", str(a.step_timeout),
            "--swap-timeout", str(a.swap_timeout), "--join-timeout", str(a.join_timeout),
            "--heartbeat-interval", str(a.heartbeat_interval), *metrics_flags(self.out, "server", metrics_port),
            "--algorithm", a.algorithm,
            "--stop-grace", str(a.stop_grace),
            *(["--resume", "yes"] if a.resume else []), *(["--run-id", a.run_id] if a.run_id else []),
            *security,
            *(["--eval-data-root", eval_root(a)] if eval_root(a) else []),
            *(["--classes", a.classes] if a.classes else []), *forwarded_training_flags(a),
            *algorithm_flags(a.algorithm, a),
            *(["--tensorboard", os.path.abspath(a.tensorboard)] if a.tensorboard else []),
            *(["--mlflow", a.mlflow if "://" in a.mlflow else os.path.abspath(a.mlflow)] if a.mlflow else [])]

    def worker(self, index: int, server_port: str, attacks: bool, security: list[str], metrics_port: int) -> list[str]:
        """worker-INDEX's (its module is chosen where it is placed: a process of its own or of several): a site
        (--site-dirs) reads its own folder only; emulated, it is given the shared dataset and keeps shard INDEX."""
        from mdgan.sites import site_dir

        a = self.args
        name = f"worker-{index}"
        if a.site_dirs:
            data = ["--data-root", site_dir(os.path.abspath(a.site_dirs), index), "--bad-images", a.bad_images]
        else:
            data = ["--num-shards", str(a.workers), "--data-root", a.data_root, "--split-seed", str(a.split_seed),
                    "--split", a.split, "--dirichlet-alpha", str(a.dirichlet_alpha),
                    "--max-samples", str(a.max_samples)]
        return [
            "--server", f"127.0.0.1:{server_port}", "--listen", "127.0.0.1:0",
            "--advertise-address", "127.0.0.1", "--shard-index", str(index), "--dataset", a.dataset, *data,
            "--threads", str(a.threads), "--cpu-scheduling", a.cpu_scheduling, "--device", a.device,
            "--server-timeout", str(a.step_timeout + 60),
            "--state-dir", os.path.join(self.out, "workers", name),
            *(["--dp-fixed-noise", str(a.dp_fixed_noise)] if a.dp_fixed_noise is not None else []),
            *(["--attack", a.attack] if attacks else []),
            *(["--swaps", "relay"] if index >= a.workers - getattr(a, "relayed", 0) else []),
            *security, *metrics_flags(self.out, name, metrics_port)]
