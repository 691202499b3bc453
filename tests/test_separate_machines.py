"""Sites on separate machines, for real: the server and three sites, each in a network namespace of its
own (a network stack of its own: no shared loopback), joined by one bridge and reaching each other by
name only (/etc/netns/NS/hosts, as DNS would tell them). Every machine runs from its kit, written by
`mdgan certs kit` (its certificate issued for the name it is reached at), with the kit's settings as
they are; one site sits behind a shaped link (tc tbf). The run ends with the generator `mdgan simulate`
gives on the same site folders, bit for bit.

Needs root and iproute2; skipped, with the reason, where namespaces are not permitted.
"""

from __future__ import annotations

import json
import os
import socket
import sys

import pytest

from conftest import REPO
from procs import Proc, kit_environment, mdgan_in_process, read_json

sys.path.insert(0, os.path.join(REPO, "bench"))
from netns import Consortium, why_not_available  # noqa: E402

pytestmark = pytest.mark.slow

REASON = why_not_available()
SITES = 3
TRAINING = {"MDGAN_ITERATIONS": "12", "MDGAN_BATCH_SIZE": "10", "MDGAN_SWAP_EVERY": "4", "MDGAN_KAPPA": "2",
            "MDGAN_SEED": "3", "MDGAN_THREADS": "1", "MDGAN_EVAL_EVERY": "-1"}


def mdgan(*argv: str) -> str:
    """The commands that make the sites' folders and kits, and the simulation, in this process."""
    return mdgan_in_process(*argv).stdout


@pytest.mark.skipif(REASON is not None, reason=f"no network namespaces here: {REASON}")
def test_three_sites_on_separate_machines_from_their_kits_end_where_simulate_ends(tmp_path):
    sites = str(tmp_path / "sites")
    mdgan("split", "synthetic", "--workers", str(SITES), "--samples", "300", "--out", sites)
    pki, kits = str(tmp_path / "pki"), str(tmp_path / "kits")
    mdgan("certs", "init", pki)
    lan_names = ["server", *(f"site-{i}" for i in range(SITES))]
    with Consortium(lan_names, domain="lan.test", shaped={"site-2": "20mbit"}) as lan:
        server_address = f"{lan.host('server')}:50051"
        for i in range(SITES):
            mdgan("certs", "kit", pki, f"site-{i}", "--server-address", server_address, "--advertise",
                  f"{lan.host(f'site-{i}')}:50052", "--slot", str(i), "--out", os.path.join(kits, f"site-{i}"))
        mdgan("certs", "kit", pki, "coordinator", "--server", "--server-address", server_address,
              "--out", os.path.join(kits, "server"))
        for kit in os.listdir(kits):  # a kit holds its own key and the CA's certificate, never the CA's key
            assert sorted(os.listdir(os.path.join(kits, kit, "tls"))) == ["ca.crt", "tls.crt", "tls.key"]
        out = str(tmp_path / "run")
        server = Proc("server", lan.wrap("server", [sys.executable, "-m", "services.server"]),
                      str(tmp_path / "server.log"),
                      env={**kit_environment(os.path.join(kits, "server"), None, None, out), **TRAINING})
        workers = [Proc(f"site-{i}", lan.wrap(f"site-{i}", [sys.executable, "-m", "services.worker"]),
                        str(tmp_path / f"site-{i}.log"),
                        env={**kit_environment(os.path.join(kits, f"site-{i}"), os.path.join(sites, f"site-{i}"),
                                               str(tmp_path / f"state-{i}"), None),
                             "MDGAN_THREADS": "1"})  # one thread everywhere: the same arithmetic as simulate's
                   for i in range(SITES)]
        try:
            assert server.wait(300) == 0, server.log()
            for worker in workers:
                assert worker.wait(60) == 0, worker.log()
            to_slow_site, from_slow_site = lan.bytes_shaped("site-2")
        finally:
            for p in [server, *workers]:
                p.kill()
    summary = read_json(os.path.join(out, "summary.json"))
    assert summary["iterations"] == 12 and summary["workers_alive"] == SITES and summary["swaps"] == 3
    with open(os.path.join(out, "swaps.jsonl")) as fh:
        swaps = [json.loads(line) for line in fh]
    assert all(w["sent"] and w["received"] for s in swaps for w in s["workers"].values())  # across the machines
    # the slow site's discriminators (2.7 MB each) went through its shaped link, both ways
    assert to_slow_site > 2_000_000 and from_slow_site > 2_000_000, (to_slow_site, from_slow_site)

    simulated = str(tmp_path / "simulated")
    mdgan("simulate", "--dataset", "imagefolder", "--site-dirs", sites, "--iterations", "12", "--batch-size", "10",
          "--swap-every", "4", "--kappa", "2", "--seed", "3", "--eval-every", "-1", "--no-progress",
          "--out", simulated)
    assert summary["generator_sha256"] == read_json(os.path.join(simulated, "summary.json"))["generator_sha256"]


