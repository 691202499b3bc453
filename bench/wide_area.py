"""Which algorithm reaches a given quality first over our links? The server and N sites each in a network
namespace of their own, every site's link shaped with `tc tbf` to a rate of its own; MD-GAN (`--sync all`,
`quorum`, `async`, pipelined, with and without background swaps, float32 and int8 on the wire), FL-GAN and the
parameter-server GAN run one after another over the same links, with the same seed and data.

    sudo nice -n 5 python bench/wide_area.py                                  # the defaults below, ~55 min
    sudo python bench/wide_area.py --rates 100mbit,10mbit,1mbit --budget 120 --only mdgan-async,mdgan-async-lag

- The LAN (bench/netns.py Consortium): one bridge, a namespace per machine, names only (server.wan.test,
  site-0.wan.test, ...), mutual TLS with a throwaway CA. Site i's link carries a token bucket at rates[i]
  on both ends (`tc qdisc add ... tbf rate RATE burst 32kbit latency 400ms`), so everything it receives
  (batches, models, a peer's discriminator) and sends (feedback, its discriminator, its models) crosses
  RATE; the server's own link is not shaped. `--rtt MS` adds a round trip of MS between each site and
  the server (half each way on the site's link; bench/delay_link.py, since this kernel has no netem).
- Every configuration trains for --budget seconds of training time (the sum of its iterations' wall
  times, the first one left out: it holds the workers' warm-up), then the server gets SIGTERM. The
  server scores its G every --eval-every iterations on --eval-samples samples (in a thread of its own).
- Printed per configuration, and written to OUT/wide_area.json: G updates per second over the whole run
  (swaps included) and between swaps (iterations that neither start a swap round nor install one; MD-GAN
  only: FL-GAN and the parameter-server GAN have no such iterations to tell apart), their ratio, the bytes
  through each site's link both ways, the training seconds to reach each FID of --fids (first evaluation
  at or below it), and the last scores. Ratios compare within one invocation only; run it on an
  otherwise idle machine (the load average is printed).

Needs root (CAP_NET_ADMIN, CAP_SYS_ADMIN) and iproute2, and MNIST under --data-root.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from netns import Consortium, why_not_available  # noqa: E402
from processes import kill_all, read_jsonl, tls_flags  # noqa: E402

FOREVER = 1_000_000  # --iterations: the budget stops the run


def configurations(workers: int, lag: int, depth: int) -> dict[str, list[str]]:
    """label -> the server's flags that make it."""
    quorum = ["--sync", "quorum", "--quorum", str(workers - 1)]
    pipeline = ["--pipeline-depth", str(depth)]
    asynchronous = ["--sync", "async", "--max-staleness", "4"]
    background = ["--swap-lag", str(lag)]
    return {
        "mdgan-all": ["--algorithm", "mdgan"],
        "mdgan-all-lag": ["--algorithm", "mdgan", *background],
        "mdgan-pipeline": ["--algorithm", "mdgan", *pipeline],
        "mdgan-pipeline-lag": ["--algorithm", "mdgan", *pipeline, *background],
        "mdgan-pipeline-lag-int8": ["--algorithm", "mdgan", *pipeline, *background, "--wire-dtype", "int8"],
        "mdgan-quorum": ["--algorithm", "mdgan", *quorum],
        "mdgan-quorum-lag": ["--algorithm", "mdgan", *quorum, *background],
        "mdgan-async": ["--algorithm", "mdgan", *asynchronous],
        "mdgan-async-lag": ["--algorithm", "mdgan", *asynchronous, *background],
        "mdgan-async-lag-int8": ["--algorithm", "mdgan", *asynchronous, *background, "--wire-dtype", "int8"],
        "flgan": ["--algorithm", "flgan"],
        # a step on the gradients of all but one (the parameter-server analogue of quorum): with every worker's
        # needed, the 1 Mbit site's models (2 x 8 MB an iteration) miss the step deadline and the run stops
        "psgan": ["--algorithm", "psgan", "--ps-threshold", str(workers - 1)],
    }


def training_seconds(rows: list[dict]) -> float:
    return sum(r["seconds"] for r in rows if r["iteration"] > 1)


