"""The wide-area table with latency: for four sites behind links of each rate and round trip, each
configuration's G updates a second over the link, and its time to reach an FID.

    sudo python bench/wide_area_table.py measure --out /tmp/wat --budget 30                       # ~55 min
    sudo python bench/wide_area_table.py measure --out /tmp/wat --budget 60 --only mdgan-pipeline --again
    python bench/wide_area_table.py report --out /tmp/wat                                # the tables
    sudo python bench/wide_area_table.py check --out /tmp/wat --rates 100mbit --rtts 80 --config mdgan-all --fid 653.07

- `measure` builds, for each rate of --rates and round trip of --rtts, four sites behind that link
  (bench/wide_area.py's LAN: a namespace per machine, mutual TLS, `tc tbf` at the rate both ways, the
  round trip half each way on each site's link through bench/delay_link.py) and trains each
  configuration with no evaluation, one after another, for --warm-up and then --budget seconds of
  training. Its rate: G updates (FL-GAN: local steps) per training second after the warm-up, the first
  iteration (FL-GAN: the first round, whose rows share its wall time) left out: they hold the workers'
  start. OUT/rates.json; `--again` measures again what it has. `rates` computes the rates again from
  the runs' histories (another --warm-up) without training.
- `report` divides each configuration's iterations to an FID by its rate (`--into DOC`: into the
  document's block `<!-- generated: python bench/wide_area_table.py report ... -->`). The iterations
  come from `mdgan simulate` runs of the same setting (experiments/wide-area-scores-mlp-cpu.yaml, and
  wide-area-scores-int8-mlp-cpu.yaml for the int8 wire, kept in --scores, comma-separated; a label's runs come
  from the first of them that scores it, so list the longest runs first): every
  configuration here but `quorum` computes over any link exactly what `mdgan simulate` computes, bit for
  bit (`local == simulate`), so where a run reaches an FID does not depend on the link, only how long it
  takes. `quorum` drops the last answer of each iteration, which depends on timing;
  its iterations are those of `all` (in one process every worker answers at once, and quorum is `all`
  there), so its times are an estimate, marked so.
- `check` trains one configuration over one link until its own evaluation (every --eval-every
  iterations, in the server's thread) reaches --fid, and writes OUT/checks/NAME.json: the training
  seconds it took, the scores' iteration, and whether every FID it scored is the scores' own. `report`
  sets each check beside its prediction.

Every configuration uses the setting of the scores' experiment: MNIST, MLP ACGAN, N = 4 IID shards,
b = 10, k = 1, a swap (FL-GAN: a round) every 400 iterations. Rates compare within one machine only; run
`measure` and `check` on an otherwise idle machine (the load average is recorded with each rate).

Needs root (CAP_NET_ADMIN, CAP_SYS_ADMIN) and iproute2 for `measure` and `check`, MNIST under --data-root.
"""

from __future__ import annotations

import argparse
import csv
import glob
import json
import os
import re
import statistics
import subprocess
import sys
from dataclasses import dataclass

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import wide_area  # noqa: E402
from netns import why_not_available  # noqa: E402
from processes import read_jsonl  # noqa: E402

WORKERS = 4
SETTING = {"batch_size": 10, "swap_every": 400, "eval_samples": 500}


def configurations(depth: int) -> dict[str, dict]:
    """label -> the server's flags, and the label of the scores' runs whose iterations it takes."""
    pipeline = ["--algorithm", "mdgan", "--pipeline-depth", str(depth)]
    # batches, feedback and swapped discriminators as int8 (mdgan/compression.py): scores of its own
    int8 = [*pipeline, "--wire-dtype", "int8"]
    lag = SETTING["swap_every"] // 2  # swap rounds in the background, installed half a swap period later
    return {
        "mdgan-all": {"flags": ["--algorithm", "mdgan"], "scores": "MD-GAN all"},
        "mdgan-quorum": {"flags": ["--algorithm", "mdgan", "--sync", "quorum", "--quorum", str(WORKERS - 1)],
                         "scores": "MD-GAN all", "estimate": True},
        "mdgan-pipeline": {"flags": pipeline, "scores": f"MD-GAN depth {depth}"},
        "mdgan-pipeline-int8": {"flags": int8, "scores": f"MD-GAN depth {depth}, int8"},
        "mdgan-pipeline-int8-lag": {"flags": [*int8, "--swap-lag", str(lag)],
                                    "scores": f"MD-GAN depth {depth}, int8, lag {lag}"},
        "flgan": {"flags": ["--algorithm", "flgan"], "scores": "FL-GAN"},
        # every worker's gradients each step (the default threshold), so that it computes what simulate does
        "psgan": {"flags": ["--algorithm", "psgan"], "scores": "parameter-server GAN"},
    }


