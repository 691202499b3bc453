"""A site's privacy ledger: every DP step or answer the site takes in a run, counted and written (atomically, fsynced)
before its result can leave the site, and the secret the site's noise comes from (mdgan/secret_noise.py).

It belongs to the site, not to the run: it lives in the site's own folder (`mdgan-worker --privacy-dir`, by
default its --state-dir; `mdgan simulate`'s sites in RUN/sites/worker-K), apart from the run's checkpoints, and
it only ever grows. A site that crashes, rejoins, is restarted without its checkpoints, or resumes from an older
checkpoint goes on counting from it, so the epsilon it reports covers every step it ever released, and its noise
goes on from draws it never used. Nothing in it travels: no message, log, summary.json or server file holds the
secret.

    folder/privacy/RUN_ID/site-K.json   {"run_id", "site", "mechanism", "secret", "fixed_noise",
                                         "steps": [[sigma, q, count], ...]  (DP-SGD: the accountant's history),
                                         "answers": [count per part]       (private feedback)}
"""

from __future__ import annotations

import os
import re

from mdgan import checkpoint
from mdgan.checkpoint import CheckpointError
from mdgan.secret_noise import KEY_BYTES, SiteSecret

LEDGER_VERSION = 1
_RUN_ID = re.compile(r"^[A-Za-z0-9._-]{1,128}$")


class LedgerError(CheckpointError):
    """A ledger that cannot be read or does not belong to this site and run: the site cannot know what it spent."""


def ledger_path(folder: str, run_id: str, site: int) -> str:
    if not _RUN_ID.match(run_id or "") or set(run_id) == {"."}:
        raise LedgerError(f"run id {run_id!r} cannot name a privacy ledger")
    return os.path.join(folder, "privacy", run_id, f"site-{int(site)}.json")


