"""docs/ARCHITECTURE.md is the map: it names every room, and the number of edits it says a new setting
or a new algorithm takes is the number that makes one work, measured here by making those edits to a
copy of the code and using the result as a user would."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import textwrap

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOC = os.path.join(REPO, "docs", "ARCHITECTURE.md")
TOPS = ("mdgan", "services", "mdgan_app", "bench", "experiments", "scripts")


def rooms() -> list[str]:
    """Every module and script of the project's code, as its path under its top folder."""
    found = []
    for top in TOPS:
        for folder, dirs, files in os.walk(os.path.join(REPO, top)):
            dirs[:] = [d for d in dirs if d != "__pycache__" and not d.endswith(".egg-info")]
            for name in files:
                path = os.path.relpath(os.path.join(folder, name), os.path.join(REPO, top))
                if not name.endswith((".py", ".sh")) or "_pb2" in name:
                    continue
                if name == "__init__.py" and os.path.getsize(os.path.join(folder, name)) < 200:
                    continue  # (a package marker)
                found.append(f"{top}/{path}")
    return sorted(found)


def test_every_room_is_named_in_the_architecture():
    text = open(DOC).read()
    missing = []
    for room in rooms():
        under_top = room.split("/", 1)[1]
        if not re.search(rf"(?<![\w/.]){re.escape(under_top)}(?![\w.])", text):
            missing.append(room)
    assert missing == [], "not in docs/ARCHITECTURE.md: " + ", ".join(missing)
    assert len(text.splitlines()) <= 400


def stated_edits(what: str) -> int:
    """The number of edits the doc states for `what` ("a run setting", ...): '**N edits**' on its line."""
    for line in open(DOC).read().splitlines():
        if line.startswith(f"- **{what}**"):
            return int(re.search(r"\*\*(\d+) edits\*\*", line).group(1))
    raise AssertionError(f"docs/ARCHITECTURE.md states no edit count for {what!r}")


def _edit(root: str, path: str, anchor: str, text: str, before: bool = False) -> None:
    """One edit: `text` put right after (or before) the one place `anchor` is found in `path`."""
    full = os.path.join(root, path)
    source = open(full).read()
    assert source.count(anchor) == 1, f"{anchor!r} in {path}"
    at = source.index(anchor) + (0 if before else len(anchor))
    open(full, "w").write(source[:at] + text + source[at:])


def _copy(tmp_path) -> str:
    root = str(tmp_path / "code")
    for top in ("mdgan", "services", "mdgan_app"):
        shutil.copytree(os.path.join(REPO, top), os.path.join(root, top),
                        ignore=shutil.ignore_patterns("__pycache__"))
    return root


def _edited_copy(tmp_path, what: str, edits: list, created: int = 0) -> str:
    """A copy of the code with `edits` made (and `created` files the caller writes), after checking that their
    number is the one docs/ARCHITECTURE.md states for `what`."""
    assert stated_edits(what) == created + len(edits)
    root = _copy(tmp_path)
    for path, anchor, text, before in edits:
        _edit(root, path, anchor, text, before)
    return root


def _check(root: str, script: str) -> None:
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(script)], cwd=root, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": root}, timeout=240)
    assert done.returncode == 0 and "ok" in done.stdout, done.stdout + done.stderr


RUN_SETTING_EDITS = [
    ("mdgan/settings.py", "\n)\nEVERY_SETTING",
     '\n    Setting("eval_demo", 7, "a demonstration", EVALUATION, int, low=0, to_workers=False),', True),
    ("mdgan/run.py", '    large_samples: int = settings.default("eval_large_samples")\n',
     '    demo: int = settings.default("eval_demo")\n', False),
    ("mdgan/run_spec.py", 'large_samples=values["eval_large_samples"]', ', demo=values["eval_demo"]', False),
]

TRAINING_SETTING_EDITS = [
    ("mdgan/config.py", "    max_staleness: int = 4\n", "    demo_rate: float = 0.25\n", False),
    ("mdgan/settings.py", "\n)\nSETTINGS: dict[str, Setting]",
     '\n    Setting("demo_rate", _default(TrainingConfig, "demo_rate"), "a demonstration", BEYOND, float,'
     ' to_workers=False, short="demo"),', True),
    ("mdgan/settings.py", 'max_staleness=v["max_staleness"],', ' demo_rate=v["demo_rate"],', False),
]


