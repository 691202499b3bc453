"""The server's view of a private site, audited in one run (Steinke, Nasr and Jagielski 2023, "Privacy auditing with
one (1) training run"): m canaries, each put in at the site with probability 1/2, go through the site's own
mechanism code with the run's settings; an attacker holding what the server holds (every answer or noised sum the
site released, the run's settings and seed, and the number of a --dp-fixed-noise the run recorded) scores each
canary and guesses 'in' for the k it is surest of; from its correct guesses, an empirical
lower bound on epsilon at 95% confidence, printed beside the accountant's.

- Private feedback: canary j is one answer of the site: b rows, each C times a random unit direction, with sign
  +1 (in) or -1 (out): the two neighbouring answers differ by 2C a row, the sensitivity the accountant charges. The
  site's FeedbackMechanism clips, noises (its secret stream, draw j) and counts it. Score: the answer minus the
  attacker's estimate of its noise, along the canary's direction.
- DP-SGD: canaries are coordinates (Dirac gradient canaries of norm C) of the site's noised gradient sum, each
  sampled at the site's rate q at every step of the planned run (its Poisson sampling stream) when in; the noise is
  the site's stream's. Score: the sum over the steps of the released coordinate minus the attacker's estimate.

The attacker's estimate of the noise: the draws of the number's stream when the run recorded a --dp-fixed-noise
(the server stores it: the noise comes off), else the draws a generator seeded by the run's seed gives (what the
server could compute when the noise followed the seed). The bound is Steinke et al.'s (their p-value for r guesses
of which v are right, delta included), the largest epsilon the guesses reject at the confidence. Everything here is
on the CPU, where a site draws its noise on any device.
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import asdict, dataclass

import torch

from mdgan import privacy
from mdgan.config import TrainingConfig, named
from mdgan.gan import derive_seed
from mdgan.privacy_ledger import PrivacyLedger
from mdgan.secret_noise import SiteSecret


@dataclass(frozen=True)
class OneRunAudit:
    """One site's one-run audit: the canaries, the guesses and how many were right, and the bound."""

    site: int
    mechanism: str
    canaries: int
    guesses: int
    correct: int
    epsilon_lower_bound: float  # at `confidence`: the site's mechanism is not (epsilon, delta)-DP below it
    canary_epsilon: float  # the accountant's epsilon of what each canary went through
    delta: float
    noise_known: bool  # the attacker held the site's noise (a --dp-fixed-noise the run recorded)
    confidence: float = 0.95

    def to_dict(self) -> dict:
        return asdict(self)


def p_value(m: int, r: int, v: int, epsilon: float, delta: float) -> float:
    """The chance that an (epsilon, delta)-DP mechanism lets r guesses about m canaries (each in with probability
    1/2) be right v times or more (Steinke, Nasr and Jagielski 2023, Theorem 3.1 with its delta term)."""
    from scipy.stats import binom

    if not 0 <= v <= r <= m:
        raise ValueError(f"need 0 <= v <= r <= m, got v={v}, r={r}, m={m}")
    import numpy as np

    right = 1.0 / (1.0 + math.exp(-epsilon))  # randomized response's accuracy at epsilon
    tail = float(binom.sf(v - 1, r, right))  # P[Binomial(r, right) >= v]
    if v == 0 or delta == 0:
        return min(1.0, tail)
    below = np.cumsum(binom.pmf(np.arange(v - 1, -1, -1), r, right))  # i-th: P[v - i <= Binomial < v]
    alpha = float(np.max(below / np.arange(1, v + 1)))
    return min(1.0, tail + 2 * m * delta * alpha)


def epsilon_lower_bound(m: int, r: int, v: int, delta: float, confidence: float = 0.95) -> float:
    """The largest epsilon that v right guesses of r reject at `confidence` (0 when they reject none)."""
    level = 1.0 - confidence
    if p_value(m, r, v, 0.0, delta) >= level:
        return 0.0
    low, high = 0.0, 1.0
    while p_value(m, r, v, high, delta) < level:
        low, high = high, high * 2
        if high > 200:
            return low
    for _ in range(40):
        middle = (low + high) / 2
        low, high = (middle, high) if p_value(m, r, v, middle, delta) < level else (low, middle)
    return low


