"""The tables of docs/RESULTS.md from an experiment's kept runs (`mdgan experiment CONFIG --keep DIR`).

    python experiments/tables.py docs/results/figure3-mnist-mlp --at 10000 25000 50000 --fid 50 25
    python experiments/tables.py docs/results/figure3-mnist-mlp --local-ratio "MD-GAN k=1=0.67"
    python experiments/tables.py docs/results/figure3-mnist-mlp --tables scores --into docs/RESULTS.md
    python experiments/tables.py docs/results/figure3-mnist-mlp --compare "MD-GAN k=1|standalone b=10"
    python experiments/tables.py --refresh docs/RESULTS.md     # every generated block, by its own command

Prints, in Markdown:
- per label (a setting over its seeds) and iteration: the MNIST score and FID as mean +- standard
  deviation (n - 1) over the seeds, each seed's value after it, on the small and the large sample;
- per run, at every iteration scored on both samples: FID on the small one minus FID on the large one;
- per run: its seed, iterations, wall time, seconds per iteration and machine;
- per label: the iterations (mean over the seeds, each seed's) to first reach each FID of --fid on the
  small sample (the paper's), and their minutes: at --pace (ms an iteration measured on a quiet machine)
  or else the runs' own training time (scoring excluded); with --local-ratio, that time for the setting
  run as services (`mdgan local`), from a measured ratio of `mdgan local`'s wall time to the in-process run's;
- with --compare "A|B": at how many evaluations setting A leads setting B (their means over the seeds),
  and both means over the last ten evaluations.

--tables picks some of them. --into FILE writes them into FILE instead of printing them, in place of what
stands between the line `<!-- generated: python experiments/tables.py ARGS -->` whose ARGS are this
command's own and the next `<!-- /generated -->`: the tables in the docs are regenerated, never pasted,
and a test checks that each block is what its command gives.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import shlex
import statistics
import sys

END_MARK = "<!-- /generated -->"


def load(keep: str) -> list[dict]:
    """Every kept run: its settings, summary and evaluations (one dict per evaluated iteration)."""
    runs = []
    root = os.path.join(keep, "runs")
    for name in sorted(os.listdir(root)):
        folder = os.path.join(root, name)
        if not os.path.exists(os.path.join(folder, "summary.json")):
            continue
        with open(os.path.join(folder, "run.json"), encoding="utf-8") as fh:
            run = json.load(fh)
        with open(os.path.join(folder, "summary.json"), encoding="utf-8") as fh:
            summary = json.load(fh)
        evaluations = {}
        with open(os.path.join(folder, "history.jsonl"), encoding="utf-8") as fh:
            for line in fh:
                record = json.loads(line)
                for evaluation in record.get("evaluations") or []:
                    evaluations[evaluation["eval_iteration"]] = evaluation
        runs.append({"name": name, "run": run, "summary": summary, "evaluations": evaluations})
    return runs


def _stat(values: list[float], digits: int) -> str:
    if not values:
        return "-"
    mean = statistics.fmean(values)
    if len(values) == 1:  # one seed: its value
        return f"{mean:.{digits}f}"
    each = ", ".join(f"{v:.{digits}f}" for v in values)
    return f"{mean:.{digits}f} +- {statistics.stdev(values):.{digits}f} ({each})"


def score_table(runs: list[dict], iterations: list[int], large: bool) -> str:
    suffix = "_large" if large else ""
    lines = [f"| setting | seeds | " + " | ".join(f"at {i:,}" for i in iterations) + " |",
             "| --- | --- | " + " | ".join("---" for _ in iterations) + " |"]
    for label in dict.fromkeys(r["run"]["label"] for r in runs):
        mine = sorted((r for r in runs if r["run"]["label"] == label), key=lambda r: r["run"]["seed"])
        cells = []
        for i in iterations:
            at = [r["evaluations"][i] for r in mine if i in r["evaluations"]
                  and r["evaluations"][i].get(f"fid{suffix}") is not None]
            scores = [e[f"mnist_score{suffix}"] for e in at]
            fids = [e[f"fid{suffix}"] for e in at]
            cells.append(f"{_stat(scores, 2)} / {_stat(fids, 1)}" if at else "-")
        seeds = ", ".join(str(r["run"]["seed"]) for r in mine)
        lines.append(f"| {label} | {seeds} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def bias_table(runs: list[dict], iterations: list[int]) -> str:
    """FID on the small sample minus FID on the large one, per run, where both were scored: the small
    sample's bias (FID's estimator is biased upward, the more the fewer samples)."""
    lines = ["| run | " + " | ".join(f"at {i:,}" for i in iterations) + " |",
             "| --- | " + " | ".join("---" for _ in iterations) + " |"]
    for r in runs:
        cells = []
        for i in iterations:
            e = r["evaluations"].get(i) or {}
            cells.append(f"{e['fid'] - e['fid_large']:+.1f}" if e.get("fid_large") is not None else "-")
        lines.append(f"| {r['name']} | " + " | ".join(cells) + " |")
    half = min((i for i in iterations if i >= max(iterations) / 2), default=None)  # the second half of the runs
    late = [r["evaluations"][i]["fid"] - r["evaluations"][i]["fid_large"] for r in runs for i in iterations
            if i >= half and r["evaluations"].get(i, {}).get("fid_large") is not None]
    if late:
        lines.append(f"\nFrom {half:,} iterations on: {min(late):+.1f} to {max(late):+.1f}, "
                     f"{statistics.fmean(late):+.1f} on average over {len(late)} evaluations of {len(runs)} runs.")
    return "\n".join(lines)


def run_table(runs: list[dict]) -> str:
    """Training time: the iterations' own wall times summed (scoring excluded), across resumes."""
    lines = ["| run | label | seed | iterations | training time | ms per iteration | machine |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in runs:
        s, machine = r["summary"], r["summary"].get("machine") or {}
        timed = [e["train_seconds"] for e in r["evaluations"].values() if e.get("train_seconds") is not None]
        seconds = max(timed) if timed else s["wall_seconds"]
        lines.append(f"| {r['name']} | {r['run']['label']} | {r['run']['seed']} | {s['iterations']:,} | "
                     f"{seconds / 60:.0f} min | {seconds / s['iterations'] * 1000:.0f} | "
                     f"{machine.get('cpu', '?')}, {machine.get('cpu_capability', '?')}, torch {machine.get('torch', '?')} |")
    return "\n".join(lines)


def time_to_fid(runs: list[dict], thresholds: list[float], local_ratio: dict[str, float],
                pace: dict[str, float] | None = None) -> str:
    """Per label: the iterations to first reach each FID (small sample), mean over its seeds (each
    seed's), and the minutes they take: at `pace` (ms an iteration, measured on a quiet machine) where
    given, else the runs' own training time to that evaluation; with a `local_ratio`, as services too."""
    pace = pace or {}
    head = " | ".join(f"FID <= {t:g}" for t in thresholds)
    lines = [f"| setting | seeds | {head} |", "| --- | --- | " + " | ".join("---" for _ in thresholds) + " |"]
    for label in dict.fromkeys(r["run"]["label"] for r in runs):
        mine = sorted((r for r in runs if r["run"]["label"] == label), key=lambda r: r["run"]["seed"])
        cells = []
        for threshold in thresholds:
            firsts = []
            for r in mine:
                reached = sorted(i for i, e in r["evaluations"].items() if e.get("fid") is not None and e["fid"] <= threshold)
                firsts.append((reached[0], r["evaluations"][reached[0]].get("train_seconds")) if reached else None)
            if any(first is None for first in firsts):
                missing = [str(r["run"]["seed"]) for r, first in zip(mine, firsts) if first is None]
                cells.append(f"not reached (seed {', '.join(missing)})")
                continue
            iterations = statistics.fmean(i for i, _ in firsts)
            cell = f"{iterations:,.0f}" + (f" ({', '.join(f'{i:,}' for i, _ in firsts)})" if len(firsts) > 1 else "")
            if label in pace:
                minutes, how = iterations * pace[label] / 60000, f"at {pace[label]:g} ms"
            elif all(seconds is not None for _, seconds in firsts):
                minutes, how = statistics.fmean(seconds for _, seconds in firsts) / 60, "measured"
            else:
                minutes = None
            if minutes is not None:
                cell += f": {minutes:.0f} min {how}"
                if label in local_ratio:
                    cell += f", {minutes * local_ratio[label]:.0f} min as services"
            cells.append(cell)
        lines.append(f"| {label} | {', '.join(str(r['run']['seed']) for r in mine)} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _mean_by_iteration(runs: list[dict], label: str, key: str) -> dict[int, float]:
    """The mean over a label's seeds of one score at every iteration that all its seeds scored."""
    mine = [r for r in runs if r["run"]["label"] == label]
    common = set.intersection(*({i for i, e in r["evaluations"].items() if e.get(key) is not None} for r in mine)) \
        if mine else set()
    return {i: statistics.fmean(r["evaluations"][i][key] for r in mine) for i in sorted(common)}


def compare_table(runs: list[dict], pairs: list[tuple[str, str]], last: int = 10) -> str:
    """For each pair of labels (A, B): at how many of the iterations both scored A is ahead of B (the
    means over each one's seeds: a lower FID, a higher MNIST score), and both means over the last
    `last` of those iterations."""
    lines = ["| A | B | A's FID lower | A's MNIST score higher | " + f"mean FID over the last {last}: A, B | "
             + f"mean MNIST score over the last {last}: A, B |", "| --- | --- | --- | --- | --- | --- |"]
    for a, b in pairs:
        cells = []
        for key, better in (("fid", lambda x, y: x < y), ("mnist_score", lambda x, y: x > y)):
            first, second = _mean_by_iteration(runs, a, key), _mean_by_iteration(runs, b, key)
            both = sorted(set(first) & set(second))
            ahead = [i for i in both if better(first[i], second[i])]
            since, tail, digits = _from(ahead, both), both[-last:], 1 if key == "fid" else 2
            count = f"{len(ahead)} of {len(both)}" + (f" (all from {since:,} on)" if since else "")
            means = (f"{statistics.fmean(first[i] for i in tail):.{digits}f}, "
                     f"{statistics.fmean(second[i] for i in tail):.{digits}f}") if tail else "-"
            cells.append((count, means))
        lines.append(f"| {a} | {b} | {cells[0][0]} | {cells[1][0]} | {cells[0][1]} | {cells[1][1]} |")
    return "\n".join(lines)


def _from(ahead: list[int], both: list[int]) -> int | None:
    """The first iteration from which A is ahead at every later one (None: not ahead at the last)."""
    start = None
    for i in reversed(both):
        if i not in ahead:
            break
        start = i
    return start


def sample_sizes(runs: list[dict]) -> tuple[int | None, int]:
    """The small sample every evaluation scored, and the large one some did (0: none)."""
    large = max((e.get("large_samples") or 0 for r in runs for e in r["evaluations"].values()), default=0)
    return (runs[0]["run"].get("eval_samples") if runs else None), large


def _per_label(items: list[str]) -> dict[str, float]:
    """LABEL=VALUE arguments (a label may hold "=" itself: the value is after the last)."""
    return {label: float(value) for label, value in (item.rsplit("=", 1) for item in items)}


def score_block(runs: list[dict], iterations: list[int]) -> str:
    """The score tables on the small sample and, where runs were scored on a large one, on that too."""
    small, large = sample_sizes(runs)
    most_seeds = max(collections.Counter(r["run"]["label"] for r in runs).values(), default=0)
    over = ": mean +- std over the seeds (each seed's value)" if most_seeds > 1 else ""
    block = (f"MNIST score / FID on {small} samples{over}:\n\n"
             + score_table(runs, iterations, large=False))
    if large:
        block += f"\n\nThe same on {large:,} samples:\n\n" + score_table(runs, iterations, large=True)
    return block


MARK = re.compile(r"^<!-- generated: python experiments/tables\.py (.*?) -->\n(.*?)^" + re.escape(END_MARK), re.M | re.S)


def generated_blocks(text: str) -> list[tuple[list[str], str]]:
    """Every generated block of a document: (the arguments of the tables.py command in its first line,
    its content up to the end mark)."""
    return [(shlex.split(m.group(1)), m.group(2).strip("\n")) for m in MARK.finditer(text)]


def write_into(path: str, argv: list[str], block: str) -> None:
    """Replaces the content of the block of the document at `path` whose command is `argv` (atomically)."""
    with open(path, encoding="utf-8") as fh:
        text = fh.read()
    found = [m for m in MARK.finditer(text) if shlex.split(m.group(1)) == argv]
    if not found:
        sys.exit(f"{path} has no block '<!-- generated: python experiments/tables.py {shlex.join(argv)} -->' "
                 f"... '{END_MARK}': write one where the tables go")
    match = found[0]
    text = text[:match.start(2)] + f"\n{block}\n\n" + text[match.end(2):]
    temporary = f"{path}.tmp"
    with open(temporary, "w", encoding="utf-8") as fh:
        fh.write(text)
    os.replace(temporary, path)


TABLES = ("scores", "bias", "runs", "time", "compare")


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("keep", nargs="?", help="the experiment's --keep folder")
    parser.add_argument("--at", type=int, nargs="+", default=[10000, 25000, 50000], help="iterations of the tables")
    parser.add_argument("--fid", type=float, nargs="+", default=[50, 25], help="FIDs to reach (small sample)")
    parser.add_argument("--local-ratio", nargs="*", default=[], metavar="LABEL=RATIO",
                        help="`mdgan local`'s wall time over the in-process run's, for a label")
    parser.add_argument("--pace", nargs="*", default=[], metavar="LABEL=MS",
                        help="a label's ms an iteration on a quiet machine, for its minutes to a FID")
    parser.add_argument("--compare", nargs="*", default=[], metavar="A|B",
                        help="two labels: where A is ahead of B (their means over the seeds)")
    parser.add_argument("--tables", nargs="+", choices=TABLES, default=list(TABLES), help="which tables (default: all)")
    parser.add_argument("--into", metavar="FILE",
                        help="write the tables into FILE, in the block whose first line is this very command")
    parser.add_argument("--refresh", metavar="FILE", help="run the command of every generated block of FILE")
    return parser


def render(args: argparse.Namespace) -> str:
    runs = load(args.keep)
    ratios, pace = _per_label(args.local_ratio), _per_label(args.pace)
    small, large = sample_sizes(runs)
    parts = []
    if "scores" in args.tables:
        parts.append(score_block(runs, args.at))
    if "bias" in args.tables and large:
        scored = sorted({i for r in runs for i, e in r["evaluations"].items() if e.get("fid_large") is not None})
        parts.append(f"FID on {small} samples minus FID on {large:,}:\n\n" + bias_table(runs, scored))
    if "runs" in args.tables:
        parts.append("Runs:\n\n" + run_table(runs))
    if "time" in args.tables:
        parts.append(f"First evaluation at or below each FID ({small} samples):\n\n" + time_to_fid(runs, args.fid, ratios, pace))
    if "compare" in args.tables and args.compare:
        parts.append(f"A against B at every evaluation on {small} samples, the means over each one's seeds:\n\n"
                     + compare_table(runs, [tuple(pair.split("|", 1)) for pair in args.compare]))
    return "\n\n".join(parts)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args = parser().parse_args(argv)
    if args.refresh:
        with open(args.refresh, encoding="utf-8") as fh:
            commands = [command for command, _ in generated_blocks(fh.read())]
        for command in commands:
            main(command)
        print(f"{args.refresh}: {len(commands)} generated blocks rendered again")
        return
    if args.keep is None:
        parser().error("give the --keep folder (or --refresh FILE)")
    if args.into:
        write_into(args.into, argv, render(args))
    else:
        print(render(args))


if __name__ == "__main__":
    main()