def measure(out: str, fids: list[float], mdgan: bool) -> dict:
    """What one configuration's history.jsonl and swaps.jsonl say."""
    rows = read_jsonl(os.path.join(out, "history.jsonl"))
    swaps = [s for s in read_jsonl(os.path.join(out, "swaps.jsonl")) if "round" in s]
    timed = [r for r in rows if r["iteration"] > 1]
    seconds = training_seconds(rows)
    elapsed, clock = {}, 0.0  # iteration -> training seconds when it ended
    for r in rows:
        clock += r["seconds"] if r["iteration"] > 1 else 0.0
        elapsed[r["iteration"]] = clock
    evaluations = [e for r in rows for e in r.get("evaluations", [])]
    installs = {s.get("installed", s["iteration"]) for s in swaps}
    between = [r for r in timed if r.get("swap_round") is None and r["iteration"] not in installs]
    result = {"iterations": len(timed), "training_seconds": round(seconds, 1),
              "updates_per_second": len(timed) / seconds if seconds else 0.0,
              "swap_rounds": len(swaps),
              "evaluations": [{"iteration": e["eval_iteration"], "seconds": round(elapsed.get(e["eval_iteration"], 0), 1),
                               "fid": e["fid"], "mnist_score": e["mnist_score"]} for e in evaluations]}
    if mdgan and between:
        between_seconds = sum(r["seconds"] for r in between)
        result["between_swaps_per_second"] = len(between) / between_seconds
        result["whole_over_between"] = result["updates_per_second"] / result["between_swaps_per_second"]
        result["seconds_in_swaps"] = round(sum(r.get("swap_seconds", 0.0) for r in timed), 1)
    result["time_to_fid"] = {}
    for threshold in fids:
        reached = [e for e in result["evaluations"] if e["fid"] <= threshold]
        result["time_to_fid"][str(threshold)] = reached[0]["seconds"] if reached else None
    if result["evaluations"]:
        last = result["evaluations"][-1]
        result["last"] = {"iteration": last["iteration"], "fid": last["fid"], "mnist_score": last["mnist_score"]}
    return result


def run(label: str, flags: list[str], args, lan: Consortium, sites: list[str], tls: str, out: str,
        min_iterations: int = 0, until=None) -> dict:
    """Train one configuration for args.budget training seconds and at least min_iterations, or until
    until(history rows) is true."""
    os.makedirs(out, exist_ok=True)
    logs = open(os.path.join(out, "processes.log"), "w")
    n = len(sites)
    server = subprocess.Popen(lan.wrap("server", [
        sys.executable, "-m", "services.server", "--listen", "0.0.0.0:50051", "--out", out, "--threads", "1",
        "--metrics-port", "0", "--workers", str(n), "--iterations", str(FOREVER), "--batch-size",
        str(args.batch_size), "--swap-every", str(args.swap_every), "--seed", str(args.seed), "--dataset", "mnist",
        "--eval-every", str(args.eval_every), "--eval-samples", str(args.eval_samples), "--eval-data-root",
        args.data_root, "--join-timeout", "300", *tls_flags(tls, "mdgan-server"), *flags]),
        cwd=REPO, stdout=logs, stderr=subprocess.STDOUT)
    workers = [subprocess.Popen(lan.wrap(site, [
        sys.executable, "-m", "services.worker", "--server", f"{lan.host('server')}:50051", "--listen",
        "0.0.0.0:50052", "--advertise-address", lan.host(site), "--shard-index", str(i), "--num-shards", str(n),
        "--data-root", args.data_root, "--threads", "1", "--metrics-port", "0",
        *tls_flags(tls, f"worker-{i}")]), cwd=REPO, stdout=logs, stderr=subprocess.STDOUT)
        for i, site in enumerate(sites)]
    before = {site: lan.bytes_shaped(site) for site in sites}
    load = [os.getloadavg()[0]]
    history = os.path.join(out, "history.jsonl")
    try:
        while True:
            rows = read_jsonl(history)
            if training_seconds(rows) >= args.budget and len(rows) >= min_iterations or until and until(rows):
                break
            if server.poll() is not None:
                raise SystemExit(f"{label}: the server exited; see {out}/processes.log")
            time.sleep(1)
        load.append(os.getloadavg()[0])
        server.send_signal(signal.SIGTERM)
        server.wait(120)
    finally:
        kill_all([server, *workers])
        logs.close()
    result = measure(out, args.fids, "mdgan" in flags)
    result["flags"] = flags
    result["load"] = load
    result["link_bytes"] = {site: {"to_site": after[0] - before[site][0], "from_site": after[1] - before[site][1]}
                            for site, after in ((s, lan.bytes_shaped(s)) for s in sites)}
    return result


