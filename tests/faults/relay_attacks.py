"""A relay that attacks what it carries, for tests/test_relay.py (installed with MDGAN_TEST_FAULT's "wrap").

MDGAN_TEST_RELAY (JSON) says what it does: {"record": PATH} appends every message it forwards (a RelayDown) to
PATH, length-prefixed; {"flip": ROUND} flips one byte of the first sealed chunk of ROUND's first push;
{"replay": ROUND} sends each receiver, in ROUND, the sealed chunks it was sent in the round before, under ROUND's
header round (an old discriminator passed off as new). `plaintext` wraps the sender's sealing: every wire chunk
it seals is appended to MDGAN_TEST_RELAY's "plaintext" PATH."""

from __future__ import annotations

import functools
import json
import os

from services.common.proto import peer_pb2


def _settings() -> dict:
    return json.loads(os.environ.get("MDGAN_TEST_RELAY") or "{}")


def _append(path: str, data: bytes) -> None:
    with open(path, "ab") as fh:
        fh.write(len(data).to_bytes(4, "little") + data)


def forward(original):
    settings = _settings()
    pushes: dict[int, tuple[str, int]] = {}  # push number -> (receiver, round)
    kept: dict[tuple[str, int], list[peer_pb2.RelayDown]] = {}  # (receiver, round) -> what it was sent
    flipped = set()

    @functools.wraps(original)
    async def attacked(self, receiver, down: peer_pb2.RelayDown):
        if settings.get("record"):
            _append(settings["record"], down.SerializeToString())
        if down.chunk.WhichOneof("body") == "header":
            pushes[down.push] = (receiver.identity, down.chunk.header.round)
        who, swap_round = pushes.get(down.push, ("", 0))
        kept.setdefault((who, swap_round), []).append(down)
        if settings.get("flip") == swap_round and down.chunk.WhichOneof("body") == "sealed" and swap_round not in flipped:
            flipped.add(swap_round)
            down = peer_pb2.RelayDown.FromString(down.SerializeToString())
            sealed = bytearray(down.chunk.sealed)
            sealed[len(sealed) // 2] ^= 0x01
            down.chunk.sealed = bytes(sealed)
        if settings.get("replay") == swap_round:
            old = kept.get((who, swap_round - 1), [])
            index = len(kept[(who, swap_round)]) - 1
            if index < len(old):
                number = down.push
                down = peer_pb2.RelayDown.FromString(old[index].SerializeToString())
                down.push = number
                if down.chunk.WhichOneof("body") == "header":
                    down.chunk.header.round = swap_round
        return await original(self, receiver, down)

    return attacked


def plaintext(original):
    path = _settings().get("plaintext")

    @functools.wraps(original)
    def recorded(wire_chunks, *args, **kwargs):
        if path:
            for chunk in wire_chunks:
                _append(path, chunk)
        return original(wire_chunks, *args, **kwargs)

    return recorded