@pytest.mark.slow
def test_a_run_setting_takes_the_edits_the_architecture_says(tmp_path):
    root = _edited_copy(tmp_path, "A run setting", RUN_SETTING_EDITS)
    _check(root, """
        import os
        from mdgan.config import ConfigError
        from mdgan.run_spec import RunSpec
        from mdgan_app.cli import build_parser
        from mdgan_app.experiment import DEFAULTS

        def parse(command, argv):
            top = build_parser()
            sub = next(a for a in top._actions if a.dest == "command").choices[command]
            args = sub.parse_args(argv)
            args.workers = args.workers or 4
            return RunSpec.from_values(vars(args), command=True)

        assert parse("simulate", ["--eval-demo", "3"]).evaluation.demo == 3       # a flag
        assert parse("local", ["--eval-demo", "5"]).evaluation.demo == 5
        assert parse("simulate", []).evaluation.demo == 7                         # its default
        os.environ["MDGAN_SIMULATE_EVAL_DEMO"] = "9"
        assert parse("simulate", []).evaluation.demo == 9                         # its variable
        assert DEFAULTS["eval_demo"] == 7                                         # an experiment's key
        assert RunSpec.from_values({**DEFAULTS, "eval_demo": 4}).evaluation.demo == 4
        try:
            RunSpec.from_values({**DEFAULTS, "eval_demo": -1})
        except ConfigError as exc:
            assert str(exc).startswith("eval_demo") and exc.for_flags().startswith("--eval-demo")
        else:
            raise AssertionError("eval_demo -1 accepted")
        print("ok")
    """)


@pytest.mark.slow
def test_a_training_setting_takes_the_edits_the_architecture_says(tmp_path):
    root = _edited_copy(tmp_path, "A training setting", TRAINING_SETTING_EDITS)
    _check(root, """
        from mdgan.run_spec import RunSpec
        from mdgan_app.cli import build_parser
        from mdgan_app.experiment import DEFAULTS, expand
        from services.server.__main__ import build_parser as server_parser
        from services.common.settings import training_config

        top = build_parser()
        simulate = next(a for a in top._actions if a.dest == "command").choices["simulate"]
        args = simulate.parse_args(["--demo-rate", "0.5"])
        args.workers = 4
        assert RunSpec.from_values(vars(args), command=True).config.demo_rate == 0.5
        assert training_config(server_parser().parse_args(["--demo-rate", "0.75"])).demo_rate == 0.75
        assert RunSpec.from_values({**DEFAULTS, "demo_rate": 0.125}).config.demo_rate == 0.125
        runs = expand({"out": "x", "base": {}, "runs": [{}, {"demo_rate": 0.5}], "name": "x"})
        assert "demo0.5" in runs[1]["name"], runs[1]["name"]                      # it names the runs it varies
        print("ok")
    """)


ALGORITHM_MODULE = '''
"""A demonstration: the standalone GAN under another name."""
from dataclasses import replace

from mdgan.algorithms.standalone import ALGORITHM as STANDALONE

ALGORITHM = replace(STANDALONE, name="demo", title="a demonstration GAN")
'''


ALGORITHM_EDITS = [
    ("mdgan/algorithms/__init__.py", "from mdgan.algorithms import psgan, flgan, pwgan, standalone",
     "\nfrom mdgan.algorithms import demo", False),
    ("mdgan/algorithms/__init__.py", "    psgan.ALGORITHM,\n", "    demo.ALGORITHM,\n", False),
]


@pytest.mark.slow
def test_an_algorithm_run_in_one_process_takes_the_edits_the_architecture_says(tmp_path):
    root = _edited_copy(tmp_path, "An algorithm that runs in one process", ALGORITHM_EDITS, created=1)
    open(os.path.join(root, "mdgan", "algorithms", "demo.py"), "w").write(ALGORITHM_MODULE)  # (its module)
    _check(root, f"""
        import json, os
        from mdgan_app.cli import main
        out = {str(tmp_path / "run")!r}
        assert main(["simulate", "--algorithm", "demo", "--dataset", "synthetic", "--iterations", "3",
                     "--batch-size", "8", "--eval-every", "-1", "--no-progress", "--out", out]) == 0
        assert json.load(open(os.path.join(out, "summary.json")))["algorithm"] == "demo"
        print("ok")
    """)
