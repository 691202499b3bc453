"""Sites that take no inbound connection, on separate network stacks: the server and three sites each in a
network namespace of its own (bench/netns.py), every machine from its kit. A site's link drops every TCP
connection attempt into it (dropped, not refused: bench/delay_link.py --no-inbound) and lets it dial out, as
a hospital's firewall does; its discriminators come through the server's relay. Also: the server SIGKILLed
in the middle of a relayed swap and resumed, and a site whose open connections a NAT silently forgets.

Needs root and iproute2; skipped, with the reason, where namespaces are not permitted.
"""

from __future__ import annotations

import json
import os
import re
import sys
import time

import pytest

from conftest import REPO
from procs import Proc, kit_environment, mdgan_in_process, read_json, read_jsonl

sys.path.insert(0, os.path.join(REPO, "bench"))
from netns import Consortium, why_not_available  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.skipif(why_not_available() is not None,
                                                   reason=f"no network namespaces here: {why_not_available()}")]

SITES = 3
FAULTS = os.path.join(REPO, "tests", "faults")


def _training(iterations: int) -> dict[str, str]:
    return {"MDGAN_ITERATIONS": str(iterations), "MDGAN_BATCH_SIZE": "10", "MDGAN_SWAP_EVERY": "4",
            "MDGAN_KAPPA": "2", "MDGAN_SEED": "3", "MDGAN_THREADS": "1", "MDGAN_EVAL_EVERY": "-1"}


class Sites:
    """The run's site folders, PKI and kits; the processes of one consortium."""

    def __init__(self, tmp_path, lan: Consortium, relay_kits: tuple[str, ...] = ()):
        self.tmp, self.lan = tmp_path, lan
        self.sites, self.kits = str(tmp_path / "sites"), str(tmp_path / "kits")
        self.out = str(tmp_path / "run")
        if not os.path.isdir(self.sites):
            mdgan_in_process("split", "synthetic", "--workers", str(SITES), "--samples", "300", "--out", self.sites)
        pki = str(tmp_path / "pki")
        mdgan_in_process("certs", "init", pki)
        address = f"{lan.host('server')}:50051"
        for i in range(SITES):
            name = f"site-{i}"
            where = ["--swaps", "relay"] if name in relay_kits else ["--advertise", f"{lan.host(name)}:50052"]
            mdgan_in_process("certs", "kit", pki, name, "--server-address", address, *where, "--slot", str(i),
                             "--out", os.path.join(self.kits, name))
        mdgan_in_process("certs", "kit", pki, "coordinator", "--server", "--server-address", address,
                         "--out", os.path.join(self.kits, "server"))
        self.processes: list[Proc] = []

    def server(self, training: dict, name: str = "server", extra: dict | None = None) -> Proc:
        env = {**kit_environment(os.path.join(self.kits, "server"), None, None, self.out), **training, **(extra or {})}
        proc = Proc(name, self.lan.wrap("server", [sys.executable, "-m", "services.server"]),
                    str(self.tmp / f"{name}.log"), env=env)
        self.processes.append(proc)
        return proc

    def site(self, i: int) -> Proc:
        name = f"site-{i}"
        env = {**kit_environment(os.path.join(self.kits, name), os.path.join(self.sites, name),
                                 str(self.tmp / f"state-{i}"), None), "MDGAN_THREADS": "1"}
        proc = Proc(name, self.lan.wrap(name, [sys.executable, "-m", "services.worker"]), str(self.tmp / f"{name}.log"),
                    env=env)
        self.processes.append(proc)
        return proc

    def simulated(self, iterations: int) -> str:
        simulated = str(self.tmp / "simulated")
        mdgan_in_process("simulate", "--dataset", "imagefolder", "--site-dirs", self.sites, "--iterations",
                         str(iterations), "--batch-size", "10", "--swap-every", "4", "--kappa", "2", "--seed", "3",
                         "--eval-every", "-1", "--no-progress", "--out", simulated)
        return read_json(os.path.join(simulated, "summary.json"))["generator_sha256"]

    def kill(self) -> None:
        for p in self.processes:
            p.kill()