def test_a_worker_advertising_an_address_nobody_reaches_is_refused_at_join_with_the_fix(tmp_path):
    """Its peers would fail to push to it at every swap; the server dials the address first, as they
    would, and refuses the join in one line that names the setting to fix (exit 3, nothing started)."""
    from procs import start_server, start_worker

    out = str(tmp_path)
    server, port = start_server(out, "--workers", "2", "--iterations", "4", "--dataset", "synthetic",
                                "--join-timeout", "60")
    good = start_worker(out, port, 0, 2, "--dataset", "synthetic")
    with socket.socket() as closed:  # a port nothing listens on
        closed.bind(("127.0.0.1", 0))
        nowhere = f"127.0.0.1:{closed.getsockname()[1]}"
    bad = start_worker(out, port, 1, 2, "--dataset", "synthetic", "--advertise-address", nowhere, name="bad")
    try:
        assert bad.wait(60) == 3, bad.log()
        log = bad.log()
        assert f"the server refused us: FAILED_PRECONDITION: this worker's Peer service cannot be reached at '{nowhere}'" in log, log
        assert "MDGAN_ADVERTISE_ADDRESS" in log and "Traceback" not in log
        # a worker advertising where it serves is taken: the run goes on with it once it comes back right
        fixed = start_worker(out, port, 1, 2, "--dataset", "synthetic", name="fixed")
        assert server.wait(120) == 0, server.log()
        assert fixed.wait(30) == 0 and good.wait(30) == 0
    finally:
        for p in (server, good, bad):
            p.kill()


def test_a_site_given_another_pkis_files_says_so_in_one_line(tmp_path):
    """A site whose kit came from another PKI than the server's: the handshake fails, and the worker
    says why (not only 'unreachable'); a site whose tls/ folder mixes two PKIs' files stops at once."""
    import datetime

    from procs import start_server, start_worker, tls_flags
    from services.common import pki

    ours, theirs = str(tmp_path / "ours"), str(tmp_path / "theirs")
    pki.provision_run(ours, ["site-0"], server="hub")
    pki.provision_run(theirs, ["site-1"], server="hub")
    out = str(tmp_path / "run")
    server, port = start_server(out, "--workers", "2", "--iterations", "2", "--dataset", "synthetic",
                                *tls_flags(ours, "hub"))
    foreign = start_worker(out, port, 1, 2, "--dataset", "synthetic", "--connect-timeout", "6",
                           "--tls-server-name", "hub", *tls_flags(theirs, "site-1"), name="foreign")
    mixed_dir = tmp_path / "mixed"
    mixed_dir.mkdir()
    for name, source in (("ca.crt", os.path.join(ours, "ca.crt")), ("tls.crt", os.path.join(theirs, "site-1", "tls.crt")),
                         ("tls.key", os.path.join(theirs, "site-1", "tls.key"))):
        with open(source, "rb") as src, open(mixed_dir / name, "wb") as dst:
            dst.write(src.read())
    mixed = start_worker(out, port, 1, 2, "--dataset", "synthetic", "--tls-ca", str(mixed_dir / "ca.crt"),
                         "--tls-cert", str(mixed_dir / "tls.crt"), "--tls-key", str(mixed_dir / "tls.key"), name="mixed")
    try:
        assert mixed.wait(30) == 2
        assert "this machine holds files of two different PKIs" in mixed.log()
        assert foreign.wait(60) == 2
        log = foreign.log()
        assert "could not reach the server" in log and "not signed by this process's CA (--tls-ca)" in log, log
    finally:
        for p in (server, foreign, mixed):
            p.kill()
    # a machine whose clock is behind the one that issued its certificate is told so, with the fix
    with open(os.path.join(ours, "ca.crt"), "rb") as ca, open(os.path.join(ours, "site-0", "tls.crt"), "rb") as cert:
        ca_pem, cert_pem = ca.read(), cert.read()
    behind = datetime.datetime.now(datetime.timezone.utc) - datetime.timedelta(days=1)
    assert "set its clock right (NTP)" in pki.check_credentials(ca_pem, cert_pem, now=behind)
    ahead = datetime.datetime.now(datetime.timezone.utc) + datetime.timedelta(days=400)
    assert "expired" in pki.check_credentials(ca_pem, cert_pem, now=ahead)
    assert pki.check_credentials(ca_pem, cert_pem) is None
