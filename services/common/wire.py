"""What each algorithm's messages count on the `mdgan_wire_*` counters: (kind, payload bytes), the same
function on both sides (the server counts what it sends and receives, a worker the same messages from
its end), so that a run's sender and receiver counts agree and `mdgan traffic` can hold them to the
algorithm's formula. A message that carries no tensors is CONTROL.

Each algorithm's handle (services/server/algorithms/x.py) and worker module
(services/worker/algorithms/x.py) take their `traffic` from here.
"""

from __future__ import annotations

CONTROL = ("control", 0)  # the telemetry kind and payload of a message that carries no tensors
MODELS = ("generator", "discriminator")  # the kinds of a model's part (FL-GAN, the parameter-server GAN)


def tensor_payload(tensor) -> int:
    """What a tensor costs on the wire: its values, and its int8 scales when compressed."""
    return len(tensor.data) + len(tensor.scales)


def mdgan(body: str | None, message) -> tuple[str, int]:
    """Table III's tensors: X_g and X_d down, F_n up (labels are not in it)."""
    if body == "batches":
        b = message.batches
        return "batches", tensor_payload(b.generated) + tensor_payload(b.discriminated)
    if body == "feedback":
        return "feedback", tensor_payload(message.feedback.gradient)
    return CONTROL


def _model_part(part) -> tuple[str, int]:
    """A part of a model's state: kind the model (control for a name that is none), payload its raw bytes."""
    return (part.model if part.model in MODELS else "control"), len(part.data)


def flgan(body: str | None, message) -> tuple[str, int]:
    """Whole models, both ways."""
    return _model_part(message.model_part) if body == "model_part" else CONTROL


def psgan(body: str | None, message) -> tuple[str, int]:
    """Weights down, gradients (and buffers) up, all as replica parts."""
    return _model_part(message.replica_part) if body == "replica_part" else CONTROL


def pwgan(body: str | None, message) -> tuple[str, int]:
    """The formula's tensors: X_g and phi down, N^k and F_k up (ACGAN labels are not in it). Kinds: the
    round that carries X_g counts as "batches", the last reply (with F_k) as "feedback"."""
    if body == "potential_round":
        r = message.potential_round
        return ("batches" if r.HasField("generated") else "potentials"), tensor_payload(r.potentials) + tensor_payload(r.generated)
    if body == "potential_counts":
        c = message.potential_counts
        return ("feedback" if c.HasField("feedback") else "counts"), tensor_payload(c.counts) + tensor_payload(c.feedback)
    return CONTROL
