"""Test-only: put this folder on a process's PYTHONPATH and every file or folder it (or any process
forked from it) opens under $MDGAN_AUDIT_ROOT is logged to $MDGAN_AUDIT_DIR/<pid>.log, one path a
line, with the *.log files it opens (how a test tells `mdgan local`'s forked services apart: each
opens its own RUN/logs/NAME.log) and its command line first. tests/test_sites.py proves with it that a
worker reads only its own site. Nothing in the product imports this."""

import json
import os
import sys

_root = os.environ.get("MDGAN_AUDIT_ROOT")
_out = os.environ.get("MDGAN_AUDIT_DIR")
if _root and _out:
    _root = os.path.realpath(_root)
    _events = {"open", "os.listdir", "os.scandir"}
    _state = {"pid": None, "fd": None, "busy": False}

    def _write(line: str) -> None:
        if _state["pid"] != os.getpid():  # first event here, or in a process forked since: its own file
            _state["pid"] = os.getpid()
            _state["fd"] = os.open(os.path.join(_out, f"{os.getpid()}.log"), os.O_WRONLY | os.O_CREAT | os.O_APPEND)
            os.write(_state["fd"], (json.dumps(getattr(sys, "orig_argv", sys.argv)) + "\n").encode())
        os.write(_state["fd"], (line + "\n").encode())

    def _hook(event, args):
        if _state["busy"] or event not in _events or not args or not isinstance(args[0], (str, bytes, os.PathLike)):
            return
        _state["busy"] = True  # the hook's own opens are audited too
        try:
            path = os.path.realpath(os.fsdecode(args[0]))
            if path == _root or path.startswith(_root + os.sep) or path.endswith(".log"):
                _write(path)
        except Exception:
            pass
        finally:
            _state["busy"] = False

    sys.addaudithook(_hook)
