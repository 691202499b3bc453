"""How the processes of a cluster on one machine ask the kernel to schedule them.

`mdgan local` runs a server and N workers on a few cores: at N=10 on 2 cores, eleven processes. With
the kernel's defaults each of them was preempted 3 to 9 times per iteration (EEVDF gave each a 1.4 ms
slice on that 2-core machine, and a process that wakes up may preempt the one running), so a
worker's 5 ms discriminator step was cut in pieces, each resumed with caches another process had
just filled. Every service of `mdgan local` therefore runs as SCHED_BATCH (a process that wakes
does not preempt the running one) with a 10 ms slice (Linux 6.12 and later take a fair-class slice
from sched_attr.sched_runtime; where the call fails, the policy alone is set): 0.1-0.4 preemptions
per iteration, and about 8% less CPU per iteration at N=10 (docs/PERFORMANCE.md).

With no more worker processes than cores (the default layout: one per core), `mdgan local` also keeps
each worker process on a core of its own (`pin`, `worker_cpus`; T cores with --threads T when there are
enough, none otherwise: torch's threads kept on fewer cores than there are threads wait for each other
at every operation, `check_threads_fit`); the server is left free, to run
wherever a worker waits. A process the kernel moves to another core resumes its step with that
core's caches cold. Pinned, an iteration took about 6% less time at N=4 and N=10 on 2 cores (0.89-0.99x
in seven comparisons within one run each) for the same CPU (0.98-1.05x; `bench/local_vs_simulate.py`).

`usable_cpus` is the CPUs a process may use (the launcher's layout starts from it); `die_with_parent`
asks the kernel to stop a child process when its parent dies, however it dies (the services of
`mdgan local`, the runs of `mdgan experiment --jobs`); `signals_held` keeps a stop from coming between a
child's start and the sending of what it is to run.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import platform
import signal
import sys

from mdgan.config import ConfigError

log = logging.getLogger("mdgan.scheduling")

SLICE_MS = 10.0
# sched_setattr(2) has no wrapper in glibc or Python.
_SCHED_SETATTR = {"x86_64": 314, "aarch64": 274, "arm64": 274}


class _SchedAttr(ctypes.Structure):
    # struct sched_attr, first version (SCHED_ATTR_SIZE_VER0: 48 bytes)
    _fields_ = [("size", ctypes.c_uint32), ("sched_policy", ctypes.c_uint32), ("sched_flags", ctypes.c_uint64),
                ("sched_nice", ctypes.c_int32), ("sched_priority", ctypes.c_uint32),
                ("sched_runtime", ctypes.c_uint64), ("sched_deadline", ctypes.c_uint64),
                ("sched_period", ctypes.c_uint64)]


def batch(slice_ms: float = SLICE_MS) -> str:
    """Make the calling process SCHED_BATCH with a slice of `slice_ms` (its threads started later
    inherit the policy). Returns what was applied, or why nothing was; never raises."""
    if not hasattr(os, "SCHED_BATCH"):
        return "unchanged: this system has no SCHED_BATCH"
    number = _SCHED_SETATTR.get(platform.machine())
    if number is not None:
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            nice = os.getpriority(os.PRIO_PROCESS, 0)
            attr = _SchedAttr(ctypes.sizeof(_SchedAttr), os.SCHED_BATCH, 0, nice, 0, int(slice_ms * 1e6), 0, 0)
            if libc.syscall(number, 0, ctypes.byref(attr), 0) == 0:
                return f"SCHED_BATCH, {slice_ms:g} ms slice"
        except (OSError, AttributeError):
            pass
    try:  # no sched_setattr here, or it refused the slice: the policy alone
        os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))
        return "SCHED_BATCH"
    except OSError as exc:
        return f"unchanged: {exc}"


def apply(choice: str) -> None:
    """--cpu-scheduling: `batch` for this process, logged (a warning when the kernel refused); `normal`
    leaves the kernel's defaults."""
    if choice == "batch":
        applied = batch()
        (log.warning if applied.startswith("unchanged") else log.info)("CPU scheduling: %s", applied)


def usable_cpus() -> list[int]:
    """The CPUs this process may run on (its affinity mask: a cpuset or `taskset` around it counts),
    in order."""
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))  # not on every platform


def die_with_parent(parent: int | None = None) -> None:
    """Have the kernel send this process SIGTERM when its parent dies, even outright (SIGKILL, the
    OOM killer), so no child goes on alone; exit now if the parent is already gone (Linux only).
    parent: the pid it was started by, when known (a child that calls this late, after its imports,
    may already have been re-parented: its getppid() is then no longer its parent's)."""
    if sys.platform != "linux":
        return
    if parent is None:
        parent = os.getppid()
    elif os.getppid() != parent:
        sys.exit(1)
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    if os.getppid() != parent:  # it died before prctl took effect
        sys.exit(1)


