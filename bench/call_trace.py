"""Which of the project's modules one experiment run walks through, traced with sys.setprofile: how many
it enters, how often the walk returns to one it has already left, and how often `algorithms.get` is
asked, from the experiment's run (its settings by key) to its summary. Run it from two checkouts (the
working directory is the checkout traced) and compare.

    python bench/call_trace.py                 # one 2-iteration MD-GAN run on synthetic data
    (cd ../before && python /path/to/bench/call_trace.py)

The walk: the module of every call into the project's code (mdgan/, mdgan_app/, services/), in order,
with consecutive calls in one module taken as one visit; a return is a visit to a module visited
before. Printed as JSON for the run's assembly (until the algorithm's run_in_process: settings, spec,
validation, data, outputs opened) and for the whole run.
"""

from __future__ import annotations

import collections
import json
import os
import sys
import tempfile

ROOT = os.getcwd()
TOPS = tuple(os.path.join(ROOT, top) + os.sep for top in ("mdgan", "mdgan_app", "services"))


def main() -> None:
    sys.path.insert(0, ROOT)
    from mdgan_app import experiment

    run = {**experiment.DEFAULTS, "dataset": "synthetic", "workers": 2, "kappa": 1, "iterations": 2,
           "batch_size": 8, "eval_every": -1, "swap_every": 1, "name": "trace", "label": "trace"}
    visits: list[str] = []  # until the algorithm's run starts: the run's assembly
    training: list[str] = []  # from there to the summary
    gets = 0

    def profile(frame, event, arg):
        nonlocal gets, visits
        if event != "call":
            return
        path = frame.f_code.co_filename
        if not path.startswith(TOPS):
            return
        module = os.path.relpath(path, ROOT)
        if frame.f_code.co_name == "run_in_process" and visits is not training:
            visits = training
        if module.endswith("algorithms/__init__.py") and frame.f_code.co_name == "get":
            gets += 1
        if not visits or visits[-1] != module:
            visits.append(module)
    assembly = visits

    with tempfile.TemporaryDirectory() as out:
        sys.setprofile(profile)
        try:
            experiment.run_one(run, os.path.join(out, "run"), progress=False)
        finally:
            sys.setprofile(None)
    print(json.dumps({"assembly": walk(assembly), "whole_run": walk(assembly + training),
                      "algorithms_get_calls": gets}, indent=1))


def walk(visits: list[str]) -> dict:
    seen, returns = set(), collections.Counter()
    for module in visits:
        if module in seen:
            returns[module] += 1
        seen.add(module)
    return {"modules_entered": len(seen), "visits": len(visits), "returns": sum(returns.values()),
            "returns_by_module": dict(returns.most_common(6))}


if __name__ == "__main__":
    main()
