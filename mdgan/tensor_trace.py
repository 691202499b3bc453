"""Where two runs that should compute the same part, tensor by tensor. With MDGAN_TRACE_DIR set, each network a run
watches (G as "G", worker n's discriminator or critic as "D<n>") appends to DIR/<process id>.jsonl a record of each
of its modules' forward outputs, of each parameter's gradient once accumulated, and of each parameter after each
optimizer step: which network, the record's number within that network, what it is, the tensor's shape and sha256.
A network's records come in the order its process computes them, however many processes a run has, so two runs'
records of one network compare one by one (bench/gpu_divergence.py --trace): the first that differs names the
module, gradient or step where the runs part.

Nothing is hooked or written unless the variable is set. A record reads its tensor to the host, which a CUDA graph's
capture does not allow: tracing keeps every step eager (mdgan/cuda_graphs.py). Copies of a watched network (the
evaluator's snapshots of G) record nothing."""

from __future__ import annotations

import hashlib
import json
import os
import threading
import weakref

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

ENVIRONMENT = "MDGAN_TRACE_DIR"

_lock = threading.Lock()
_watched: dict[int, tuple[weakref.ref, str, str]] = {}  # id of a parameter -> (it, its network, its name)
_counts: dict[str, int] = {}  # network -> records written
_file = None
_optimizer_hook = None


def enabled() -> bool:
    return bool(os.environ.get(ENVIRONMENT))


def watch(network: torch.nn.Module, tag: str) -> None:
    """Record `network`'s forward outputs, gradients and optimizer steps as `tag`'s (when tracing is on)."""
    global _optimizer_hook
    if not enabled():
        return
    for name, module in network.named_modules():
        module.register_forward_hook(_forward_recorder(module, tag, name or "(network)"))
    for name, parameter in network.named_parameters():
        _watched[id(parameter)] = (weakref.ref(parameter), tag, name)
        parameter.register_post_accumulate_grad_hook(_gradient_recorder(parameter))
    if _optimizer_hook is None:
        _optimizer_hook = register_optimizer_step_post_hook(_after_step)


def _forward_recorder(module: torch.nn.Module, tag: str, name: str):
    def hook(called, inputs, output):
        if called is module:  # (a deepcopy of the network shares this hook; its calls are not the run's)
            for i, tensor in enumerate(torch.utils._pytree.tree_leaves(output)):
                if isinstance(tensor, torch.Tensor):
                    _record(tag, name if i == 0 else f"{name}[{i}]", "forward", tensor)
    return hook


def _watched_as(parameter: torch.Tensor) -> tuple[str, str] | None:
    """(network, name) of a watched parameter; None for any other tensor (a copy's, or one now at a freed one's id)."""
    found = _watched.get(id(parameter))
    return found[1:] if found is not None and found[0]() is parameter else None


def _gradient_recorder(parameter: torch.Tensor):
    def hook(called):
        found = _watched_as(called)
        if called is parameter and found is not None:
            _record(*found, "gradient", called.grad)
    return hook


def _after_step(optimizer, args, kwargs) -> None:
    for group in optimizer.param_groups:
        for parameter in group["params"]:
            found = _watched_as(parameter)
            if found is not None:
                _record(*found, "weight", parameter)


def _record(tag: str, name: str, kind: str, tensor: torch.Tensor) -> None:
    global _file
    if not enabled():  # (hooks outlive a trace switched off in this process)
        return
    data = tensor.detach().to("cpu").contiguous()
    digest = hashlib.sha256(data.reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()[:32]
    with _lock:
        path = os.path.join(os.environ[ENVIRONMENT], f"{os.getpid()}.jsonl")
        if _file is None or _file.name != path:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            _file = open(path, "a", encoding="utf-8", buffering=1)
        number = _counts[tag] = _counts.get(tag, 0) + 1
        _file.write(json.dumps({"network": tag, "n": number, "kind": kind, "name": name,
                                "shape": list(data.shape), "dtype": str(data.dtype), "sha256": digest}) + "\n")


def read(directory: str) -> dict[str, list[dict]]:
    """A run's records, network by network, in the order they were computed."""
    records: dict[str, list[dict]] = {}
    for entry in sorted(os.listdir(directory)):
        if entry.endswith(".jsonl"):
            with open(os.path.join(directory, entry), encoding="utf-8") as fh:
                for line in fh:
                    if line.strip():
                        record = json.loads(line)
                        records.setdefault(record["network"], []).append(record)
    return {tag: sorted(found, key=lambda r: r["n"]) for tag, found in sorted(records.items())}


def first_differences(a: dict[str, list[dict]], b: dict[str, list[dict]]) -> dict[str, str]:
    """For each network of either run, where its records part ("" where they agree throughout)."""
    found = {}
    for tag in sorted(set(a) | set(b)):
        mine, theirs = a.get(tag, []), b.get(tag, [])
        found[tag] = ""
        for i, (x, y) in enumerate(zip(mine, theirs)):
            if {k: x[k] for k in ("kind", "name", "shape", "dtype", "sha256")} != \
                    {k: y[k] for k in ("kind", "name", "shape", "dtype", "sha256")}:
                what = (f"{x['kind']} {x['name']}" if (x["kind"], x["name"]) == (y["kind"], y["name"])
                        else f"{x['kind']} {x['name']} against {y['kind']} {y['name']}")
                found[tag] = f"record {i + 1}: {what} (the {i} before it agree)"
                break
        else:
            if len(mine) != len(theirs):
                found[tag] = f"{len(mine)} records against {len(theirs)}"
    return found
