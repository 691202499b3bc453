"""A straggler behind a real slow link: one worker in a network namespace whose veth to the host is
shaped by `tc tbf` (bench/netns.py), the others on loopback, under --sync quorum.

Needs root and iproute2 (namespaces, veth pairs, tc); skipped, with the reason, where they are not
permitted (most CI containers). bench/straggler.py --netns-rate measures the same set-up at length.
"""

from __future__ import annotations

import os
import sys

import pytest

from conftest import REPO
from procs import Proc, read_json, read_jsonl, start_server, start_worker

sys.path.insert(0, os.path.join(REPO, "bench"))
from netns import ShapedNamespace, why_not_available  # noqa: E402

pytestmark = pytest.mark.slow

REASON = why_not_available()


@pytest.mark.skipif(REASON is not None, reason=f"no shaped network namespace here: {REASON}")
def test_quorum_does_not_wait_for_a_worker_behind_a_slow_link(tmp_path):
    out = str(tmp_path)
    iterations = 20
    # a generated batch in and its feedback out, 31.4 KB each per iteration (b = 10, 784 float32):
    # about 0.25 s at 2 Mbit/s against milliseconds on loopback; no swap (a 2.7 MB discriminator: 11 s).
    # What the slow link does to the pace is measured in bench/straggler.py --netns-rate, not here.
    with ShapedNamespace("2mbit") as ns:
        server, port = start_server(out, "--listen", "0.0.0.0:0", "--workers", "3", "--iterations", str(iterations),
                                    "--swap-every", "1000", "--gan", "gan", "--seed", "2", "--sync", "quorum",
                                    "--quorum", "2", "--step-timeout", "60")
        fast = [start_worker(out, port, i, 3, "--dataset", "synthetic") for i in range(2)]
        slow = Proc("worker-2", ns.wrap([
            sys.executable, "-m", "services.worker", "--server", f"{ns.host_ip}:{port}", "--listen", "0.0.0.0:0",
            "--advertise-address", ns.ns_ip, "--shard-index", "2", "--num-shards", "3", "--threads", "1",
            "--metrics-port", "0", "--insecure", "--dataset", "synthetic"]), os.path.join(out, "worker-2.log"),
            env=dict(os.environ))
        try:
            assert server.wait(180) == 0, server.log()
            for worker in [*fast, slow]:
                assert worker.wait(60) == 0, worker.log()  # the shaped one joined over its veth and finished
            inbound, outbound = ns.bytes_shaped()
            summary = read_json(os.path.join(out, "summary.json"))
            records = read_jsonl(os.path.join(out, "history.jsonl"))
        finally:
            for p in [server, *fast, slow]:
                p.kill()
    assert summary["iterations"] == iterations and summary["workers_alive"] == 3
    assert all(r["answered"] >= 2 for r in records)  # the quorum, every iteration
    # the shaped worker's traffic went through the token buckets: generated batches in and feedback
    # out (10 x 784 float32 each, an iteration it took part in), however late (measured here: 602 KB
    # in, 314 KB out over the 20 iterations)
    print(f"through the shaped link: {inbound} B in, {outbound} B out")
    assert inbound >= 10 * 784 * 4, inbound
    assert outbound >= 10 * 784 * 4, outbound
