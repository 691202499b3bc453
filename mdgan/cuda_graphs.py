"""A worker's MD-GAN step on CUDA replayed from CUDA graphs: its L discriminator steps and its feedback, captured
once for the run's batch shapes, then a few launches a step where the eager step makes hundreds.

A replay runs the kernels the eager step runs, on the same values in the same order, so a graphed step computes
what the eager one computes, bit for bit (tests/test_devices.py): graphs change how fast a CUDA run goes, never
what it computes. What is captured: D on the real batch and on X_d, J_disc and its backward into D's gradients
(Adam's step stays outside, as in the eager step), and J_gen(X_g) with its gradient F_n. Not captured: DP-SGD's
steps (Opacus's hooks), the CPU, a step whose batches have other shapes than the captured ones.

MDGAN_CUDA_GRAPHS=0 in the environment keeps every step eager, as does a tensor trace (MDGAN_TRACE_DIR)."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch

from mdgan import tensor_trace
from mdgan.step_results import DiscriminatorStats

log = logging.getLogger(__name__)

ENVIRONMENT = "MDGAN_CUDA_GRAPHS"
WARMUP = 2  # eager passes on the capture stream before capture (cuDNN's and cuBLAS's handles and workspaces)


def wanted(device: torch.device) -> bool:
    """On CUDA, unless MDGAN_CUDA_GRAPHS=0 or a tensor trace reads every step's tensors (mdgan/tensor_trace.py)."""
    return device.type == "cuda" and os.environ.get(ENVIRONMENT, "1") != "0" and not tensor_trace.enabled()


@dataclass(frozen=True)
class StepInputs:
    """One worker step's tensors on D's device."""

    real: torch.Tensor  # X_r: (b, *shape)
    real_labels: torch.Tensor | None  # (b,)
    fake: torch.Tensor  # X_d: (b, *shape)
    fake_labels: torch.Tensor | None  # (b,)
    generated: torch.Tensor  # X_g: (b, *shape)
    generated_labels: torch.Tensor | None  # (b,)

    def signature(self) -> tuple:
        return tuple(None if t is None else (tuple(t.shape), t.dtype, t.device) for t in (
            self.real, self.real_labels, self.fake, self.fake_labels, self.generated, self.generated_labels))

    def copy_into(self, static: "StepInputs") -> None:
        for mine, theirs in zip(self._tensors(), static._tensors()):
            if mine is not None:
                theirs.copy_(mine)

    def clone(self) -> "StepInputs":
        return StepInputs(*(None if t is None else t.detach().clone() for t in self._tensors()))

    def _tensors(self) -> tuple:
        return (self.real, self.real_labels, self.fake, self.fake_labels, self.generated, self.generated_labels)


@dataclass(frozen=True)
class GraphedFeedback:
    feedback: torch.Tensor  # F_n: (b, *shape) on D's device
    gen_loss: torch.Tensor  # J_gen(X_g): 0-dim, on D's device


