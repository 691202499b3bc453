"""A worker behind a slow link: a network namespace joined to the host by a veth pair, shaped by `tc`.

    with ShapedNamespace("5mbit") as ns:           # needs root (CAP_NET_ADMIN, CAP_SYS_ADMIN)
        subprocess.Popen(ns.wrap(["python", "-m", "services.worker", "--server", f"{ns.host_ip}:{port}",
                                  "--advertise-address", ns.ns_ip, ...]))

The namespace holds its own network stack: its only way out is the veth, whose two ends each carry a
token-bucket filter (`tc qdisc ... tbf rate RATE`), so the worker inside is limited to RATE in each
direction (downloads from the server and from peers, uploads of feedback and of its discriminator),
while everything on the host side stays on unshaped loopback. Processes on the host reach the worker
at `ns_ip`; the worker reaches the host at `host_ip`, so host processes that the worker must call
(its swap peers) listen on 0.0.0.0 and advertise `host_ip`.

By hand, the same thing (name, addresses and rate are examples; `tbf` and `htb` exist here, `netem`
does not, so a delay cannot be added):

    ip netns add slow && ip link add slow-h type veth peer name slow-n && ip link set slow-n netns slow
    ip addr add 10.213.0.1/24 dev slow-h && ip link set slow-h up
    ip netns exec slow ip addr add 10.213.0.2/24 dev slow-n
    ip netns exec slow ip link set slow-n up && ip netns exec slow ip link set lo up
    tc qdisc add dev slow-h root tbf rate 5mbit burst 32kbit latency 400ms          # host -> worker
    ip netns exec slow tc qdisc add dev slow-n root tbf rate 5mbit burst 32kbit latency 400ms   # worker -> host
    ip netns exec slow python -m services.worker --server 10.213.0.1:PORT --advertise-address 10.213.0.2 ...
    ip netns del slow; ip link del slow-h 2>/dev/null      # afterwards (deleting the namespace drops both ends)
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


def why_not_available() -> str | None:
    """None if this process can make namespaces and shape links; otherwise the reason, for a skip."""
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return "`ip` and `tc` (iproute2) are not installed"
    if os.geteuid() != 0:
        return "network namespaces and tc need root (CAP_NET_ADMIN and CAP_SYS_ADMIN)"
    probe = f"mdgan-probe-{os.getpid()}"
    try:
        _ip("netns", "add", probe)
    except subprocess.CalledProcessError as error:
        return f"`ip netns add` is not permitted here: {error.stderr.strip()}"
    try:
        _ip("link", "add", f"mp{os.getpid() % 100000}h", "type", "veth", "peer", "name", f"mp{os.getpid() % 100000}n")
        _ip("link", "del", f"mp{os.getpid() % 100000}h")
    except subprocess.CalledProcessError as error:
        return f"veth pairs cannot be made here: {error.stderr.strip()}"
    finally:
        subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


class ShapedNamespace:
    """A namespace with one veth to the host, RATE each way (tc tbf rate syntax: 5mbit, 500kbit).
    `subnet` picks the /24 (10.213.SUBNET.0); names carry the pid so parallel users do not collide."""

    def __init__(self, rate: str, subnet: int | None = None):
        self.rate = rate
        tag = os.getpid() % 100000
        self.name = f"mdgan-slow-{tag}"
        self.host_dev, self.ns_dev = f"ms{tag}h", f"ms{tag}n"  # interface names: 15 characters at most
        subnet = (tag % 200) + 20 if subnet is None else subnet
        self.host_ip, self.ns_ip = f"10.213.{subnet}.1", f"10.213.{subnet}.2"

    def __enter__(self) -> "ShapedNamespace":
        try:
            _ip("netns", "add", self.name)
            _ip("link", "add", self.host_dev, "type", "veth", "peer", "name", self.ns_dev)
            _ip("link", "set", self.ns_dev, "netns", self.name)
            _ip("addr", "add", f"{self.host_ip}/24", "dev", self.host_dev)
            _ip("link", "set", self.host_dev, "up")
            inside = ["netns", "exec", self.name, "ip"]
            _ip(*inside, "addr", "add", f"{self.ns_ip}/24", "dev", self.ns_dev)
            _ip(*inside, "link", "set", self.ns_dev, "up")
            _ip(*inside, "link", "set", "lo", "up")
            # a token bucket on each end: each shapes what leaves through it
            shape = ["root", "tbf", "rate", self.rate, "burst", "32kbit", "latency", "400ms"]
            subprocess.run(["tc", "qdisc", "add", "dev", self.host_dev, *shape], check=True, capture_output=True)
            subprocess.run(["ip", "netns", "exec", self.name, "tc", "qdisc", "add", "dev", self.ns_dev, *shape],
                           check=True, capture_output=True)
        except BaseException:
            self.__exit__()
            raise
        return self

    def bytes_shaped(self) -> tuple[int, int]:
        """(host -> namespace, namespace -> host): bytes that went through each token bucket so far."""
        def sent(prefix: list[str], dev: str) -> int:
            text = subprocess.run([*prefix, "tc", "-s", "qdisc", "show", "dev", dev], check=True,
                                  capture_output=True, text=True).stdout
            return int(re.search(r"Sent (\d+) bytes", text).group(1))
        return sent([], self.host_dev), sent(["ip", "netns", "exec", self.name], self.ns_dev)

    def wrap(self, command: list[str]) -> list[str]:
        """The command, run inside the namespace."""
        return ["ip", "netns", "exec", self.name, *command]

    def __exit__(self, *exc) -> None:
        subprocess.run(["ip", "netns", "del", self.name], capture_output=True)  # takes the veth's inner end
        subprocess.run(["ip", "link", "del", self.host_dev], capture_output=True)  # gone already, normally
