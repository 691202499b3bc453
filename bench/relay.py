"""Relayed swaps against direct ones, over one emulated wide-area network, in one invocation.

    sudo nice -n 5 python bench/relay.py                        # 4 sites, 100 Mbit/s, 80 ms round trip
    sudo python bench/relay.py --sites 4 --rate 100mbit --rtt 80 --iterations 80 --swap-every 10 --out runs/relay

The server and the sites each in a network namespace of their own (bench/netns.py Consortium); every link,
the server's included, shaped to --rate both ways (tc tbf), and a round trip of --rtt ms between each site
and the server (half each way on the site's link: bench/delay_link.py, since this kernel has no netem), so a
direct push from one site to another crosses both sites' links, and a relayed one both sites' links and the
server's twice. The same run (same seed, data and settings, MD-GAN with barrier swaps) trains twice: every site
serving its Peer service (direct), then every site taking no inbound connection (--swaps relay, with its link
dropping connection attempts into it). Printed, and written to OUT/relay.json: the swap round's mean seconds
(the iterations that swap), the mean seconds of the iterations between swaps, the run's G updates per second,
the relayed bytes, and the ratios relayed / direct. Both generators must be equal (printed): the path does not
change the arithmetic. Ratios compare within one invocation only; the load average is printed.

Needs root (CAP_NET_ADMIN, CAP_SYS_ADMIN) and iproute2.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from netns import Consortium, why_not_available  # noqa: E402
from processes import kill_all, read_jsonl, tls_flags  # noqa: E402


def certificates(out: str, sites: list[str], domain: str) -> str:
    from services.common import pki

    tls = os.path.join(out, "pki")
    pki.init_ca(tls, overwrite=True)
    pki.issue(tls, "mdgan-server", "server", sans=[f"server.{domain}"], overwrite=True)
    for i, site in enumerate(sites):
        pki.issue(tls, f"worker-{i}", "worker", sans=[f"{site}.{domain}"], overwrite=True)
    return tls


def train(mode: str, args, lan: Consortium, sites: list[str], tls: str, out: str) -> dict:
    os.makedirs(out, exist_ok=True)
    n = len(sites)
    with open(os.path.join(out, "processes.log"), "w") as logs:
        server = subprocess.Popen(lan.wrap("server", [
            sys.executable, "-m", "services.server", "--listen", "0.0.0.0:50051", "--out", out, "--threads", "1",
            "--metrics-port", "0", "--workers", str(n), "--iterations", str(args.iterations), "--batch-size",
            str(args.batch_size), "--swap-every", str(args.swap_every), "--seed", "7", "--dataset", "synthetic",
            "--eval-every", "-1", "--join-timeout", "300", "--metrics-dump", os.path.join(out, "server.prom"),
            *tls_flags(tls, "mdgan-server")]), cwd=REPO, stdout=logs, stderr=subprocess.STDOUT)
        workers = [subprocess.Popen(lan.wrap(site, [
            sys.executable, "-m", "services.worker", "--server", f"{lan.host('server')}:50051", "--listen",
            "0.0.0.0:50052", "--advertise-address", lan.host(site), "--shard-index", str(i), "--num-shards", str(n),
            "--dataset", "synthetic", "--threads", "1", "--metrics-port", "0", "--swaps",
            "relay" if mode == "relayed" else "direct", *tls_flags(tls, f"worker-{i}")]),
            cwd=REPO, stdout=logs, stderr=subprocess.STDOUT) for i, site in enumerate(sites)]
        try:
            if server.wait(args.timeout) != 0:
                raise SystemExit(f"{mode}: the server failed; see {out}/processes.log")
            for worker in workers:
                worker.wait(60)
        finally:
            kill_all([server, *workers])
    rows = read_jsonl(os.path.join(out, "history.jsonl"))[1:]  # (the first holds the warm-up)
    with open(os.path.join(out, "summary.json")) as fh:
        summary = json.load(fh)
    swapping = [r["seconds"] for r in rows if r["swap_seconds"] > 1e-3]
    between = [r["seconds"] for r in rows if r["swap_seconds"] <= 1e-3]
    relayed = 0.0
    with open(os.path.join(out, "server.prom")) as fh:
        for line in fh:
            if line.startswith("mdgan_relayed_bytes_total{"):
                relayed += float(line.rsplit(" ", 1)[1])
    return {"mode": mode, "swap_iteration_seconds": statistics.mean(swapping),
            "swap_seconds": statistics.mean(r["swap_seconds"] for r in rows if r["swap_seconds"] > 1e-3),
            "between_swaps_seconds": statistics.mean(between), "updates_per_second": len(rows) / sum(
                r["seconds"] for r in rows), "swap_rounds": len(swapping), "relayed_bytes": relayed,
            "generator_sha256": summary["generator_sha256"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sites", type=int, default=4)
    parser.add_argument("--rate", default="100mbit", help="every link's rate, the server's included (tc tbf)")
    parser.add_argument("--rtt", type=float, default=80.0, help="ms of round trip between each site and the server")
    parser.add_argument("--iterations", type=int, default=80)
    parser.add_argument("--swap-every", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=10)
    parser.add_argument("--timeout", type=float, default=900.0, help="the most one run may take (s)")
    parser.add_argument("--out", default="runs/bench-relay")
    args = parser.parse_args()
    why = why_not_available()
    if why:
        raise SystemExit(f"bench/relay.py needs network namespaces: {why}")
    sites = [f"site-{i}" for i in range(args.sites)]
    domain = "relay.test"
    tls = certificates(args.out, sites, domain)
    half = f"{args.rtt / 2:g}ms"
    results = {}
    print(f"load average before: {os.getloadavg()[0]:.2f}; {args.sites} sites, every link {args.rate}, "
          f"{args.rtt:g} ms round trip site-server, {args.iterations} iterations, a swap every {args.swap_every}",
          flush=True)
    for mode in ("direct", "relayed"):
        closed = tuple(sites) if mode == "relayed" else ()
        with Consortium(["server", *sites], domain=domain, shaped={m: args.rate for m in ["server", *sites]},
                        delayed={site: (half, half) for site in sites}, no_inbound=closed) as lan:
            results[mode] = train(mode, args, lan, sites, tls, os.path.join(args.out, mode))
        r = results[mode]
        print(f"{mode:8} swap iteration {r['swap_iteration_seconds']:.3f} s (swap {r['swap_seconds']:.3f} s), "
              f"between swaps {r['between_swaps_seconds']:.3f} s, {r['updates_per_second']:.2f} G updates/s, "
              f"relayed {r['relayed_bytes'] / 1e6:.1f} MB", flush=True)
    direct, relayed = results["direct"], results["relayed"]
    ratios = {key: relayed[key] / direct[key] for key in ("swap_seconds", "swap_iteration_seconds",
                                                          "between_swaps_seconds", "updates_per_second")}
    print("relayed / direct: " + ", ".join(f"{k} {v:.2f}" for k, v in ratios.items()))
    print(f"same generator: {direct['generator_sha256'] == relayed['generator_sha256']}; "
          f"load average after: {os.getloadavg()[0]:.2f}")
    with open(os.path.join(args.out, "relay.json"), "w") as fh:
        json.dump({"settings": vars(args), "results": results, "ratios": ratios,
                   "load_average_after": os.getloadavg()[0]}, fh, indent=2)


if __name__ == "__main__":
    main()