def _guesses(scores: torch.Tensor, truth: torch.Tensor, guesses: int) -> tuple[int, int]:
    """(r, v): the attacker guesses 'in' for the `guesses` highest scores and abstains on the rest (a canary never
    sampled scores as one that is out: guessing 'out' on low scores only adds errors)."""
    top = torch.argsort(scores, descending=True)[:guesses]
    return len(top), int(truth[top].sum())


def _site_secret(config: TrainingConfig, site: int) -> tuple[SiteSecret, bool]:
    """The secret the canaries' noise comes from, and whether the attacker holds it: a recorded fixed noise's, or a
    new secret (the site's own, which nothing the server stores reveals)."""
    fixed = config.privacy.fixed_noise
    return (SiteSecret.from_fixed(fixed, site), True) if fixed is not None else (SiteSecret.new(), False)


def audit_feedback_site(config: TrainingConfig, site: int, shard_size: int, canaries: int, guesses: int,
                        seed: int = 0) -> OneRunAudit:
    spec = config.privacy
    resolved = privacy.resolve(spec, shard_size, config.batch_size, config.iterations, config.disc_steps)
    resolved = privacy.SitePrivacy(**{**asdict(resolved), "discriminators": 1})  # one part: every answer a canary
    secret, known = _site_secret(config, site)
    from mdgan.algorithms.mdgan.private_feedback import FeedbackMechanism

    mechanism = FeedbackMechanism(resolved, PrivacyLedger(None, "audit", site, "feedback", secret))
    b, d = config.batch_size, math.prod(config.model.sample_shape)
    draws = torch.Generator().manual_seed(derive_seed(seed, "one-run-audit", site))
    truth = torch.rand(canaries, generator=draws) < 0.5  # (m,): in or out
    # the attacker's estimate of a secret noise: what the seed gave when the noise followed it (its best guess)
    seeded = torch.Generator().manual_seed(derive_seed(config.seed, "dp-feedback-noise", site))
    fixed_stream = secret.stream("feedback/noise")
    std = resolved.noise_multiplier * resolved.max_grad_norm
    scores = torch.empty(canaries, dtype=torch.float64)
    for j in range(canaries):
        direction = torch.randn(b, d, generator=draws, dtype=torch.float64)
        direction /= direction.norm(dim=1, keepdim=True)  # (b, d): unit rows
        rows = (1.0 if truth[j] else -1.0) * resolved.max_grad_norm * direction
        index = mechanism.ledger.answers_given
        answer = mechanism.answer(0, rows.float()).double()  # (b, d): what the server receives, times b
        estimate = fixed_stream.normal(index, b * d, std).view(b, d) if known else \
            torch.normal(0.0, std, size=(b, d), generator=seeded).double()
        scores[j] = ((answer - estimate) * direction).sum()
    r, v = _guesses(scores, truth, guesses)
    per_canary = privacy.spent_epsilon([(resolved.accounted_noise_multiplier, 1.0, 1)], resolved.delta)
    return OneRunAudit(site, "feedback", canaries, r, v, epsilon_lower_bound(canaries, r, v, resolved.delta),
                       per_canary, resolved.delta, known)


def audit_sgd_site(config: TrainingConfig, site: int, shard_size: int, canaries: int, guesses: int,
                   seed: int = 0) -> OneRunAudit:
    spec = config.privacy
    resolved = privacy.resolve(spec, shard_size, config.batch_size, config.iterations, config.disc_steps)
    secret, known = _site_secret(config, site)
    noise, sampling = secret.stream("dp-sgd/noise"), secret.stream("dp-sgd/sampling")
    draws = torch.Generator().manual_seed(derive_seed(seed, "one-run-audit", site))
    truth = torch.rand(canaries, generator=draws) < 0.5  # (m,)
    # the attacker's estimate of a secret noise: what the seed gave when the noise followed it (its best guess)
    seeded = torch.Generator().manual_seed(derive_seed(config.seed, "dp-noise", site))
    std = resolved.noise_multiplier * resolved.max_grad_norm
    scores = torch.zeros(canaries, dtype=torch.float64)
    for step in range(resolved.planned_steps):
        sampled = truth & (sampling.uniform(step, canaries) < resolved.sample_rate)  # (m,): in, and Poisson-sampled
        drawn = noise.normal(step, canaries, std)
        released = sampled.double() * resolved.max_grad_norm + drawn  # the canaries' coordinates of the noised sum
        estimate = drawn if known else torch.normal(0.0, std, size=(canaries,), generator=seeded).double()
        scores += released - estimate
    r, v = _guesses(scores, truth, guesses)
    per_canary = privacy.spent_epsilon([(resolved.noise_multiplier, resolved.sample_rate, resolved.planned_steps)],
                                       resolved.delta)
    return OneRunAudit(site, "sgd", canaries, r, v, epsilon_lower_bound(canaries, r, v, resolved.delta),
                       per_canary, resolved.delta, known)


