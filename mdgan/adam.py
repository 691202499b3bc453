"""Adam for the GAN's networks: torch.optim.Adam's per-tensor loop (foreach=False), its kernels on its values in its
order, so a step moves the weights exactly as torch.optim.Adam(foreach=False) does, on the CPU and on CUDA, bit for
bit (tests/test_adam.py). What it leaves out is the general optimizer's per-step bookkeeping (options this project
never sets, checks on every parameter), which on CUDA costs more host time a step than the kernels themselves.

On CUDA a step runs those same kernels once over all of a network's parameters laid end to end (`FlatMoments`):
each is elementwise, so every element gets the arithmetic the per-tensor loop gives it, in about ten launches where
the loop makes seven a parameter. torch's multi-tensor (foreach) and fused forms take fewer launches too but round
differently on CUDA: a CUDA run would no longer compute what it computed before, so they are not used.

State, state_dict and load_state_dict are torch.optim.Adam's (in the flat form, each parameter's moments are views of
the flat ones): checkpoints and swapped optimizer states are the same as ever.

MDGAN_FLAT_ADAM=0 in the environment keeps the per-tensor loop on CUDA too."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

ENVIRONMENT = "MDGAN_FLAT_ADAM"


def flat_wanted(device: torch.device) -> bool:
    """The flat form where an Adam is not told (flat=None): on CUDA, unless MDGAN_FLAT_ADAM=0."""
    return device.type == "cuda" and os.environ.get(ENVIRONMENT, "1") != "0"


@dataclass
class FlatMoments:
    """Adam's moments of a group's parameters laid end to end; each parameter's state holds views of them."""

    params: tuple[torch.Tensor, ...]
    exp_avg: torch.Tensor  # (sum of the parameters' numel,)
    exp_avg_sq: torch.Tensor  # (sum of the parameters' numel,)
    views: tuple[tuple[torch.Tensor, torch.Tensor], ...]  # each parameter's (exp_avg, exp_avg_sq) in the state

    @classmethod
    def adopt(cls, params: list[torch.Tensor], state) -> "FlatMoments":
        """The flat moments of `params`: zeros where none has a state yet, else a copy of their states' moments
        (after load_state_dict or a swap); each state then holds views of them."""
        fresh = not any(state[p] for p in params)
        flat = {}
        for name in ("exp_avg", "exp_avg_sq"):
            flat[name] = (torch.zeros(sum(p.numel() for p in params), dtype=params[0].dtype, device=params[0].device)
                          if fresh else torch.cat([state[p][name].reshape(-1) for p in params]))
        if not fresh:
            _read_here([state[p][name] for p in params for name in ("exp_avg", "exp_avg_sq")])
        views = []
        for p, (avg, avg_sq) in zip(params, zip(*(_split(flat[n], params) for n in ("exp_avg", "exp_avg_sq")))):
            if fresh:
                state[p]["step"] = _new_step()
            state[p]["exp_avg"], state[p]["exp_avg_sq"] = avg, avg_sq
            views.append((avg, avg_sq))
        return cls(tuple(params), flat["exp_avg"], flat["exp_avg_sq"], tuple(views))

    def holds(self, params: list[torch.Tensor], state) -> bool:
        """Whether these are still the moments of exactly `params` (no load, swap or clear since)."""
        return (len(params) == len(self.params) and all(a is b for a, b in zip(params, self.params))
                and all(state[p].get("exp_avg") is avg and state[p].get("exp_avg_sq") is avg_sq
                        for p, (avg, avg_sq) in zip(params, self.views)))


def _read_here(replaced: list[torch.Tensor]) -> None:
    """Moments the flat ones were just copied from, about to be dropped: on CUDA their memory is not handed out
    again before the current stream has read them. They may come from another stream (a swap's or a checkpoint's
    tensors, made on the main stream, read on a worker's lane: mdgan/cuda_lanes.py), whose next allocation could
    otherwise take and overwrite them before this stream's copy has run."""
    for tensor in replaced:
        if tensor.is_cuda:
            tensor.record_stream(torch.cuda.current_stream(tensor.device))


def _split(flat: torch.Tensor, like: list[torch.Tensor]) -> list[torch.Tensor]:
    """Views of `flat` shaped as each tensor of `like`, in order."""
    return [part.view_as(p) for part, p in zip(flat.split([p.numel() for p in like]), like)]


