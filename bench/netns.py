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
import signal
import subprocess
import sys


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


class Consortium:
    """Machines on one LAN, each a network namespace of its own, reaching each other by name only.

        with Consortium(["server", "site-0", "site-1"], domain="lan.test", shaped={"site-1": "10mbit"}) as lan:
            lan.host("site-0")                  # 'site-0.lan.test', its name on the LAN
            subprocess.Popen(lan.wrap("site-0", ["python", "-m", "services.worker", ...]))

    A bridge in a namespace of its own (the switch) joins one veth per machine; no machine has a route
    to this host's loopback or to the others' loopbacks, so what works here works between separate
    hosts. Names resolve through /etc/netns/NS/hosts (which `ip netns exec` mounts over /etc/hosts),
    the same file for every machine: each knows the others by name, as DNS would tell them. A machine
    in `shaped` has a token bucket (tc tbf) at RATE on both ends of its link, as a slow site would.
    """

    def __init__(self, machines: list[str], domain: str = "lan.test", shaped: dict[str, str] | None = None,
                 subnet: int | None = None, delayed: dict[str, tuple[str, str]] | None = None, jitter: str = "0ms",
                 no_inbound: tuple[str, ...] = ()):
        tag = os.getpid() % 100000
        self.tag = tag
        self.domain = domain
        self.shaped = shaped or {}
        self.delayed = dict(delayed or {})  # machine -> (its frames' one-way delay to the switch, the switch's to it)
        self.no_inbound = set(no_inbound)  # machines that take no inbound TCP connection (dropped, not refused)
        for machine in self.no_inbound:  # (the firewall lives in the machine's delay_link process)
            self.delayed.setdefault(machine, ("0ms", "0ms"))
        self.jitter = jitter
        self.links: list[subprocess.Popen] = []  # the delay_link processes
        subnet = (tag % 200) + 20 if subnet is None else subnet
        self.switch = f"mdgan-sw-{tag}"
        self.machines = {m: {"ns": f"mdgan-{i}-{tag}", "ip": f"10.214.{subnet}.{i + 10}",
                             "outer": f"mc{tag}-{i}", "inner": "eth0"} for i, m in enumerate(machines)}

    def host(self, machine: str) -> str:
        return f"{machine}.{self.domain}"

    def ip(self, machine: str) -> str:
        return self.machines[machine]["ip"]

    def __enter__(self) -> "Consortium":
        try:
            _ip("netns", "add", self.switch)
            sw = ["netns", "exec", self.switch, "ip"]
            _ip(*sw, "link", "add", "br0", "type", "bridge")
            _ip(*sw, "link", "set", "br0", "up")
            hosts = "".join(f"{m['ip']} {self.host(name)}\n" for name, m in self.machines.items())
            for name, m in self.machines.items():
                _ip("netns", "add", m["ns"])
                os.makedirs(f"/etc/netns/{m['ns']}", exist_ok=True)
                with open(f"/etc/netns/{m['ns']}/hosts", "w") as fh:
                    fh.write("127.0.0.1 localhost\n::1 localhost\n" + hosts)
                if name in self.delayed:
                    self._delayed_link(name, m)
                else:
                    _ip("link", "add", m["outer"], "netns", self.switch, "type", "veth", "peer", "name", m["inner"],
                        "netns", m["ns"])
                _ip(*sw, "link", "set", m["outer"], "master", "br0")
                _ip(*sw, "link", "set", m["outer"], "up")
                inside = ["netns", "exec", m["ns"], "ip"]
                _ip(*inside, "addr", "add", f"{m['ip']}/24", "dev", m["inner"])
                _ip(*inside, "link", "set", m["inner"], "up")
                _ip(*inside, "link", "set", "lo", "up")
                if name in self.shaped:
                    shape = ["root", "tbf", "rate", self.shaped[name], "burst", "32kbit", "latency", "400ms"]
                    for ns, dev in ((self.switch, m["outer"]), (m["ns"], m["inner"])):
                        subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, *shape],
                                       check=True, capture_output=True)
        except BaseException:
            self.__exit__()
            raise
        return self

    def _delayed_link(self, name: str, m: dict) -> None:
        """The machine's link as two TAP devices with bench/delay_link.py between them (its delays each
        way), in place of a veth pair: the TAP of the machine's end becomes its eth0."""
        up, down = self.delayed[name]
        inner = f"mi{self.tag}-{list(self.machines).index(name)}"
        link = subprocess.Popen([sys.executable, os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                              "delay_link.py"),
                                 "--taps", inner, m["outer"], "--up", up, "--down", down, "--jitter", self.jitter,
                                 *(["--no-inbound"] if name in self.no_inbound else [])],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.links.append(link)
        m["link"] = link
        if link.stdout.readline().strip() != "ready":
            raise RuntimeError(f"bench/delay_link.py did not start: {link.stderr.read()[-2000:]}")
        _ip("link", "set", m["outer"], "netns", self.switch)
        _ip("link", "set", inner, "netns", m["ns"])
        _ip("netns", "exec", m["ns"], "ip", "link", "set", inner, "name", m["inner"])

    def bytes_shaped(self, machine: str) -> tuple[int, int]:
        """(to the machine, from it): bytes through its link's token buckets so far."""
        m = self.machines[machine]

        def sent(ns: str, dev: str) -> int:
            text = subprocess.run(["ip", "netns", "exec", ns, "tc", "-s", "qdisc", "show", "dev", dev], check=True,
                                  capture_output=True, text=True).stdout
            return int(re.search(r"Sent (\d+) bytes", text).group(1))
        return sent(self.switch, m["outer"]), sent(m["ns"], m["inner"])

    def forget_connections(self, machine: str) -> None:
        """The machine's link silently drops, from now on, every TCP connection open on it (as a NAT that lost
        its state); new connections go through. Only a machine with no_inbound (its delay_link tracks them)."""
        os.kill(self.machines[machine]["link"].pid, signal.SIGUSR1)

    def wrap(self, machine: str, command: list[str]) -> list[str]:
        """The command, run on that machine (in its namespace, with its /etc/hosts)."""
        return ["ip", "netns", "exec", self.machines[machine]["ns"], *command]

    def __exit__(self, *exc) -> None:
        for link in self.links:
            link.kill()
            link.wait()
        for m in self.machines.values():
            subprocess.run(["ip", "netns", "del", m["ns"]], capture_output=True)
            shutil.rmtree(f"/etc/netns/{m['ns']}", ignore_errors=True)
        subprocess.run(["ip", "netns", "del", self.switch], capture_output=True)
