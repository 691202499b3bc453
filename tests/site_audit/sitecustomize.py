"""Test-only: put this folder on a process's PYTHONPATH and every file or folder it opens under
$MDGAN_AUDIT_ROOT is logged, one line per access, to $MDGAN_AUDIT_DIR/<pid>.log (the first line is
the process's command line). tests/test_sites.py proves with it that a worker reads only its own
site. Nothing in the product imports this."""

import json
import os
import sys

_root = os.environ.get("MDGAN_AUDIT_ROOT")
_out = os.environ.get("MDGAN_AUDIT_DIR")
if _root and _out:
    _root = os.path.realpath(_root)
    _log = open(os.path.join(_out, f"{os.getpid()}.log"), "a", buffering=1)
    _log.write(json.dumps(sys.argv) + "\n")  # only the interpreter's argv here; -m's module shows in "orig_argv"
    _log.write(json.dumps(getattr(sys, "orig_argv", [])) + "\n")
    _events = {"open", "os.listdir", "os.scandir", "os.walk"}

    def _hook(event, args):
        if event in _events and args and isinstance(args[0], (str, bytes, os.PathLike)):
            try:
                path = os.path.realpath(os.fsdecode(args[0]))
            except Exception:
                return
            if path == _root or path.startswith(_root + os.sep):
                _log.write(path + "\n")

    sys.addaudithook(_hook)
