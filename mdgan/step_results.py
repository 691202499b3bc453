"""What a worker's MD-GAN step answers (StepResult: the feedback, the last D step's losses and accuracies) and how
an iteration's answers are read to the host: their losses and accuracies stay on D's device as a step leaves them
(0-dim tensors) until a whole iteration's are read at once, one transfer a device."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch


@dataclass
class StepResult:
    """A worker's answer. Its losses and accuracies may be 0-dim float32 tensors on D's device, as a step
    leaves them: read_stats reads those of a whole iteration to the host at once."""

    feedback: torch.Tensor  # F_n: (b, *sample_shape) float32
    disc_loss: float | torch.Tensor
    gen_loss: float | torch.Tensor  # J_gen(X_g) under this worker's D
    real_accuracy: float | torch.Tensor  # share of real samples D calls real (last D step)
    fake_accuracy: float | torch.Tensor  # share of X_d samples D calls generated (last D step)
    disc_seconds: float = 0.0  # wall time of the L discriminator steps
    feedback_seconds: float = 0.0  # wall time of computing F_n
    epsilon: float = float("nan")  # DP: the epsilon this site has spent so far (nan: not private)
    delta: float = float("nan")  # DP: the delta it is spent at
    fixed_noise: bool = False  # DP: the site's noise was fixed on purpose (--dp-fixed-noise), not secret


STATS = ("disc_loss", "gen_loss", "real_accuracy", "fake_accuracy")


@dataclass(frozen=True)
class DiscriminatorStats:
    """The last discriminator step's loss and accuracies: 0-dim tensors on D's device."""

    loss: torch.Tensor  # float64 from DP-SGD's steps, float32 from a replayed graph (mdgan/cuda_graphs.py)
    real_accuracy: torch.Tensor  # share of real samples D calls real
    fake_accuracy: torch.Tensor  # share of generated samples D calls generated


@dataclass
class StatsReading:
    """A read of an iteration's step stats under way: the tensors among them copied to the host without waiting
    (one copy a device, into pinned memory), so that the host can queue more work (G's update) before it waits."""

    results: list[StepResult]
    copies: list[tuple[list[tuple[int, str]], torch.Tensor, object]]  # (which stats, host copy, CUDA event | None)

    def result(self) -> list[StepResult]:
        """The results with their losses and accuracies as floats (what .item() gives: float32 values, exactly)."""
        read = [dict() for _ in self.results]
        for entries, host, done in self.copies:
            if done is not None:
                done.synchronize()  # (the steps whose stats these are, not what was queued after them)
            for (i, name), value in zip(entries, host.tolist()):
                read[i][name] = value
        return [dataclasses.replace(result, **changes) if changes else result
                for result, changes in zip(self.results, read)]


def start_reading(results: list[StepResult]) -> StatsReading:
    """Start reading the tensors among the results' stats to the host: one transfer a device."""
    pending: dict[torch.device, list[tuple[int, str, torch.Tensor]]] = {}
    for i, result in enumerate(results):
        for name in STATS:
            value = getattr(result, name)
            if isinstance(value, torch.Tensor):
                pending.setdefault(value.device, []).append((i, name, value))
    copies = []
    for device, entries in pending.items():
        stacked = torch.stack([v for _, _, v in entries])
        done = None
        if device.type == "cuda":
            host = torch.empty(stacked.shape, dtype=stacked.dtype, device="cpu", pin_memory=True)
            host.copy_(stacked, non_blocking=True)
            done = torch.cuda.Event()
            done.record(torch.cuda.current_stream(device))
        else:
            host = stacked
        copies.append(([(i, name) for i, name, _ in entries], host, done))
    return StatsReading(results, copies)


def read_stats(results: list[StepResult]) -> list[StepResult]:
    """The results with their losses and accuracies as floats: the tensors among them read from their
    device in one transfer a device (one host synchronisation, where an .item() each was one each). The
    same floats as .item() gives: float32 values, converted exactly."""
    return start_reading(results).result()


def read_scalars(*values: torch.Tensor) -> list[float]:
    """Scalar tensors of one device as floats, in one transfer (one host synchronisation where an .item()
    each was one each): the floats .item() gives, since they share a dtype."""
    return torch.stack([v.detach().reshape(()) for v in values]).tolist()