def audit_server_view(config: TrainingConfig, shard_sizes: dict[int, int], canaries: int = 1000,
                      guesses: int = 200, seed: int = 0) -> list[OneRunAudit]:
    """Every private site's one-run audit as the server sees it: (slot -> shard size) of the run's sites."""
    from mdgan.config import ConfigError

    if not config.privacy.enabled:
        raise ConfigError("the run is not differentially private: there is no noise to audit")
    if not 2 <= guesses <= canaries:
        raise ConfigError(f"the guesses must be 2 to the canaries ({canaries}), got {guesses}")
    run = audit_feedback_site if config.privacy.mechanism == "feedback" else audit_sgd_site
    return [run(config, site, size, canaries, guesses, seed) for site, size in sorted(shard_sizes.items())]


def audit_run(run_dir: str, canaries: int = 1000, guesses: int = 200, seed: int = 0) -> dict:
    """The server's-view audit of a finished private run, from what the server stored (summary.json: its
    settings, seed and each site's size and spent epsilon): the report server_view.json holds."""
    from mdgan.config import ConfigError
    from mdgan.sampling import read_summary

    summary = read_summary(run_dir)
    try:
        config = TrainingConfig.from_dict(summary["config"])
    except (KeyError, TypeError, ValueError) as exc:
        raise ConfigError(f"{run_dir}/summary.json: not a run's config ({exc})") from None
    if not config.privacy.enabled:
        raise ConfigError(f"{run_dir} is not a differentially private run: the server's-view audit has no noise to "
                          f"test (run with {named('dp_noise_multiplier')} or {named('dp_target_epsilon')})")
    if config.privacy.fixed_noise is not None and (summary.get("privacy") or {}).get("noise") != "fixed":
        # the server was given a number its sites did not use (they report secret noise): nothing to take off
        config = dataclasses.replace(config, privacy=dataclasses.replace(config.privacy, fixed_noise=None))
    sizes = {int(worker.rsplit("-", 1)[1]): int(size) for worker, size in (summary.get("worker_sizes") or {}).items()}
    if not sizes:
        raise ConfigError(f"{run_dir}/summary.json records no site sizes (worker_sizes): nothing to audit")
    spent = ((summary.get("privacy") or {}).get("sites")) or {}
    sites = []
    for result in audit_server_view(config, sizes, canaries, guesses, seed):
        sites.append({**result.to_dict(), "worker": f"worker-{result.site}",
                      "run_epsilon": (spent.get(f"worker-{result.site}") or {}).get("epsilon")})
    return {"run": os.path.abspath(run_dir), "mechanism": config.privacy.mechanism,
            "noise": "fixed" if config.privacy.fixed_noise is not None else "secret", "sites": sites,
            "method": "one run, canaries through the site's mechanism (Steinke, Nasr and Jagielski 2023)"}


def table(report: dict) -> str:
    lines = [f"server's view of {report['run']} ({report['mechanism']}, {report['noise']} noise; "
             f"{report['method']}):",
             "site       canaries  guesses  right  epsilon >= (95%)  canary's epsilon  run's epsilon  noise known"]
    for s in report["sites"]:
        run_eps = "-" if s["run_epsilon"] is None else f"{s['run_epsilon']:.3f}"
        lines.append(f"{s['worker']:<10} {s['canaries']:>8}  {s['guesses']:>7}  {s['correct']:>5}  "
                     f"{s['epsilon_lower_bound']:>16.3f}  {s['canary_epsilon']:>16.3f}  {run_eps:>13}  "
                     f"{'yes' if s['noise_known'] else 'no'}")
    return "\n".join(lines)
