"""A network link with a fixed one-way delay each way, without netem: two TAP devices and this process
between them, which hands every Ethernet frame from one to the other `delay` later (plus a uniform
jitter in [-jitter, +jitter], never reordering a direction's frames).

This kernel has no netem, fq or etf qdisc, so nothing in it can hold a packet back for a time; a
process can. bench/netns.py's Consortium puts one TAP in a machine's namespace and the other on the
switch, in place of the veth pair, and shapes the rate with tbf on the TAPs as it does on veths. Run by
Consortium; by hand (as root):

    python bench/delay_link.py --taps mdA mdB --up 20ms --down 20ms    # mdA's frames reach mdB 20 ms later

It creates the two TAP devices, prints "ready", and forwards until it is killed; the devices go with it.

Two failures of real links, for tests (this kernel has no netfilter and no tc actions either):
`--no-inbound` drops every TCP connection attempt (SYN without ACK) from B to A, as a firewall that lets
A dial out and nothing in (the attempts time out: dropped, not refused); with it or `--forgetful`, SIGUSR1
drops, silently and from then on, every frame of the TCP connections seen so far, as a NAT or a proxy that
forgot them (new connections go through). Without either, no frame is parsed.
"""

from __future__ import annotations

import argparse
import collections
import fcntl
import os
import random
import select
import signal
import struct
import sys
import threading
import time

TUNSETIFF = 0x400454CA
IFF_TAP = 0x0002
IFF_NO_PI = 0x1000
MAX_FRAME = 65536
MAX_LEAD = 0.002  # s: the most a wake-up aims ahead of a frame's time


def open_tap(name: str) -> int:
    """A TAP device called `name` in this process's network namespace; its fd (frames, no header)."""
    fd = os.open("/dev/net/tun", os.O_RDWR)
    fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", name.encode(), IFF_TAP | IFF_NO_PI))
    return fd


def seconds(text: str) -> float:
    """'20ms', '1.5ms', '0.02s', '0' -> seconds."""
    text = text.strip()
    for suffix, scale in (("us", 1e-6), ("ms", 1e-3), ("s", 1.0)):
        if text.endswith(suffix):
            return float(text[: -len(suffix)]) * scale
    return float(text)


def tcp_flow(frame: bytes) -> tuple[frozenset, int] | None:
    """(the connection's two ends, the TCP flags) of an IPv4 TCP frame; None for any other frame."""
    if len(frame) < 34 or frame[12:14] != b"\x08\x00" or frame[23] != 6:
        return None
    ihl = (frame[14] & 0x0F) * 4
    tcp = 14 + ihl
    if len(frame) < tcp + 14:
        return None
    ends = frozenset(((frame[26:30], frame[tcp:tcp + 2]), (frame[30:34], frame[tcp + 2:tcp + 4])))
    return ends, frame[tcp + 13]


SYN, ACK = 0x02, 0x10


class Filter:
    """Which frames are lost on the way: connection attempts into A (--no-inbound), and the connections that
    were open when SIGUSR1 came."""

    def __init__(self, no_inbound: bool):
        self.no_inbound = no_inbound
        self.seen: set[frozenset] = set()
        self.dead: frozenset = frozenset()

    def forget_connections(self, *_) -> None:
        self.dead = frozenset(self.seen)

    def drops(self, frame: bytes, inbound: bool) -> bool:
        flow = tcp_flow(frame)
        if flow is None:
            return False
        ends, flags = flow
        if inbound and self.no_inbound and flags & SYN and not flags & ACK:
            return True
        if ends in self.dead:
            return True
        self.seen.add(ends)
        return False


class Direction:
    """Frames read from `source`, written to `target` `delay` (+- jitter) seconds later, in order."""

    def __init__(self, source: int, target: int, delay: float, jitter: float, seed: int,
                 lost: Filter | None = None, inbound: bool = False):
        self.lost, self.inbound = lost, inbound
        self.source, self.target = source, target
        self.delay, self.jitter = delay, jitter
        self.random = random.Random(seed)
        self.queue: collections.deque[tuple[float, bytes]] = collections.deque()
        self.ready = threading.Condition()
        self.last_due = 0.0

    def read(self) -> None:
        while True:
            select.select([self.source], [], [])
            frame = os.read(self.source, MAX_FRAME)
            if self.lost is not None and self.lost.drops(frame, self.inbound):
                continue
            now = time.monotonic()
            spread = self.random.uniform(-self.jitter, self.jitter) if self.jitter else 0.0
            due = max(now + self.delay + spread, self.last_due)  # (a direction's frames keep their order)
            self.last_due = due
            with self.ready:
                self.queue.append((due, frame))
                self.ready.notify()

    def write(self) -> None:
        # A sleep ends late (a timer's slack, a busy core): each wake-up aims `lateness` early, learnt from
        # how late the writes were, so that frames leave on time on average without spinning.
        lateness = 0.0
        while True:
            with self.ready:
                while not self.queue:
                    self.ready.wait()
                due, frame = self.queue[0]
            wait = due - lateness - time.monotonic()
            if wait > 0:
                time.sleep(wait)
                continue  # (the head may have changed: nothing is added before it, so read it again)
            with self.ready:
                self.queue.popleft()
            try:
                os.write(self.target, frame)
            except OSError:  # (the device is down for a moment, or the frame is too large: a lost frame)
                pass
            error = time.monotonic() - due  # > 0: late
            if wait > -0.002:  # (a frame that waited behind a backlog says nothing of the timer)
                lateness = min(max(lateness + 0.1 * error, 0.0), MAX_LEAD)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--taps", nargs=2, metavar=("A", "B"), required=True, help="the two TAP devices to make")
    parser.add_argument("--up", default="0ms", help="delay of A's frames to B")
    parser.add_argument("--down", default="0ms", help="delay of B's frames to A")
    parser.add_argument("--jitter", default="0ms", help="each frame's delay spread uniformly by +- this much")
    parser.add_argument("--seed", type=int, default=0, help="the jitter's draws")
    parser.add_argument("--no-inbound", action="store_true", help="drop every TCP connection attempt from B to A")
    parser.add_argument("--forgetful", action="store_true",
                        help="on SIGUSR1, drop every frame of the TCP connections seen so far (--no-inbound implies it)")
    args = parser.parse_args(argv)
    a, b = (open_tap(name) for name in args.taps)
    jitter = seconds(args.jitter)
    lost = Filter(args.no_inbound) if args.no_inbound or args.forgetful else None  # (none: no per-frame parsing)
    if lost is not None:
        signal.signal(signal.SIGUSR1, lost.forget_connections)
    directions = [Direction(a, b, seconds(args.up), jitter, args.seed, lost),
                  Direction(b, a, seconds(args.down), jitter, args.seed + 1, lost, inbound=True)]
    for direction in directions:
        for work in (direction.read, direction.write):
            threading.Thread(target=work, daemon=True).start()
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    print("ready", flush=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        return 0


if __name__ == "__main__":
    sys.exit(main())