class GraphedStep:
    """The graphs of one discriminator (its module, its Adam, its losses) for one signature of step inputs.

    disc_losses(real, real_labels, fake, fake_labels) -> (J_disc, real logits, fake logits) and
    gen_loss(generated, labels) -> J_gen are the eager step's own functions."""

    def __init__(self, discriminator: torch.nn.Module, optimizer: torch.optim.Optimizer, disc_losses, gen_loss,
                 inputs: StepInputs):
        self.discriminator, self.optimizer = discriminator, optimizer
        self.parameters = [p for p in discriminator.parameters() if p.requires_grad]
        self.signature = inputs.signature()
        self.device = inputs.real.device  # (cuda:N: captured and replayed there, whichever device is current)
        self.static = inputs.clone()
        self._disc_losses, self._gen_loss = disc_losses, gen_loss
        with torch.cuda.device(self.device):
            self._capture()

    def _disc_pass(self) -> torch.Tensor:
        """J_disc's forward and backward into D's .grad; (3,) loss, real and fake accuracies."""
        s = self.static
        loss, real_logits, fake_logits = self._disc_losses(s.real, s.real_labels, s.fake, s.fake_labels)
        loss.backward()
        return torch.stack([loss.detach(), (real_logits[:, 0] > 0).float().mean(),
                            (fake_logits[:, 0] <= 0).float().mean()])

    def _feedback_pass(self) -> tuple[torch.Tensor, torch.Tensor]:
        generated = self.static.generated.detach().clone().requires_grad_(True)
        loss = self._gen_loss(generated, self.static.generated_labels)
        (feedback,) = torch.autograd.grad(loss, generated)  # (b, *shape)
        return feedback, loss.detach()

    def _capture(self) -> None:
        # Warmed up and captured on a stream of this graph's own: cuBLAS keys its workspace by stream, so the
        # workspace these graphs use is made at the warm-up, outside any graph's memory pool, and is theirs alone.
        # Two workers' graphs replayed at once on their lanes never share one, and freeing one worker's graphs (a
        # churn join) frees none another uses.
        self.capture_stream = torch.cuda.Stream(self.device)
        self.capture_stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.capture_stream):  # (gradients computed and dropped: no weight changes)
            for _ in range(WARMUP):
                self._disc_pass()
                self._feedback_pass()
                for p in self.parameters:
                    p.grad = None
        torch.cuda.current_stream().wait_stream(self.capture_stream)
        self.disc_graph, self.feedback_graph = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
        self._disc_stats = self._record(self.disc_graph, self._disc_pass)
        self._grads = [p.grad for p in self.parameters]  # the graph writes D's gradients into these
        self._feedback, self._gen_loss_out = self._record(self.feedback_graph, self._feedback_pass,
                                                          pool=self.disc_graph.pool())

    def _record(self, graph, work, pool=None):
        """work() captured into graph (its kernels, not run now) on the graph's own stream: its outputs, which each
        replay rewrites."""
        with torch.cuda.graph(graph, pool=pool, stream=self.capture_stream, capture_error_mode="thread_local"):
            return work()

    def fits(self, inputs: StepInputs) -> bool:
        now = [p for p in self.discriminator.parameters() if p.requires_grad]  # (the same tensors: graphs hold them)
        return (inputs.signature() == self.signature and len(now) == len(self.parameters)
                and all(a is b for a, b in zip(now, self.parameters)))

    def disc_steps(self, inputs: StepInputs, steps: int) -> DiscriminatorStats:
        """`steps` D steps on the inputs (each: the graph, then Adam): the last one's loss and accuracies."""
        inputs.copy_into(self.static)
        for _ in range(steps):
            with torch.cuda.device(self.device):
                self.disc_graph.replay()
            for p, grad in zip(self.parameters, self._grads):
                p.grad = grad  # (an eager step between replays set them to None)
            self.optimizer.step()
        loss, real_accuracy, fake_accuracy = self._disc_stats.clone()
        return DiscriminatorStats(loss, real_accuracy, fake_accuracy)

    def feedback(self) -> GraphedFeedback:
        """F_n (b, *shape) and J_gen on the inputs of the last disc_steps, through D as it is now."""
        with torch.cuda.device(self.device):
            self.feedback_graph.replay()
        return GraphedFeedback(self._feedback.clone(), self._gen_loss_out.clone())


class StepGraphs:
    """A discriminator side's graphed step, captured at its first CUDA step; eager (None) when graphs are off,
    when capture fails (said once in the log), or for inputs of another signature than the captured ones."""

    def __init__(self, device: torch.device):
        self.enabled = wanted(device)
        self._graphed: GraphedStep | None = None

    def for_inputs(self, discriminator, optimizer, disc_losses, gen_loss, inputs: StepInputs) -> GraphedStep | None:
        if not self.enabled:
            return None
        if self._graphed is not None and self._graphed.fits(inputs):
            return self._graphed
        if self._graphed is not None:  # another shape: eager; the captured graph stays for the usual one
            return None
        try:
            self._graphed = GraphedStep(discriminator, optimizer, disc_losses, gen_loss, inputs)
        except RuntimeError as exc:  # (a capture the driver or this PyTorch refuses: the eager step computes the same)
            log.warning("CUDA graphs off for this discriminator, its steps run eagerly: %s", exc)
            for p in discriminator.parameters():
                p.grad = None
            self.enabled = False
            return None
        return self._graphed
