"""Adam for the GAN's networks: torch.optim.Adam's per-tensor loop (foreach=False), its kernels on its values in its
order, so a step moves the weights exactly as torch.optim.Adam(foreach=False) does, on the CPU and on CUDA, bit for
bit (tests/test_adam.py). What it leaves out is the general optimizer's per-step bookkeeping (options this project
never sets, checks on every parameter), which on CUDA costs more host time a step than the kernels themselves.

torch's multi-tensor (foreach) and fused forms take fewer launches but round differently on CUDA: a CUDA run would
no longer compute what it computed before, so they are not used. State, state_dict and load_state_dict are
torch.optim.Adam's: checkpoints and swapped optimizer states are the same as ever."""

from __future__ import annotations

import torch


class Adam(torch.optim.Adam):
    """torch.optim.Adam(params, lr, betas) with eps 1e-8, no weight decay, no amsgrad, real parameters."""

    def __init__(self, params, lr: float, betas: tuple[float, float]):
        super().__init__(params, lr=lr, betas=betas, foreach=False)

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            raise ValueError("this Adam takes no closure")
        for group in self.param_groups:
            lr, eps = group["lr"], group["eps"]
            beta1, beta2 = group["betas"]
            for param in group["params"]:
                grad = param.grad
                if grad is None:
                    continue
                state = self.state[param]
                if not state:  # as torch.optim.Adam starts a parameter's state
                    state["step"] = torch.tensor(0.0, dtype=torch.float32, device="cpu")  # (torch keeps it there)
                    state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
                step_t, exp_avg, exp_avg_sq = state["step"], state["exp_avg"], state["exp_avg_sq"]
                step_t += 1
                exp_avg.lerp_(grad, 1 - beta1)
                exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                step = step_t.item()
                bias_correction1 = 1 - beta1**step
                bias_correction2 = 1 - beta2**step
                step_size = lr / bias_correction1
                bias_correction2_sqrt = bias_correction2**0.5
                denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)
                param.addcdiv_(exp_avg, denom, value=-step_size)
        return None