UNSUPPORTED = ("weight_decay", "amsgrad", "maximize", "decoupled_weight_decay")  # torch.optim.Adam's, asked for


class Adam(torch.optim.Adam):
    """torch.optim.Adam(params, lr, betas) with eps 1e-8, no weight decay, no amsgrad, real parameters.

    flat: step over the parameters laid end to end; None (the default): as flat_wanted says for their device."""

    def __init__(self, params, lr: float, betas: tuple[float, float], flat: bool | None = None):
        super().__init__(params, lr=lr, betas=betas, foreach=False)
        self.flat = flat
        self._flat: dict[int, FlatMoments] = {}  # param group index -> its flat moments

    def __getstate__(self):  # (a copy or a pickle: torch's three fields and the form; the flat moments are rebuilt)
        return {**super().__getstate__(), "flat": self.flat}

    def __setstate__(self, state):  # (also load_state_dict's way in, with the state alone: the form stays)
        super().__setstate__(state)
        self.flat = state.get("flat", getattr(self, "flat", None))
        self._flat = {}

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            raise ValueError("this Adam takes no closure")
        for index, group in enumerate(self.param_groups):
            unsupported = [k for k in UNSUPPORTED if group.get(k)]
            if unsupported:  # (a loaded state_dict of torch's Adam may ask for them; this step would ignore them)
                raise ValueError(f"this Adam takes no {', '.join(unsupported)} (param group {index})")
            moments = self._flat_moments(index, group)
            if moments is not None:
                self._flat_step(group, moments)
            else:
                self._flat.pop(index, None)  # (a per-tensor step may leave the parameters' steps apart)
                self._per_tensor_step(group)
        return None

    def _flat_moments(self, index: int, group) -> FlatMoments | None:
        """The group's flat moments when the flat step applies: wanted, every parameter with a gradient, all of one
        dtype, contiguous and on one device, and (to lay them end to end) their states all new or all at one step.
        None: a per-tensor step."""
        params = group["params"]
        if not params or self.flat is False or (self.flat is None and not flat_wanted(params[0].device)):
            return None
        first = params[0]
        if not all(p.grad is not None and p.dtype == first.dtype and p.device == first.device and p.is_contiguous()
                   for p in params):
            return None
        moments = self._flat.get(index)
        if moments is not None and moments.holds(params, self.state):
            return moments
        states = [self.state[p] for p in params]
        if any(states) and not (all(states) and len({float(s["step"]) for s in states}) == 1):
            return None
        moments = self._flat[index] = FlatMoments.adopt(params, self.state)
        return moments

    def _flat_step(self, group, moments: FlatMoments) -> None:
        params = group["params"]
        for p in params:
            self.state[p]["step"] += 1
        grad = torch.cat([p.grad.reshape(-1) for p in params])  # (total,)
        weights = torch.cat([p.reshape(-1) for p in params])  # (total,)
        _update(weights, grad, moments.exp_avg, moments.exp_avg_sq, self.state[params[0]]["step"].item(), group)
        torch._foreach_copy_(list(params), _split(weights, params))

    def _per_tensor_step(self, group) -> None:
        for param in group["params"]:
            if param.grad is None:
                continue
            state = self.state[param]
            if not state:
                state["step"] = _new_step()
                state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
            state["step"] += 1
            _update(param, param.grad, state["exp_avg"], state["exp_avg_sq"], state["step"].item(), group)


def _new_step() -> torch.Tensor:
    """A parameter's step count as torch.optim.Adam starts it (on the CPU, where torch keeps it)."""
    return torch.tensor(0.0, dtype=torch.float32, device="cpu")


def _update(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, step: float,
            group) -> None:
    """torch.optim.Adam(foreach=False)'s update of one tensor, its kernels and scalars in its order; elementwise, so
    the flat step's one call over every parameter gives each element what a call per parameter gives it."""
    lr, eps = group["lr"], group["eps"]
    beta1, beta2 = group["betas"]
    exp_avg.lerp_(grad, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    bias_correction1 = 1 - beta1**step
    bias_correction2 = 1 - beta2**step
    step_size = lr / bias_correction1
    bias_correction2_sqrt = bias_correction2**0.5
    denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)
    param.addcdiv_(exp_avg, denom, value=-step_size)
