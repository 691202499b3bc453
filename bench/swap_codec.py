"""What one discriminator costs to put on the wire and take off it at a swap, in this process.

    python bench/swap_codec.py                  # MNIST MLP D (670,219 float32, 2.7 MB)
    python bench/swap_codec.py --repeats 50

Times, with the thread's CPU clock, the sender's and the receiver's work on the Peer push's chunks
(not gRPC's own: framing, TLS and the socket are the same either way), the way the worker did it
before the twelfth pass and the way it does now, alternated in the same run:

- sender, before: `state_chunks` (the tensors' bytes concatenated, sliced into chunks, each set
  into a message; before this pass it also copied each tensor out before joining them, so the real
  "before" was a little slower still), gRPC's serializer (`SerializeToString`), and the telemetry's count (`ByteSize`,
  which upb computes by serializing, and `len(chunk.data)`, a copy);
- sender, now: `wire_state_chunks` (each chunk written from the tensors' memory in one copy) and
  `data_chunk_bytes` for the count;
- receiver, before: the count (`ByteSize`, `len(chunk.data)`), then `accept` (reads `chunk.data`
  again), then `finish`;
- receiver, now: `chunk.data` read once, `data_chunk_bytes` for the count, `accept_data`, `finish`.

Prints ms per discriminator and the ratio now / before. The process keeps freed memory as the
services do (services/common/allocator.py). `bench/cpu_by_thread.py --swap-every 5`
against `--swap-every 0` gives what a whole swap round costs a running `mdgan local`.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from services.common import allocator  # noqa: E402
from mdgan.config import ModelSpec  # noqa: E402
from mdgan.models import build_discriminator  # noqa: E402
from services.common import codec  # noqa: E402
from services.common.proto import peer_pb2  # noqa: E402


def send_before(state):
    chunks = list(codec.state_chunks(state, 1, "worker-0", "worker-0"))
    wire = [c.SerializeToString() for c in chunks]
    counted = sum(c.ByteSize() for c in chunks), sum(len(c.data) for c in chunks)
    return wire, counted


def send_now(state):
    chunks = codec.wire_state_chunks(state, 1, "worker-0", "worker-0")
    counted = sum(len(w) for w, _ in chunks), sum(p for _, p in chunks)
    return [w for w, _ in chunks], counted


def receive_before(parsed, layout):
    assembler, counted = codec.StateAssembler(layout), 0
    for chunk in parsed:
        counted += chunk.ByteSize() + len(chunk.data)
        assembler.accept(chunk)
    return assembler.finish(), counted


def receive_now(parsed, layout):
    assembler, counted = codec.StateAssembler(layout), 0
    for chunk in parsed:
        data = chunk.data if chunk.WhichOneof("body") == "data" else None
        if data is None:
            counted += chunk.ByteSize()
            assembler.accept(chunk)
        else:
            counted += codec.data_chunk_bytes(len(data)) + len(data)
            assembler.accept_data(data)
    return assembler.finish(), counted


def cpu_ms(fn, *args) -> float:
    started = time.thread_time()
    fn(*args)
    return (time.thread_time() - started) * 1e3


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args()
    torch.set_num_threads(1)
    # The services' allocator settings: without them each receive's 2.7 MB buffer may be a fresh
    # mmap, page faults and all, or not, as glibc's sliding threshold happens to stand.
    allocator.keep_freed_memory()
    state = {k: v.clone() for k, v in build_discriminator(ModelSpec(), 0).state_dict().items()}
    layout = codec.layout_of(state)
    wire_before, counted_before = send_before(state)
    wire_now, counted_now = send_now(state)
    if wire_before != wire_now or counted_before != counted_now:
        raise SystemExit("the two senders disagree: not the same bytes on the wire, or not the same counts")
    parsed = [peer_pb2.DiscriminatorChunk.FromString(w) for w in wire_now]
    back_before, back_now = receive_before(parsed, layout)[0], receive_now(parsed, layout)[0]
    if not all(torch.equal(back_before[k], back_now[k]) and torch.equal(back_now[k], v) for k, v in state.items()):
        raise SystemExit("the two receivers disagree")
    times: dict[str, list[float]] = {name: [] for name in ("send before", "send now", "receive before",
                                                           "receive now")}
    for _ in range(args.repeats):  # alternated, so a slower moment of the machine slows both
        times["send before"].append(cpu_ms(send_before, state))
        times["send now"].append(cpu_ms(send_now, state))
        times["receive before"].append(cpu_ms(receive_before, parsed, layout))
        times["receive now"].append(cpu_ms(receive_now, parsed, layout))
    size = sum(t.numel() * t.element_size() for t in state.values())
    print(f"one discriminator of {size} bytes in {len(wire_now) - 1} data chunks, {args.repeats} repeats, "
          f"ms of thread CPU (median):")
    med = {name: statistics.median(values) for name, values in times.items()}
    for side in ("send", "receive"):
        print(f"  {side:8} before {med[side + ' before']:6.2f}   now {med[side + ' now']:6.2f}   "
              f"now / before {med[side + ' now'] / med[side + ' before']:.2f}x")
    print("same bytes on the wire and same counts: True")
    return 0


if __name__ == "__main__":
    sys.exit(main())
