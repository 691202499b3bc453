"""Fault injection for the tests' service processes: with this folder on PYTHONPATH, Python imports
this module at start-up, and MDGAN_TEST_FAULT makes a named function raise inside the real process.

MDGAN_TEST_FAULT is a JSON list of faults, each
    {"target": "package.module:Class.method" (or "package.module:function"),
     "worker": "worker-1" (optional: only in that worker; read from the method's self),
     "after": K (optional: the first K calls go through; default 0),
     "error": "RuntimeError" (optional: the exception class, a builtin),
     "message": "..." (optional),
     "kill": true (optional: instead of raising, the call goes through and then the process SIGKILLs itself),
     "wrap": "module:factory" (optional: the target is replaced by factory(target), a module importable from
                               this folder: an attack on what the target handles, say),
     "record": "PATH" (optional: instead of raising, every call goes through and its second argument, a protobuf
                       message, is appended to PATH as a 4-byte length and its bytes; "{worker}" in PATH is the
                       worker the call is for)}
The target is replaced in its module before anything imports it by name, so every caller gets the
faulty one. Nothing happens without the variable: the product never reads it."""

from __future__ import annotations

import builtins
import functools
import importlib
import inspect
import json
import os
import signal


def _worker_of(args) -> str | None:
    """The worker a method runs for, from its self (an algorithm, a servicer, a handle or a node)."""
    if not args:
        return None
    owner = args[0]
    for path in (("node", "worker_id"), ("worker_id",), ("connection", "worker_id")):
        value = owner
        for name in path:
            value = getattr(value, name, None)
        if isinstance(value, str) and value:
            return value
    return None


def _recording(function, path: str):
    """Every call goes through; its second argument (a message) is appended to `path`, length-prefixed."""

    def record(args) -> None:
        data = args[1].SerializeToString()
        with open(path.replace("{worker}", _worker_of(args) or "unknown"), "ab") as fh:
            fh.write(len(data).to_bytes(4, "little") + data)

    if inspect.iscoroutinefunction(function):
        @functools.wraps(function)
        async def wrapper(*args, **kwargs):
            record(args)
            return await function(*args, **kwargs)
    else:
        @functools.wraps(function)
        def wrapper(*args, **kwargs):
            record(args)
            return function(*args, **kwargs)
    return wrapper


def faulty(function, fault: dict):
    if fault.get("wrap"):
        module, _, factory = fault["wrap"].partition(":")
        return getattr(importlib.import_module(module), factory)(function)
    if fault.get("record"):
        return _recording(function, fault["record"])
    error = getattr(builtins, fault.get("error", "RuntimeError"))
    message = fault.get("message", f"injected fault in {fault['target']}")
    after, worker = int(fault.get("after", 0)), fault.get("worker")
    calls = {"n": 0}

    def due(args) -> bool:
        if worker is not None and _worker_of(args) != worker:
            return False
        calls["n"] += 1
        return calls["n"] > after

    if inspect.iscoroutinefunction(function) and fault.get("kill"):
        @functools.wraps(function)
        async def wrapper(*args, **kwargs):
            result = await function(*args, **kwargs)
            if due(args):
                os.kill(os.getpid(), signal.SIGKILL)
            return result
    elif inspect.iscoroutinefunction(function):
        @functools.wraps(function)
        async def wrapper(*args, **kwargs):
            if due(args):
                raise error(message)
            return await function(*args, **kwargs)
    elif fault.get("kill"):
        @functools.wraps(function)
        def wrapper(*args, **kwargs):
            result = function(*args, **kwargs)
            if due(args):
                os.kill(os.getpid(), signal.SIGKILL)
            return result
    else:
        @functools.wraps(function)
        def wrapper(*args, **kwargs):
            if due(args):
                raise error(message)
            return function(*args, **kwargs)
    return wrapper


def resolve(target: str) -> tuple[object, str]:
    """("package.module:Class.method") -> (the module or class that holds it, its name)."""
    module_name, _, qualified = target.partition(":")
    owner = importlib.import_module(module_name)
    *path, name = qualified.split(".")
    for part in path:
        owner = getattr(owner, part)
    return owner, name


def _install(fault: dict) -> None:
    owner, name = resolve(fault["target"])
    original = inspect.getattr_static(owner, name)
    if isinstance(original, staticmethod):
        setattr(owner, name, staticmethod(faulty(original.__func__, fault)))
    else:
        setattr(owner, name, faulty(original, fault))


for _fault in json.loads(os.environ.get("MDGAN_TEST_FAULT") or "[]"):
    _install(_fault)
