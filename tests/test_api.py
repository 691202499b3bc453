"""The examples of docs/API.md, run as written (in a folder of their own)."""

from __future__ import annotations

import os
import re

import pytest

from conftest import REPO


def examples() -> list[str]:
    with open(os.path.join(REPO, "docs", "API.md")) as fh:
        return re.findall(r"```python\n(.*?)```", fh.read(), flags=re.S)


def test_the_api_examples_run_as_written(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    code = examples()
    assert len(code) == 2
    namespace: dict = {}
    for example in code:
        exec(compile(example, "docs/API.md", "exec"), namespace)
    printed = capsys.readouterr().out.splitlines()
    assert printed[0].startswith("20 ")
    assert printed[1].startswith("2 20 ")
    assert printed[2] == "torch.Size([16, 784]) [3, 7, 3, 7]"
    run = namespace["run"]
    again, _ = run.sample(16, classes=[3, 7])
    assert (again == namespace["images"]).all()  # fixed noise: the same samples


def test_loading_something_that_is_not_a_run_is_one_clear_error(tmp_path):
    import mdgan
    from mdgan.config import ConfigError

    with pytest.raises(ConfigError, match="no summary.json"):
        mdgan.load_run(str(tmp_path))