def cell_key(rate: str, rtt: float) -> str:
    return f"{rate} {rtt:g}ms"


def run_args(args, budget: float, eval_every: int, fids: list[float]) -> argparse.Namespace:
    return argparse.Namespace(**SETTING, seed=args.seed, budget=budget, eval_every=eval_every, fids=fids,
                              data_root=args.data_root)


SITES = [f"site-{i}" for i in range(WORKERS)]
# a document's generated table: its command (group 1) and what that command printed (group 2)
BLOCK = re.compile(r"<!-- generated: (python bench/wide_area_table\.py report [^>]*?) -->\n(.*?)<!-- /generated -->",
                   re.S)


def measure(args) -> None:
    chosen = wide_area.pick(configurations(args.depth), args.only)
    path = os.path.join(args.out, "rates.json")
    saved = load(path) if os.path.exists(path) else {"setting": {**SETTING, "workers": WORKERS,
                                                                   "depth": args.depth}, "rates": {}}
    if args.sysctl:
        saved["setting"].setdefault("sysctl", args.sysctl)
    if saved["setting"]["depth"] != args.depth or saved["setting"].get("sysctl", []) != args.sysctl:
        raise SystemExit(f"{path} holds rates at --depth {saved['setting']['depth']} with sysctl "
                         f"{saved['setting'].get('sysctl', [])}: another --out for depth {args.depth} with "
                         f"{args.sysctl}")
    tls = wide_area.certificates(args.out, SITES)
    for rate in args.rates:
        for rtt in args.rtts:
            key = cell_key(rate, rtt)
            with wide_area.wan(SITES, [rate] * WORKERS, rtt) as lan:
                tune(lan, args.sysctl)
                for label, config in chosen.items():
                    if label in saved["rates"].get(key, {}) and not args.again:
                        continue
                    out = os.path.join(args.out, "runs", f"{rate}-{rtt:g}ms", label)
                    print(f"{key} {label}: {' '.join(config['flags'])}", flush=True)
                    r = wide_area.run(label, config["flags"], run_args(args, args.budget + args.warm_up, 100_000, []),
                                      lan, SITES, tls, out, min_iterations=3 * first_rows(label))
                    saved["rates"].setdefault(key, {})[label] = {
                        **steady(out, label, args.warm_up), "swap_rounds": r["swap_rounds"], "load": r["load"],
                        "link_bytes": r["link_bytes"]}
                    got = saved["rates"][key][label]
                    print(f"  {got['iterations']} iterations in {got['training_seconds']} s after the warm-up: "
                          f"{got['updates_per_second']:.2f}/s (load {r['load'][0]:.1f}/{r['load'][-1]:.1f})",
                          flush=True)
                    write(path, saved)


def tune(lan, settings: list[str]) -> None:
    """--sysctl KEY=VALUE in every namespace of the LAN (TCP's settings are each network namespace's own)."""
    for machine in lan.machines.values():
        for setting in settings:
            subprocess.run(["ip", "netns", "exec", machine["ns"], "sysctl", "-q", "-w", setting], check=True)


def first_rows(label: str) -> int:
    """The rows that hold the workers' start: the first iteration's, or FL-GAN's first round's (its rows share
    their round's wall time)."""
    return SETTING["swap_every"] if label == "flgan" else 1