@contextlib.contextmanager
def signals_held(*signums: int, ignoring: tuple[int, ...] = ()):
    """The block runs with `signums` held: one that comes meanwhile goes, as the block ends, to the handler that was
    in place (which may raise there); `ignoring` are ignored meanwhile (a child started then inherits that).

    For starting a child process: multiprocessing starts it, then sends it what to run; a handler that raised in
    between (a SIGTERM, a Ctrl-C) left the child without it, and the child printed a traceback (EOFError)."""
    held: list[int] = []
    previous = {signum: signal.signal(signum, lambda number, frame: held.append(number)) for signum in signums}
    previous.update({signum: signal.signal(signum, signal.SIG_IGN) for signum in ignoring})
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        for signum in dict.fromkeys(held):
            signal.raise_signal(signum)


def cpu_list(cpus) -> str:
    """{0, 1, 2, 5} as '0-2,5', the form of taskset(1) and /proc/PID/status."""
    spans: list[list[int]] = []
    for cpu in sorted(cpus):
        if spans and cpu == spans[-1][1] + 1:
            spans[-1][1] = cpu
        else:
            spans.append([cpu, cpu])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in spans)


def parse_cpu_list(text: str) -> frozenset[int]:
    """'3', '0-1' or '0,2-3' (taskset -c's form) as a set of CPU numbers; ValueError if malformed."""
    cpus: set[int] = set()
    for part in text.split(","):
        first, dash, last = part.strip().partition("-")
        if not first.isdigit() or (dash and not last.isdigit()):
            raise ValueError(f"a CPU list such as 3, 0-1 or 0,2-3, got {text!r}")
        low, high = int(first), int(last) if dash else int(first)
        if high < low:
            raise ValueError(f"a CPU range goes up, got {part.strip()!r} in {text!r}")
        cpus.update(range(low, high + 1))
    return frozenset(cpus)


def pin(cpus) -> str:
    """Keep the calling process on the CPUs `cpus`: every thread it has (gRPC's, torch's) and every
    one it starts later. Returns what was applied, or why nothing was; a CPU this process may not use
    is a ConfigError (a bad flag, said before anything starts)."""
    cpus = frozenset(cpus)
    if not hasattr(os, "sched_setaffinity"):
        return "unchanged: this system cannot keep a process on chosen CPUs"
    allowed = os.sched_getaffinity(0)
    if not cpus <= allowed:
        raise ConfigError(f"--pin-cpu {cpu_list(cpus)}: CPU {cpu_list(cpus - allowed)} is not one this process may "
                          f"use (it may use {cpu_list(allowed)})")
    try:
        threads = [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:  # no /proc: this thread only, and those it starts later
        threads = [0]
    for thread in threads:
        try:
            os.sched_setaffinity(thread, cpus)
        except ProcessLookupError:  # it ended meanwhile
            pass
        except OSError as exc:  # a cgroup or seccomp policy said no
            return f"unchanged: {exc}"
    return f"pinned to CPU{'s' if len(cpus) > 1 else ''} {cpu_list(cpus)}"


def apply_pin(cpus) -> None:
    """--pin-cpu: keep this process on `cpus` (None: wherever the kernel puts it), logged."""
    if cpus is not None:
        applied = pin(cpus)
        (log.warning if applied.startswith("unchanged") else log.info)("CPU affinity: %s", applied)


def check_threads_fit(threads: int, cpus) -> int:
    """The torch threads a process kept on `cpus` (--pin-cpu; None: not kept) runs: `threads`, or
    with 0 (torch's default: one per usable core) one per CPU it is kept on. More threads than CPUs
    is a ConfigError: torch's threads wait for each other at every operation, and kept on too few
    CPUs, one of them runs only when another is preempted (`mdgan local --workers 4 --threads 2` with
    each worker process on one CPU: 1.71 s per iteration, against 0.18 s unpinned)."""
    if cpus is None:
        return threads
    if threads > len(cpus):
        raise ConfigError(f"--threads {threads} with --pin-cpu {cpu_list(cpus)}: more torch threads than CPUs to "
                          f"run them, which makes every step wait; give --threads {len(cpus)} or fewer, or more CPUs")
    return threads or len(cpus)


PIN_WORKERS_CHOICES = ("auto", "off")


def worker_cpus(processes: int, choice: str, threads: int, cpus=None) -> list[frozenset[int] | None]:
    """`mdgan local --pin-workers`: the CPUs each of `processes` worker processes of `threads` torch
    threads keeps to, or None. auto: `threads` CPUs each, in order, when there are at least two usable
    CPUs and enough for every process's threads (more would share cores anyway, and the kernel
    balances them better); with threads 0 (torch's default: every core), none. off: none pinned."""
    if choice not in PIN_WORKERS_CHOICES:
        raise ConfigError(f"--pin-workers must be auto or off, got {choice!r}")
    cpus = usable_cpus() if cpus is None else sorted(cpus)
    if choice == "off" or threads < 1 or len(cpus) < 2 or processes * threads > len(cpus):
        return [None] * processes
    return [frozenset(cpus[i * threads:(i + 1) * threads]) for i in range(processes)]
