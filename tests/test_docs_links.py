"""Every relative link and image of the Markdown docs points at a file that exists: a results folder renamed or
removed would otherwise leave RESULTS.md showing broken figures, and nothing else would notice."""

import os
import re
import subprocess

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# [text](target) and ![alt](target); the target ends at a space (a title), a '#' (an anchor) or ')'
LINK = re.compile(r"\]\(([^)\s#]+)[^)]*\)")


def _documents():
    listed = subprocess.run(["git", "ls-files", "*.md"], cwd=REPO, capture_output=True, text=True, check=True)
    return [path for path in listed.stdout.split() if os.path.exists(os.path.join(REPO, path))]


def relative_targets(text: str) -> list[str]:
    """The link targets of a Markdown text that name a file of the repository (not a URL)."""
    text = re.sub(r"```.*?```", "", text, flags=re.S)  # code blocks are commands, not links
    return [target for target in LINK.findall(text) if not re.match(r"[a-z][a-z0-9+.-]*:", target)]


def test_links_are_found_and_urls_left_out():
    text = "![a](results/x.png) [b](GUIDE.md#top) [c](https://example.org/x) [d](x.md \"t\")\n```\n[e](no.md)\n```"
    assert relative_targets(text) == ["results/x.png", "GUIDE.md", "x.md"]


@pytest.mark.parametrize("document", _documents())
def test_every_relative_link_points_at_a_file(document):
    with open(os.path.join(REPO, document), encoding="utf-8") as fh:
        targets = relative_targets(fh.read())
    folder = os.path.dirname(os.path.join(REPO, document))
    missing = [target for target in targets if not os.path.exists(os.path.normpath(os.path.join(folder, target)))]
    assert not missing, f"{document} links to files that do not exist: {missing}"