@pytest.mark.parametrize("closed", [("site-0", "site-1", "site-2"), ("site-1",)])
def test_sites_that_take_no_inbound_connection_train_what_simulate_trains(tmp_path, closed):
    """Every site behind a firewall that drops connections into it, then one such site among two open ones.
    Their kits are the ordinary ones (--advertise, MDGAN_SWAPS=auto): the server's dial at join times out,
    and it relays them, saying so; the open sites stay direct. The run ends on simulate's generator."""
    with Consortium(["server", *(f"site-{i}" for i in range(SITES))], no_inbound=closed) as lan:
        sites = Sites(tmp_path, lan)
        server = sites.server(_training(12))
        workers = [sites.site(i) for i in range(SITES)]
        try:
            assert server.wait(300) == 0, server.log()
            for worker in workers:
                assert worker.wait(60) == 0, worker.log()
        finally:
            sites.kill()
    log = server.log()
    for i in range(SITES):
        name = f"site-{i}"
        path = r"through the relay: the server cannot reach its Peer service" if name in closed else r"direct, at"
        assert re.search(rf"joined as '{name}' .*swaps {path}", log), log
    assert all(w["sent"] and w["received"] for s in read_jsonl(os.path.join(sites.out, "swaps.jsonl"))
               for w in s["workers"].values())
    summary = read_json(os.path.join(sites.out, "summary.json"))
    assert summary["workers_alive"] == SITES and summary["generator_sha256"] == sites.simulated(12)


def test_the_server_killed_in_a_relayed_swap_resumes_and_the_run_ends_as_simulate(tmp_path):
    """Every site relayed (kits made with --swaps relay) and every inbound connection dropped; the server is
    SIGKILLed while the relay forwards a discriminator of the second round, started again on the same address
    with --resume, and the sites rejoin over their own outbound connections: the run ends on simulate's
    generator."""
    closed = tuple(f"site-{i}" for i in range(SITES))
    training = {**_training(16), "MDGAN_CHECKPOINT_EVERY": "4"}
    with Consortium(["server", *closed], no_inbound=closed) as lan:
        sites = Sites(tmp_path, lan, relay_kits=closed)
        kill = {"PYTHONPATH": os.pathsep.join([FAULTS, REPO, os.environ.get("PYTHONPATH", "")]),
                "MDGAN_TEST_FAULT": json.dumps([{"target": "services.server.relay:RelayServicer.forward",
                                                 "after": 15 + 7, "kill": True}])}  # (a round: 3 pushes of 5 messages)
        first = sites.server(training, "server-killed", kill)
        workers = [sites.site(i) for i in range(SITES)]
        try:
            assert first.wait(300) == -9, first.log()
            assert "mdgan.relay INFO relay: site-" in first.log()
            second = sites.server({**training, "MDGAN_RESUME": "yes"}, "server-resumed")
            assert second.wait(300) == 0, second.log()
            for worker in workers:
                assert worker.wait(60) == 0, worker.log()
        finally:
            sites.kill()
    assert "resum" in second.log().lower()
    summary = read_json(os.path.join(sites.out, "summary.json"))
    assert summary["iterations"] == 16 and summary["workers_alive"] == SITES
    assert summary["generator_sha256"] == sites.simulated(16)


def test_a_site_whose_connections_a_nat_forgets_reconnects_and_the_run_finishes(tmp_path):
    """Mid-run, site-1's link silently drops every connection it had open (nothing closes them: the packets
    just stop, as when a NAT forgets its mappings). Keepalive pings find the dead connection, the site dials
    again, the server gives up the stale stream of that identity at once, and the site rejoins; the run ends
    with all three sites."""
    with Consortium(["server", *(f"site-{i}" for i in range(SITES))], no_inbound=("site-1",)) as lan:
        sites = Sites(tmp_path, lan)
        server = sites.server(_training(400), extra={"MDGAN_MIN_WORKERS": str(SITES)})
        workers = [sites.site(i) for i in range(SITES)]
        try:
            deadline = time.monotonic() + 120
            while len(read_jsonl(os.path.join(sites.out, "history.jsonl"))) < 20:  # (training: then the link forgets)
                assert time.monotonic() < deadline and server.popen.poll() is None, server.log()
                time.sleep(0.2)
            lan.forget_connections("site-1")
            assert server.wait(300) == 0, server.log()
            for worker in workers:
                assert worker.wait(60) == 0, worker.log()
        finally:
            sites.kill()
    site_log = workers[1].log()
    assert "lost the server" in site_log and "Traceback" not in site_log, site_log
    assert server.log().count("joined as 'site-1'") == 2, server.log()
    summary = read_json(os.path.join(sites.out, "summary.json"))
    assert summary["iterations"] == 400 and summary["workers_alive"] == SITES
