import socket
import urllib.request

import torch

from services.common import codec
from services.common.proto import coordinator_pb2 as pb
from services.common.telemetry import DIRECTIONS, KINDS, Telemetry, counter_total


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_every_wire_series_exists_from_the_start_and_counts_both_sizes():
    t = Telemetry("server")
    text = t.exposition().decode()
    for direction in DIRECTIONS:
        for kind in KINDS:
            assert f'mdgan_wire_payload_bytes_total{{direction="{direction}",kind="{kind}",side="sender"}} 0.0' in text
    message = pb.ServerMessage(batches=pb.Batches(iteration=1, generated=codec.encode_tensor(torch.zeros(10, 784)),
                                                  discriminated=codec.encode_tensor(torch.zeros(10, 784))))
    t.count("server_to_worker", "batches", "sender", message, payload=2 * 10 * 784 * 4)
    assert counter_total(t.payload_bytes, direction="server_to_worker", side="sender") == 62_720
    assert counter_total(t.message_bytes, direction="server_to_worker", side="sender") == message.ByteSize() > 62_720
    assert counter_total(t.messages, direction="server_to_worker") == 1
    assert "_created" not in t.exposition().decode()


def test_metrics_are_served_over_http_and_dumped(tmp_path):
    t = Telemetry("worker")
    port = t.serve(_free_port(), "127.0.0.1")
    t.iterations.inc(3)
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    assert "mdgan_iterations_total 3.0" in body
    assert 'mdgan_iteration_phase_duration_seconds_count{phase="disc_steps"} 0.0' in body
    assert Telemetry("worker").serve(0) is None  # port 0 turns the endpoint off
    t.dump(str(tmp_path / "m" / "worker.prom"))
    assert "mdgan_iterations_total 3.0" in (tmp_path / "m" / "worker.prom").read_text()


def test_a_dump_that_cannot_be_written_is_logged_not_raised(tmp_path, caplog):
    # It runs in the services' `finally` as they stop: raising there hid why they stopped (the
    # server's own error) and skipped stopping its gRPC server.
    (tmp_path / "m").write_text("a file where the folder should be")
    with caplog.at_level("ERROR", logger="services.common.telemetry"):
        Telemetry("server").dump(str(tmp_path / "m" / "server.prom"))
    assert "could not write the final metrics" in caplog.text and "server.prom" in caplog.text