def pick(chosen: dict, only: str) -> dict:
    """The configurations --only names (comma-separated; all of them when empty)."""
    if not only:
        return chosen
    unknown = set(only.split(",")) - set(chosen)
    if unknown:
        raise SystemExit(f"--only: unknown {sorted(unknown)}; known: {', '.join(chosen)}")
    return {k: v for k, v in chosen.items() if k in only.split(",")}


def certificates(out: str, sites: list[str]) -> str:
    """A throwaway CA under OUT/pki, the server's certificate and one per site (worker-i): its folder."""
    from services.common import pki

    tls = os.path.join(out, "pki")
    pki.init_ca(tls, overwrite=True)
    pki.issue(tls, "mdgan-server", "server", sans=["server.wan.test"], overwrite=True)
    for i, site in enumerate(sites):
        pki.issue(tls, f"worker-{i}", "worker", sans=[f"{site}.wan.test"], overwrite=True)
    return tls


def wan(sites: list[str], rates: list[str], rtt: float, jitter: float = 0.0) -> Consortium:
    """The server and the sites, site i's link at rates[i] and, when rtt > 0, a round trip of rtt ms to the
    server: half each way on the site's own link."""
    half = f"{rtt / 2:g}ms"
    delayed = {site: (half, half) for site in sites} if rtt > 0 else {}
    return Consortium(["server", *sites], domain="wan.test", shaped=dict(zip(sites, rates)), delayed=delayed,
                      jitter=f"{jitter:g}ms")


def fmt(value, spec: str = ".0f", none: str = "-") -> str:
    return none if value is None else format(value, spec)


def report(results: dict, args, sites: list[str]) -> str:
    rates = dict(zip(sites, args.rates))
    lines = [f"N={len(sites)} sites at {', '.join(args.rates)}, round trip {args.rtt:g} ms; b={args.batch_size}, "
             f"swap every {args.swap_every}, "
             f"lag {args.lag}, pipeline depth {args.depth}; {args.budget:.0f} s of training each; FID on "
             f"{args.eval_samples} samples every "
             f"{args.eval_every} iterations", "",
             "| configuration | G updates/s (whole run) | between swaps | whole / between | s in swaps | iterations "
             + "".join(f"| s to FID {f:g} " for f in args.fids) + "| last FID (iteration) | MB in / out, slowest link |",
             "| --- " * (8 + len(args.fids)) + "|"]
    slowest = sites[-1]
    for label, r in results.items():
        link = r["link_bytes"][slowest]
        lines.append(
            f"| {label} | {r['updates_per_second']:.2f} | {fmt(r.get('between_swaps_per_second'), '.2f')} | "
            f"{fmt(r.get('whole_over_between'), '.2f')} | {fmt(r.get('seconds_in_swaps'), '.0f')} | {r['iterations']} "
            + "".join(f"| {fmt(r['time_to_fid'][str(f)])} " for f in args.fids)
            + f"| {fmt(r.get('last', {}).get('fid'))} ({r.get('last', {}).get('iteration', '-')}) "
            f"| {link['to_site'] / 1e6:.1f} / {link['from_site'] / 1e6:.1f} |")
    lines.append("")
    lines.append(f"slowest link: {slowest} at {rates[slowest]}; load average before/after each run: "
                 + ", ".join(f"{k} {r['load'][0]:.1f}/{r['load'][-1]:.1f}" for k, r in results.items()))
    return "\n".join(lines)