class PrivacyLedger:
    """One site's count of what it released in one run, and its secret. `path` None: kept in memory only (a
    library user's own loop, a test); every run of the project's keeps it in a file."""

    def __init__(self, path: str | None, run_id: str, site: int, mechanism: str, secret: SiteSecret,
                 parts: int = 1, steps: list | None = None, answers: list[int] | None = None):
        self.path = path
        self.run_id = run_id
        self.site = int(site)
        self.mechanism = mechanism
        self.secret = secret
        self.steps: list[list] = [list(s) for s in (steps or [])]  # DP-SGD: [[sigma, q, count], ...]
        self.answers: list[int] = list(answers) if answers is not None else [0] * parts  # feedback: per part

    # -- opening ---------------------------------------------------------------------------------
    @classmethod
    def open(cls, folder: str | None, run_id: str, site: int, mechanism: str, parts: int = 1,
             fixed_noise: int | None = None) -> "PrivacyLedger":
        """The site's ledger of this run: read back if the site has one (a restart, a rejoin, a resume), else
        a new one with a new secret (or the one `fixed_noise` makes), written before anything is drawn."""
        wanted = SiteSecret.from_fixed(fixed_noise, site) if fixed_noise is not None else None
        if folder is None:
            return cls(None, run_id, site, mechanism, wanted or SiteSecret.new(), parts)
        path = ledger_path(folder, run_id, site)
        if not os.path.exists(path):
            ledger = cls(path, run_id, site, mechanism, wanted or SiteSecret.new(), parts)
            ledger.commit()
            return ledger
        ledger = cls._read(path)
        if (ledger.run_id, ledger.site, ledger.mechanism) != (run_id, int(site), mechanism):
            raise LedgerError(f"{path} is the ledger of run {ledger.run_id!r}, site {ledger.site}, mechanism "
                              f"{ledger.mechanism}, not of run {run_id!r}, site {site}, mechanism {mechanism}")
        if mechanism == "feedback" and len(ledger.answers) != parts:
            raise LedgerError(f"{path} counts {len(ledger.answers)} discriminators, this site has {parts}")
        if (wanted is not None) != ledger.secret.fixed or (wanted is not None and wanted.key != ledger.secret.key):
            said = "with" if ledger.secret.fixed else "without"
            raise LedgerError(f"{path}: this site began run {run_id!r} {said} that --dp-fixed-noise; its noise must "
                              "go on as it began (give the same setting, or start a new run)")
        return ledger

    @classmethod
    def _read(cls, path: str) -> "PrivacyLedger":
        try:
            saved = checkpoint.read_json(path)
            secret = bytes.fromhex(saved["secret"])
            if saved.get("version") != LEDGER_VERSION or len(secret) != KEY_BYTES:
                raise ValueError("not a privacy ledger of this version")
            steps = [[float(sigma), float(q), int(count)] for sigma, q, count in saved["steps"]]
            answers = [int(n) for n in saved["answers"]]
            if any(s[2] < 0 for s in steps) or any(n < 0 for n in answers):
                raise ValueError("a negative count")
            return cls(path, str(saved["run_id"]), int(saved["site"]), str(saved["mechanism"]),
                       SiteSecret(secret, bool(saved["fixed_noise"])), steps=steps, answers=answers)
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise LedgerError(f"the privacy ledger {path} is unreadable ({type(exc).__name__}: {exc}); this site "
                              "cannot know what it has spent: restore the file, or start a new run") from None

    # -- counting --------------------------------------------------------------------------------
    @property
    def steps_taken(self) -> int:
        """DP-SGD steps counted: the index of the next step's noise and sampling draws."""
        return sum(count for _, _, count in self.steps)

    @property
    def answers_given(self) -> int:
        """Private-feedback answers counted (all parts): the index of the next answer's noise draw."""
        return sum(self.answers)

    def count_step(self, noise_multiplier: float, sample_rate: float) -> None:
        """One DP-SGD step at (sigma, q), written before its result can leave."""
        if self.steps and self.steps[-1][0] == noise_multiplier and self.steps[-1][1] == sample_rate:
            self.steps[-1][2] += 1
        else:
            self.steps.append([float(noise_multiplier), float(sample_rate), 1])
        self.commit()

    def count_answer(self, part: int) -> None:
        """One private-feedback answer of part `part`, written before it can leave."""
        self.answers[part] += 1
        self.commit()

    def history(self) -> list[tuple[float, float, int]]:
        """DP-SGD's (sigma, q, steps) history, as Opacus's RDPAccountant keeps it."""
        return [(sigma, q, count) for sigma, q, count in self.steps]

    def commit(self) -> None:
        if self.path is None:
            return
        checkpoint.atomic_write_json(self.path, {
            "version": LEDGER_VERSION, "run_id": self.run_id, "site": self.site, "mechanism": self.mechanism,
            "fixed_noise": self.secret.fixed, "secret": self.secret.key.hex(), "steps": self.steps,
            "answers": self.answers})


def site_ledger(spec, site: int, sites_root: str | None, run_id: str) -> PrivacyLedger | None:
    """An in-process site's ledger for a run with DP settings `spec` (a PrivacySpec): in its own folder
    sites_root/worker-K (read back if it has one: a rejoin, a resume), or in memory without a sites_root; None
    without DP."""
    if not spec.enabled:
        return None
    folder = os.path.join(sites_root, f"worker-{site}") if sites_root else None
    return PrivacyLedger.open(folder, run_id, site, spec.mechanism, spec.discriminators, spec.fixed_noise)


def adopt_old_accountant(ledger: PrivacyLedger, saved: dict) -> None:
    """A checkpoint written before sites kept ledgers held the accountant itself: a new ledger starts from what it
    counted, so a resumed old run undercounts nothing. A ledger that already counts steps is never wound back."""
    if ledger.steps_taken or ledger.answers_given:
        return
    if isinstance(saved.get("accountant"), list) and saved["accountant"]:  # DP-SGD: [(sigma, q, steps), ...]
        ledger.steps = [[float(sigma), float(q), int(count)] for sigma, q, count in saved["accountant"]]
        ledger.commit()
    elif isinstance(saved.get("answers"), list) and len(saved["answers"]) == len(ledger.answers):  # private feedback
        ledger.answers = [int(n) for n in saved["answers"]]
        ledger.commit()
