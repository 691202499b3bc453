"""Latency between sites without netem (bench/delay_link.py, bench/netns.py's `delayed`): a round trip
measured across a consortium's links is the sum of the one-way delays set on them, within a
millisecond, with and without a rate limit on the same link.

Needs root and iproute2; skipped, with the reason, where namespaces are not permitted.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from conftest import REPO

sys.path.insert(0, os.path.join(REPO, "bench"))
from netns import Consortium, why_not_available  # noqa: E402

REASON = why_not_available()
RTT = os.path.join(REPO, "bench", "rtt.py")


def round_trip(lan: Consortium, client: str, server: str, port: int = 7000, count: int = 30) -> dict:
    echo = subprocess.Popen(lan.wrap(server, [sys.executable, RTT, "serve", str(port)]), stdout=subprocess.PIPE,
                            text=True)
    try:
        assert echo.stdout.readline().strip() == "listening"
        done = subprocess.run(lan.wrap(client, [sys.executable, RTT, "ping", lan.host(server), str(port),
                                                "--count", str(count)]),
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        return json.loads(done.stdout)
    finally:
        echo.kill()
        echo.wait()


@pytest.mark.skipif(REASON is not None, reason=f"no network namespaces here: {REASON}")
@pytest.mark.parametrize("shaped", [{}, {"site": "10mbit"}], ids=["delay", "delay and rate"])
def test_a_round_trip_across_delayed_links_is_the_delays_set(shaped):
    # the site's link: 20 ms up, 30 ms down; the server's: 5 ms each way -> 60 ms a round trip
    delayed = {"site": ("20ms", "30ms"), "server": ("5ms", "5ms")}
    with Consortium(["server", "site", "near"], delayed=delayed, shaped=shaped) as lan:
        far = settled_round_trip(lan, "site", "server", 60.0)
        near = settled_round_trip(lan, "near", "server", 10.0)  # an undelayed machine: the server's 10 ms only
    assert abs(far["median_ms"] - 60.0) < 1.0, far
    assert abs(near["median_ms"] - 10.0) < 1.0, near


def settled_round_trip(lan: Consortium, client: str, server: str, expected_ms: float, tries: int = 3) -> dict:
    """A round trip's measurement, never below the delays set; measured again (up to `tries` times)
    while its median is more than a millisecond above them: a loaded machine (the other test process,
    other work) only ever adds to a round trip, and a relay that adds its own delay adds it every time."""
    for _ in range(tries):
        measured = round_trip(lan, client, server)
        assert measured["min_ms"] > expected_ms - 1.0, measured  # never early
        if abs(measured["median_ms"] - expected_ms) < 1.0:
            break
    return measured


@pytest.mark.skipif(REASON is not None, reason=f"no network namespaces here: {REASON}")
def test_jitter_spreads_the_delay_without_reordering():
    with Consortium(["server", "site"], delayed={"site": ("20ms", "20ms")}, jitter="5ms") as lan:
        measured = round_trip(lan, "site", "server", count=60)
    # 40 +- 10 (two delayed legs); above, a loaded machine's scheduling of the relays adds up to a few ms
    assert 30.0 <= measured["min_ms"] and measured["max_ms"] <= 53.0, measured
    assert measured["max_ms"] - measured["min_ms"] > 2.0, measured  # spread, not a fixed delay
