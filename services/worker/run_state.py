"""What a worker keeps of its run on its own disk: the run it is in (STATE/current.json, so that a
restart rejoins it in the same slot), its checkpoints (STATE/RUN), the discriminator it holds at a
finished run's end (STATE/finished/RUN, for the site's own audit) and its privacy ledgers."""

from __future__ import annotations

import logging
import os
import shutil
from dataclasses import dataclass

from mdgan import checkpoint
from mdgan.checkpoint import CheckpointError, CheckpointStore
from mdgan.config import TrainingConfig
from mdgan.privacy_ledger import LedgerError, PrivacyLedger
from services.worker.algorithms.base import ServerGone

log = logging.getLogger("mdgan.worker")


@dataclass(frozen=True)
class WorkerState:
    """Durable runs: where the worker keeps its state, how many checkpoints, and the run it is pinned to."""

    state_dir: str | None = None
    keep_checkpoints: int = 3
    run_id: str | None = None  # --run-id: join that run only


class RunState:
    """The run this worker is in and what it keeps of it. run_id: the run's (None: none yet); pinned_run: the
    only run it joins (--run-id); shard_index: its slot, once the server named it. privacy_dir, fixed_noise: the
    site's ledger folder (None: the state dir) and its --dp-fixed-noise."""

    def __init__(self, state: WorkerState, privacy_dir: str | None = None, fixed_noise: int | None = None):
        self.state_dir = state.state_dir
        self.keep_checkpoints = state.keep_checkpoints
        self.pinned_run = state.run_id
        self.privacy_dir = privacy_dir
        self.fixed_noise = fixed_noise
        self.shard_index: int | None = None
        self.run_id = state.run_id or self.saved_run().get("run_id")

    def saved_run(self) -> dict:
        """What the state dir says about the run this worker was last in ({} if nothing)."""
        if not self.state_dir:
            return {}
        try:
            saved = checkpoint.read_json(os.path.join(self.state_dir, "current.json"))
            return {} if saved.get("finished") else saved
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as exc:
            raise CheckpointError(f"{self.state_dir}/current.json is unreadable: {exc}") from exc

    def forget(self) -> None:
        """The run is over: its states are of no more use, and the next run may take this worker."""
        if not (self.state_dir and self.run_id):
            return
        # (no slot yet: a restarted worker the server assigns its shard, refused before its welcome)
        index = self.shard_index if self.shard_index is not None else self.saved_run().get("shard_index")
        checkpoint.atomic_write_json(os.path.join(self.state_dir, "current.json"),
                                     {"run_id": self.run_id, "shard_index": index, "finished": True})
        shutil.rmtree(os.path.join(self.state_dir, self.run_id), ignore_errors=True)

    def leave(self) -> None:
        """Out of an ended run: the next welcome is a newcomer's."""
        self.forget()
        self.run_id = None

    def remember(self) -> None:
        """Record in the state dir the run this worker is in, and its slot (a restart comes back to it)."""
        if self.state_dir and self.run_id:
            checkpoint.atomic_write_json(os.path.join(self.state_dir, "current.json"),
                                         {"run_id": self.run_id, "shard_index": self.shard_index})

    def keep_final_discriminator(self, state: dict | None, worker_id: str, algorithm: str) -> None:
        """The run finished: the discriminator this site holds at its end goes to
        STATE/finished/RUN/discriminator.pt (the newest few runs' kept), for the site's own audit
        (`mdgan audit --site-data`). Nothing leaves the site."""
        if not (self.state_dir and self.run_id) or state is None:
            return
        kept = os.path.join(self.state_dir, checkpoint.FINISHED_DIR)
        try:
            checkpoint.atomic_save({"discriminator": state, "run_id": self.run_id, "worker_id": worker_id,
                                    "algorithm": algorithm},
                                   os.path.join(kept, self.run_id, checkpoint.FINAL_DISCRIMINATOR_FILE))
            runs = sorted(os.scandir(kept), key=lambda e: e.stat().st_mtime)
            for old in runs[:-checkpoint.FINISHED_KEPT]:
                shutil.rmtree(old.path, ignore_errors=True)
        except OSError as exc:  # (a full disk): the run is done all the same
            log.warning("could not keep the final discriminator in %s: %s", kept, exc)

    def privacy_ledger(self, config: TrainingConfig) -> PrivacyLedger | None:
        """This site's privacy ledger for the run it is in (mdgan/privacy_ledger.py), read back if it has one;
        None in a run without DP. A private run needs a folder for it: the site cannot count what it spends
        otherwise."""
        if not config.privacy.enabled:
            return None
        folder = self.privacy_dir or self.state_dir
        if not folder:
            raise ServerGone("this run is differentially private and this site has no folder for its privacy "
                             "ledger, which counts every step it releases: give --privacy-dir DIR (or --state-dir)")
        try:
            ledger = PrivacyLedger.open(folder, self.run_id or "unnamed-run", self.shard_index,
                                        config.privacy.mechanism, config.privacy.discriminators, self.fixed_noise)
        except (LedgerError, OSError) as exc:  # (a site's own problem: it leaves, saying why, exit 2)
            raise ServerGone(f"cannot keep this site's privacy ledger: {exc}") from None
        log.info("privacy ledger %s: %s noise, %d steps and %d answers counted before", ledger.path,
                 "FIXED (--dp-fixed-noise: no guarantee against whoever knows it)" if ledger.secret.fixed
                 else "secret", ledger.steps_taken, ledger.answers_given)
        return ledger

    def store(self) -> CheckpointStore | None:
        """Where this worker keeps its states for the run it is in; None: it keeps none."""
        if not (self.state_dir and self.run_id):
            return None
        return CheckpointStore(os.path.join(self.state_dir, self.run_id), self.keep_checkpoints)

    def held(self) -> list[int]:
        """The iterations this worker holds a state of, for the run it is in."""
        store = self.store()
        return store.holding("worker") if store else []