def steady(out: str, label: str, warm_up: float) -> dict:
    """The rate of a run's history after its start and the first `warm_up` seconds of training (the pipeline
    fills and TCP's windows open in them)."""
    clock, kept, in_swaps = 0.0, [], 0.0
    for row in read_jsonl(os.path.join(out, "history.jsonl")):
        if row["iteration"] > first_rows(label):
            clock += row["seconds"]
            if clock > warm_up:
                kept.append(row["seconds"])
                in_swaps += row.get("swap_seconds") or 0.0  # MD-GAN: a swap round's exchange within its iteration
    seconds = sum(kept)
    return {"updates_per_second": len(kept) / seconds if seconds else 0.0, "iterations": len(kept),
            "training_seconds": round(seconds, 1), "warm_up": warm_up, "swap_seconds": round(in_swaps, 2)}


def rates_again(args) -> None:
    """rates.json's rates again from the runs' own histories (another --warm-up), training nothing."""
    path = os.path.join(args.out, "rates.json")
    saved = load(path)
    for key, cell in saved["rates"].items():
        rate, rtt = key.split()
        for label, measured in cell.items():
            measured.update(steady(os.path.join(args.out, "runs", f"{rate}-{rtt}", label), label, args.warm_up))
    write(path, saved)


def load(path: str) -> dict:
    with open(path) as fh:
        return json.load(fh)


def write(path: str, data: dict) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as fh:
        json.dump(data, fh, indent=1)
    os.replace(tmp, path)


@dataclass
class ScoredRuns:
    """One label's kept runs: seed -> [(iteration, FID)], from one scores' experiment."""
    folder: str
    runs: dict[int, list[tuple[int, float]]]

    @property
    def longest(self) -> int:
        return max((i for curve in self.runs.values() for i, _ in curve), default=0)


def iterations_to(scores: list[str]) -> dict[str, ScoredRuns]:
    """label -> its kept runs, from the first scores' experiment (their results.csv) that scores the label: a later
    one's runs of a label already given are left out, so that every seed of a label comes from one experiment."""
    labels: dict[str, ScoredRuns] = {}
    for folder in scores:
        found: dict[str, dict[int, list[tuple[int, float]]]] = {}
        with open(os.path.join(folder, "results.csv")) as fh:
            for row in csv.DictReader(fh):
                found.setdefault(row["label"], {}).setdefault(int(row["seed"]), []).append(
                    (int(row["iteration"]), float(row["fid"])))
        for label, runs in found.items():
            labels.setdefault(label, ScoredRuns(folder, runs))
    return labels


def first_at(curve: list[tuple[int, float]], threshold: float) -> int | None:
    """The first scored iteration whose FID is at or below the threshold."""
    return next((i for i, fid in sorted(curve) if fid <= threshold), None)


def duration(seconds: float) -> str:
    return f"{seconds / 60:.1f} min" if seconds < 5400 else f"{seconds / 3600:.1f} h"


def time_to(runs: dict[int, list[tuple[int, float]]], threshold: float, speed: float) -> list[float]:
    """Seconds each seed's run takes to reach the FID at `speed` G updates a second (seeds that reach it)."""
    return [i / speed for i in (first_at(curve, threshold) for curve in runs.values()) if i is not None]


