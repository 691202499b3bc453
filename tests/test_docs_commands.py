"""The commands the deployment docs (docs/DEPLOY.md, KUBERNETES.md, TLS.md, DURABILITY.md) show, checked: every `mdgan ...` line parses with the command line it
names (its flags exist, its values are accepted), every `helm install` / `helm upgrade` renders with
exactly its values and passes the real kubernetes-validate. `docker compose`, `kubectl` and `docker`
lines need a daemon or a cluster: the compose files they run are checked with `docker compose config`
(tests/test_deploy.py), and the kits' by the multi-host test (tests/test_separate_machines.py)."""

from __future__ import annotations

import os
import re
import shlex

import pytest

from conftest import REPO

DOCS = [os.path.join(REPO, "docs", name) for name in ("DEPLOY.md", "KUBERNETES.md", "TLS.md", "DURABILITY.md")]


def commands() -> list[str]:
    text = ""
    for doc in DOCS:
        with open(doc) as fh:
            text += fh.read()
    found = []
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        joined = re.sub(r"\\\n\s*", " ", block)
        for line in joined.splitlines():
            line = line.strip()
            if line and not line.startswith("#"):
                found.append(line.split(" # ")[0].split("  #")[0].strip())
    return found


def _split(line: str) -> list[list[str]]:
    """A line's commands (`a && b`, `cd x && c`), each as argv."""
    return [shlex.split(part) for part in re.split(r"\s&&\s|;\s", line) if part.strip()]


def test_the_guide_shows_commands():
    assert sum(1 for c in commands() if c.startswith("mdgan ")) >= 8
    assert sum(1 for c in commands() if c.startswith("helm ")) >= 8


@pytest.mark.parametrize("line", [c for c in commands() if "mdgan " in c and "$(" not in c])
def test_every_mdgan_command_in_the_guide_parses(line):
    from mdgan_app.cli import build_parser

    for argv in _split(line):
        if argv and argv[0] == "mdgan":
            build_parser().parse_args(argv[1:])  # SystemExit (exit 2) on a flag or value it does not take


@pytest.mark.parametrize("line", [c for c in commands() if c.startswith(("helm install", "helm upgrade"))])
def test_every_helm_command_in_the_guide_renders_and_validates(line):
    from test_deploy import helm_template, validate

    argv = shlex.split(line)
    args, skip = [], 0
    for i, arg in enumerate(argv[4:], start=4):  # helm install|upgrade NAME CHART ...
        if skip:
            skip -= 1
            continue
        if arg in ("-n", "--namespace"):
            skip = 1
        elif arg in ("--create-namespace", "--reuse-values"):
            continue
        elif arg.startswith("--set-file"):
            path = argv[i + 1].split("=", 1)
            args += [arg, f"{path[0]}={os.path.join(REPO, path[1])}"]
            skip = 1
        else:
            args.append(arg)
    assert argv[3] == "deploy/k8s/mdgan", line
    rendered = helm_template(*args)
    result = validate(rendered.stdout)
    assert result.returncode == 0, result.stdout + result.stderr
