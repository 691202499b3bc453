"""Every flag the docs show with a command exists in that command's --help: a line of code (in a block
or inline) that names `mdgan local`, `mdgan-server`, ... is checked, flag by flag, against the real
parser of that command (the flags a doc once showed with `mdgan local` that only the server has, say)."""

from __future__ import annotations

import functools
import os
import re

import pytest

from conftest import REPO

DOCS = ["README.md", "docs/GUIDE.md", "docs/DEPLOY.md", "docs/KUBERNETES.md", "docs/TLS.md", "docs/DURABILITY.md", "docs/ALGORITHMS.md", "docs/ARCHITECTURE.md", "docs/API.md",
        "docs/OUTPUTS.md", "docs/MONITORING.md", "docs/RESULTS.md", "docs/PERFORMANCE.md", "docs/PRIVACY.md",
        "docs/WIDE_AREA.md"]
COMMAND = re.compile(r"(?:^|[\s`(])(mdgan-server|mdgan-worker|mdgan-healthcheck|mdgan\s+certs\s+[a-z]+|"
                     r"mdgan\s+(?:local|simulate|experiment|split|traffic|sample|score|models|audit))(?=\s|$|`)(.*)")


@functools.lru_cache(maxsize=1)
def parsers() -> dict[str, object]:
    import argparse

    from mdgan_app.cli import build_parser
    from services.common.healthcheck import main as _  # noqa: F401  (its parser is built in main)
    from services.server.__main__ import build_parser as server_parser
    from services.worker.__main__ import build_parser as worker_parser

    found = {"mdgan-server": server_parser(), "mdgan-worker": worker_parser()}
    top = build_parser()
    commands = next(a for a in top._actions if isinstance(a, argparse._SubParsersAction)).choices
    for name, parser in commands.items():
        if name == "certs":
            inner = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
            found.update({f"mdgan certs {sub}": p for sub, p in inner.items()})
        else:
            found[f"mdgan {name}"] = parser
    return found


def shown() -> list[tuple[str, int, str, str]]:
    """(doc, line, command, flag) for every flag written after a command on one line of code."""
    found = []
    for doc in DOCS:
        with open(os.path.join(REPO, doc)) as fh:
            text = fh.read()
        in_block = False
        for number, line in enumerate(text.splitlines(), 1):
            if line.strip().startswith("```"):
                in_block = not in_block
                continue
            pieces = [line] if in_block else re.findall(r"`([^`]+)`", line)
            for piece in pieces:
                match = COMMAND.search(piece)
                if not match:
                    continue
                command = " ".join(match.group(1).split())
                rest = re.split(r"\s(?:&&|\||;|#)\s", match.group(2))[0]
                for flag in re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", rest):
                    found.append((doc, number, command, flag))
    return found


def test_the_docs_show_commands_with_flags():
    assert len(shown()) > 50


@pytest.mark.parametrize("doc, line, command, flag", shown(), ids=lambda v: str(v))
def test_every_flag_shown_with_a_command_exists(doc, line, command, flag):
    if command == "mdgan-healthcheck":
        pytest.skip("its parser is built inside main()")
    parser = parsers()[command]
    strings = {s for action in parser._actions for s in action.option_strings}
    assert flag in strings, f"{doc}:{line}: `{command}` has no {flag}"