def report(args) -> str:
    saved = load(os.path.join(args.out, "rates.json"))
    scored = iterations_to(args.scores)
    chosen = configurations(saved["setting"]["depth"])
    rates = saved["rates"]
    lines = ["Time to an FID: the mean over the seeds that reach it (+- their sd; how many of how many), "
             "'-' where none does within its runs (their length: below); '~': quorum's iterations are all's; "
             "'not scored': its rate only, no `mdgan simulate` runs of it in the scores."]
    for rate in dict.fromkeys(k.split()[0] for k in rates):
        cells = [k for k in rates if k.split()[0] == rate]
        zero = rates.get(cell_key(rate, 0), {})
        lines += ["", f"### Every site at {rate}", "",
                  "| configuration | round trip | G updates/s | / its rate at 0 ms | / MD-GAN all at 0 ms | "
                  + " | ".join(f"time to FID {f:g}" for f in args.fids) + " |",
                  "| --- " * (5 + len(args.fids)) + "|"]
        first: dict[tuple[str, float], tuple[float, str]] = {}
        for label, config in chosen.items():
            runs = scored[config["scores"]].runs if config["scores"] in scored else {}
            for key in cells:
                measured = rates[key].get(label)
                if measured is None:
                    continue
                speed = measured["updates_per_second"]
                base = zero.get(label, {}).get("updates_per_second")
                paper = zero.get("mdgan-all", {}).get("updates_per_second")
                times = []
                for threshold in args.fids:
                    if not runs:  # its rate only: no scores' runs of this configuration
                        times.append("not scored")
                        continue
                    got = time_to(runs, threshold, speed)
                    if not got:
                        times.append("-")
                        continue
                    cell = ("~" if config.get("estimate") else "") + duration(statistics.mean(got))
                    cell += f" (+- {duration(statistics.stdev(got))}, {len(got)} of {len(runs)})" if len(got) > 1 \
                        else f" ({len(got)} of {len(runs)})"
                    times.append(cell)
                    if len(got) == len(runs) and not config.get("estimate"):
                        best = first.get((key, threshold))
                        if best is None or statistics.mean(got) < best[0]:
                            first[(key, threshold)] = (statistics.mean(got), label)
                lines.append(f"| {label} | {key.split()[1]} | {speed:.2f} | "
                             f"{'-' if not base else format(speed / base, '.2f')} | "
                             f"{'-' if not paper else format(speed / paper, '.2f')} | " + " | ".join(times) + " |")
        lines.append("")
        for (key, threshold), (seconds, label) in first.items():
            lines.append(f"- first to FID {threshold:g} at {key.split()[1]}: {label} ({duration(seconds)}; of the "
                         "configurations whose every seed reaches it)")
        for label in chosen:
            shares = [f"{100 * rates[key][label]['swap_seconds'] / rates[key][label]['training_seconds']:.1f}% at "
                      f"{key.split()[1]}" for key in cells
                      if rates[key].get(label, {}).get("swap_seconds") and rates[key][label]["training_seconds"]]
            if shares:
                lines.append(f"- {label}: share of its training time in swap rounds, the most --swap-lag could hide: "
                             + ", ".join(shares))
    lines += ["", "Iterations to each FID (the first scored iteration at or below it), per seed of the scores:"]
    for label, found in scored.items():
        runs = found.runs
        lines.append(f"- {label} ({os.path.basename(found.folder.rstrip(os.sep))}, to {found.longest:,}): " + "; ".join(
            f"FID {f:g}: " + ", ".join(str(first_at(runs[s], f) or "-") for s in sorted(runs)) for f in args.fids))
    checks = sorted(glob.glob(os.path.join(args.out, "checks", "*.json")))
    if checks:
        lines += ["", "Checks, trained over the link until their own evaluation reached the FID (scored every 500 "
                  "iterations in the server's thread); predicted: the scores' iteration / the rate above:", "",
                  "| configuration | link | seed | FID | at iteration (scores') | training seconds | predicted | "
                  "every FID as the scores' |", "| --- " * 8 + "|"]
        for path in checks:
            c = load(path)
            speed = rates[c["cell"]][c["config"]]["updates_per_second"]
            same = f"{'yes' if all(c['fids_as_scored']) else 'no'} ({len(c['fids_as_scored'])})"
            lines.append(f"| {c['config']} | {c['cell']} | {c['seed']} | {c['fid']:.1f} | {c['iteration']} "
                         f"({c['predicted_iteration']}) | {c['seconds']:.0f} | "
                         f"{c['predicted_iteration'] / speed:.0f} | {same} |")
    loads = [r["load"][-1] for cell in rates.values() for r in cell.values()]
    lines.append(f"- load average at the end of each rate's run: {min(loads):.1f} to {max(loads):.1f}")
    return "\n".join(lines)


