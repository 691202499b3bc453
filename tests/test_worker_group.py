"""Several workers in one process (services/worker/group.py): each keeps its own log and exit code,
and one that fails does not stop the others. (Real clusters of such processes: test_e2e and
test_launcher.)"""

from __future__ import annotations

import asyncio
import json
import logging

from mdgan.config import ConfigError
from services.worker import group
from services.worker.node import JoinRefused


def test_each_worker_logs_to_its_own_file_and_ends_with_its_own_code(tmp_path, monkeypatch):
    async def fake_serve(args):
        """A worker: logs from its own task and from a task it starts, then ends as its flag says."""
        worker_log = logging.getLogger("mdgan.worker")
        worker_log.info("hello from %s", args.name)
        await asyncio.create_task(asyncio.sleep(0.01))  # let the others run in between
        await asyncio.create_task(_log_later(worker_log, args.name))
        if args.name == "w-bad":
            raise ConfigError("w-bad's own configuration error")
        if args.name == "w-refused":
            raise JoinRefused("slot taken")
        await asyncio.sleep(0.05)  # still running when the others have failed: they do not stop it
        return "run finished"

    monkeypatch.setattr(group, "serve", fake_serve)
    configured = []  # (not the real one: it would change the scheduling of the test process itself)
    monkeypatch.setattr(group, "configure_process",
                        lambda args: (configured.append(args.name), logging.getLogger("services.common.scheduling").info(
                            "CPU scheduling: as %s", args.name)))
    names = ["w-ok", "w-bad", "w-refused"]
    members = [group.Member(name, ["--name", name, "--insecure"], str(tmp_path / f"{name}.log")) for name in names]
    status = str(tmp_path / "status.json")
    root = logging.getLogger()
    before = list(root.handlers)
    code = group.main(members, status)
    assert root.handlers == before  # the routing handler is removed again

    assert code == 3  # the highest of its workers'
    assert json.loads(open(status).read()) == {"w-ok": 0, "w-bad": 2, "w-refused": 3}
    logs = {name: (tmp_path / f"{name}.log").read_text() for name in names}
    for name in names:
        assert f"hello from {name}" in logs[name] and f"later from {name}" in logs[name]
        assert not [other for other in names if other != name and f"from {other}" in logs[name]]
    assert "w-bad's own configuration error" in logs["w-bad"]
    assert "the server refused us: slot taken" in logs["w-refused"]
    assert "finished: run finished" in logs["w-ok"]
    assert configured == ["w-ok"]  # once for the process, with the (shared) flags of its first worker
    assert not [name for name in names if "CPU scheduling" in logs[name]]  # said in the process's own log


async def _log_later(logger, name):
    logger.warning("later from %s", name)


def test_a_bug_in_one_worker_is_logged_whole_in_its_log_and_exits_1(tmp_path, monkeypatch):
    async def fake_serve(args):
        if args.name == "w-bug":
            raise KeyError("surprise")
        return "run finished"

    monkeypatch.setattr(group, "serve", fake_serve)
    members = [group.Member(name, ["--name", name, "--insecure"], str(tmp_path / f"{name}.log"))
               for name in ("w-bug", "w-ok")]
    assert group.main(members, str(tmp_path / "status.json")) == 1
    assert json.loads((tmp_path / "status.json").read_text()) == {"w-bug": 1, "w-ok": 0}
    text = (tmp_path / "w-bug.log").read_text()
    assert "Traceback" in text and "KeyError: 'surprise'" in text