def plot(results: dict, args, path: str) -> None:
    """FID against training seconds, one line per configuration (the time-to-FID curves)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for label, r in results.items():
        points = [(e["seconds"], e["fid"]) for e in r["evaluations"]]
        if points:
            ax.plot(*zip(*points), marker=".", label=label)
    for threshold in args.fids:
        ax.axhline(threshold, color="grey", linewidth=0.5, linestyle="--")
    ax.set_xlabel("training seconds")
    ax.set_ylabel(f"FID ({args.eval_samples} samples; lower is better)")
    ax.set_title(f"sites at {', '.join(args.rates)}; swap every {args.swap_every}, lag {args.lag}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rates", default="100mbit,100mbit,10mbit,1mbit",
                        help="each site's link, in tc's syntax, one site per rate (default: %(default)s)")
    parser.add_argument("--rtt", type=float, default=0.0,
                        help="each site's round trip to the server in ms, half of it each way on its link "
                             "(bench/delay_link.py; 0: none)")
    parser.add_argument("--jitter", type=float, default=0.0, help="each frame's delay spread by +- this many ms")
    parser.add_argument("--sysctl", action="append", default=[], metavar="KEY=VALUE",
                        help="a network setting for every machine's namespace, repeatable "
                             "(net.ipv4.tcp_slow_start_after_idle=0: no return to slow start after an idle link)")
    parser.add_argument("--budget", type=float, default=300.0, help="training seconds per configuration")
    parser.add_argument("--swap-every", type=int, default=400)
    parser.add_argument("--lag", type=int, default=200, help="--swap-lag of the background configurations")
    parser.add_argument("--depth", type=int, default=4, help="--pipeline-depth of the pipelined configurations")
    parser.add_argument("--batch-size", type=int, default=10)
    parser.add_argument("--eval-every", type=int, default=250)
    parser.add_argument("--eval-samples", type=int, default=500)
    parser.add_argument("--fids", default="600,450", help="FID thresholds, comma-separated")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--only", default="", help="comma-separated configurations (default: all of them)")
    parser.add_argument("--out", default="/tmp/mdgan-wide-area")
    parser.add_argument("--data-root", default=os.path.join(os.path.dirname(REPO), "shared", "data"))
    parser.add_argument("--report", action="store_true",
                        help="train nothing: the table again from OUT/wide_area.json (other --fids, say)")
    args = parser.parse_args()
    args.rates = args.rates.split(",")
    args.fids = [float(f) for f in args.fids.split(",")]
    if args.report:
        with open(os.path.join(args.out, "wide_area.json")) as fh:
            saved = json.load(fh)
        fids = args.fids
        args = argparse.Namespace(**{**saved["args"], "fids": fids, "out": args.out})
        for r in saved["results"].values():
            r["time_to_fid"] = {str(f): next((e["seconds"] for e in r["evaluations"] if e["fid"] <= f), None)
                                for f in fids}
        print(report(saved["results"], args, [f"site-{i}" for i in range(len(args.rates))]))
        plot(saved["results"], args, os.path.join(args.out, "time_to_fid.png"))
        return
    reason = why_not_available()
    if reason:
        raise SystemExit(f"cannot build the links: {reason}")
    sites = [f"site-{i}" for i in range(len(args.rates))]
    chosen = pick(configurations(len(sites), args.lag, args.depth), args.only)
    tls = certificates(args.out, sites)
    results = {}
    with wan(sites, args.rates, args.rtt, args.jitter) as lan:
        for machine in lan.machines.values():  # (TCP's settings are each network namespace's own)
            for setting in args.sysctl:
                subprocess.run(["ip", "netns", "exec", machine["ns"], "sysctl", "-q", "-w", setting], check=True)
        for label, flags in chosen.items():
            print(f"{label}: {' '.join(flags)}", flush=True)
            results[label] = run(label, flags, args, lan, sites, tls, os.path.join(args.out, label))
            r = results[label]
            print(f"  {r['iterations']} iterations in {r['training_seconds']} s, {r['updates_per_second']:.2f}/s, "
                  f"last {r.get('last')}", flush=True)
            with open(os.path.join(args.out, "wide_area.json"), "w") as fh:
                json.dump({"args": {k: v for k, v in vars(args).items()}, "results": results}, fh, indent=1)
    print(report(results, args, sites))
    plot(results, args, os.path.join(args.out, "time_to_fid.png"))


if __name__ == "__main__":
    main()