SUMMARY_COLUMNS = {"mdgan-all": "MD-GAN `all`", "mdgan-pipeline": "MD-GAN, `--pipeline-depth {depth}`",
                   "mdgan-pipeline-int8": "the same, int8 wire", "flgan": "FL-GAN", "psgan": "parameter-server GAN"}


def summary_cell(runs: dict[int, list[tuple[int, float]]], fids: list[float], speed: float) -> str:
    """'23.5/s; 7.3, 9.5, (16.0) min': the rate, then the mean time to each FID over the seeds that reach it,
    in brackets where only some do, '-' where none does; one unit for the cell."""
    reached = [time_to(runs, threshold, speed) for threshold in fids]
    longest = max((statistics.mean(got) for got in reached if got), default=0.0)
    unit, name = (3600, "h") if longest >= 5400 else (60, "min")
    times = ["-" if not got else f"{statistics.mean(got) / unit:.1f}" if len(got) == len(runs)
             else f"({statistics.mean(got) / unit:.1f})" for got in reached]
    return f"{speed:.1f}/s; " + (", ".join(times) + f" {name}" if runs else "not scored")


def summary(args) -> str:
    """One row per link, one column per configuration of SUMMARY_COLUMNS: the table of
    docs/results/wide-area-race/README.md."""
    saved = load(os.path.join(args.out, "rates.json"))
    scored = iterations_to(args.scores)
    chosen = configurations(saved["setting"]["depth"])
    columns = {label: title.format(depth=saved["setting"]["depth"]) for label, title in SUMMARY_COLUMNS.items()}
    lines = [f"Each cell: G updates a second over the link (FL-GAN: local steps), then the time to FID "
             f"{', '.join(f'{f:g}' for f in args.fids)}: the mean over the seeds that reach it, in brackets where "
             "only some do, '-' where none does.", "",
             "| every site at | round trip | " + " | ".join(columns.values()) + " |",
             "| --- " * (2 + len(columns)) + "|"]
    for key, cell in saved["rates"].items():
        rate, rtt = key.split()
        link = re.sub(r"^(\d+)([kmg])bit$", lambda m: f"{m[1]} {m[2].upper()}bit/s", rate)
        row = [link, rtt.replace("ms", " ms")]
        for label in columns:
            scores = chosen[label]["scores"]
            runs = scored[scores].runs if scores in scored else {}
            row.append(summary_cell(runs, args.fids, cell[label]["updates_per_second"]) if label in cell else "-")
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def write_into(path: str, table: str) -> None:
    """Replaces the content of the document's block '<!-- generated: python bench/wide_area_table.py report ...
    -->' ... '<!-- /generated -->' with the table (atomically)."""
    with open(path, encoding="utf-8") as fh:
        text = fh.read()
    found = BLOCK.search(text)
    if not found:
        raise SystemExit(f"{path} has no block '<!-- generated: python bench/wide_area_table.py report ... -->'")
    text = text[:found.start(2)] + f"{table}\n\n" + text[found.end(2):]
    with open(path + ".tmp", "w", encoding="utf-8") as fh:
        fh.write(text)
    os.replace(path + ".tmp", path)


def check(args) -> None:
    """One configuration over one link until FID <= --fid: the measured time beside the predicted one."""
    config = configurations(args.depth)[args.config]
    saved = load(os.path.join(args.out, "rates.json"))
    measured = saved["rates"][cell_key(args.rates[0], args.rtts[0])][args.config]["updates_per_second"]
    curve = iterations_to(args.scores)[config["scores"]].runs[args.seed]
    tls = wide_area.certificates(args.out, SITES)
    out = os.path.join(args.out, "checks", f"{args.config}-{args.rates[0]}-{args.rtts[0]:g}ms-seed{args.seed}")
    reached = first_at(curve, args.fid)
    if reached is None:
        raise SystemExit(f"the scores' seed {args.seed} never reaches FID {args.fid:g}")
    def reached_it(rows: list[dict]) -> bool:
        return any(e["fid"] <= args.fid for row in rows for e in row.get("evaluations", []))

    with wide_area.wan(SITES, [args.rates[0]] * WORKERS, args.rtts[0]) as lan:
        tune(lan, args.sysctl)
        # until its own evaluation reaches the FID, or for the predicted time and a half
        r = wide_area.run(args.config, config["flags"], run_args(args, 1.5 * reached / measured, args.eval_every,
                                                                 [args.fid]), lan, SITES, tls, out, until=reached_it)
    got = r["time_to_fid"][str(args.fid)]
    hit = next((e["iteration"] for e in r["evaluations"] if e["fid"] <= args.fid), None)
    scored = dict(curve)
    result = {"config": args.config, "cell": cell_key(args.rates[0], args.rtts[0]), "seed": args.seed,
              "fid": args.fid, "predicted_iteration": reached, "predicted_seconds": reached / measured,
              "iteration": hit, "seconds": got, "updates_per_second": r["updates_per_second"], "load": r["load"],
              # over the link, the run computes what simulate computed: its every FID is the scores' own
              "fids_as_scored": [e["fid"] == scored.get(e["iteration"]) for e in r["evaluations"]]}
    write(out + ".json", result)
    print(json.dumps(result, indent=1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", choices=["measure", "rates", "report", "check"])
    parser.add_argument("--out", default="/tmp/mdgan-wide-area-table")
    parser.add_argument("--rates", default="100mbit,10mbit", help="every site's link, in tc's syntax; one per table")
    parser.add_argument("--rtts", default="0,20,80,150", help="round trips between a site and the server, ms")
    parser.add_argument("--budget", type=float, default=45.0, help="training seconds per configuration and link")
    parser.add_argument("--warm-up", type=float, default=10.0,
                        help="training seconds at the start of each run that its rate leaves out (trained on top of "
                             "--budget)")
    parser.add_argument("--depth", type=int, default=4, help="--pipeline-depth of mdgan-pipeline")
    parser.add_argument("--only", default="", help="comma-separated configurations (default: all of them)")
    parser.add_argument("--again", action="store_true", help="measure again what OUT/rates.json already has")
    parser.add_argument("--sysctl", action="append", default=[], metavar="KEY=VALUE",
                        help="measure, check: set in every namespace, e.g. net.ipv4.tcp_congestion_control=reno "
                             "(recorded in rates.json; an OUT measured with other settings is refused)")
    parser.add_argument("--scores", default=os.path.join(REPO, "docs", "results", "wide-area-scores-mlp-cpu"),
                        help="the kept `mdgan experiment`s of the scores (their results.csv), comma-separated; a "
                             "label's runs come from the first that scores it")
    parser.add_argument("--fids", default="150,100,50", help="FID thresholds, comma-separated")
    parser.add_argument("--into", help="report: write the tables into this document's generated block")
    parser.add_argument("--summary", action="store_true",
                        help="report: one table, a row per link and a column per main configuration "
                             "(docs/results/wide-area-race's)")
    parser.add_argument("--config", default="mdgan-pipeline", help="check: the configuration")
    parser.add_argument("--fid", type=float, default=100.0, help="check: the FID to reach")
    parser.add_argument("--eval-every", type=int, default=500, help="check: as the scores' runs")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--data-root", default=os.path.join(os.path.dirname(REPO), "shared", "data"))
    args = parser.parse_args()
    args.rates = args.rates.split(",")
    args.rtts = [float(x) for x in args.rtts.split(",")]
    args.fids = [float(f) for f in args.fids.split(",")]
    args.scores = args.scores.split(",")
    if args.what == "report":
        table = summary(args) if args.summary else report(args)
        print(table) if not args.into else write_into(args.into, table)
        return
    if args.what == "rates":
        rates_again(args)
        return
    reason = why_not_available()
    if reason:
        raise SystemExit(f"cannot build the links: {reason}")
    os.makedirs(args.out, exist_ok=True)
    measure(args) if args.what == "measure" else check(args)


if __name__ == "__main__":
    main()
