"""The roster (membership in the library) and the checkpoint store, without any transport."""

from __future__ import annotations

import asyncio
import errno
import json
import os

import pytest
import torch

from mdgan import checkpoint
from mdgan import run as run_module
from mdgan.checkpoint import CheckpointError, CheckpointStore
from mdgan.algorithms.mdgan.trainer import (COPY, SWAP, SwapOrder, SwapReport, Trainer, TrainerHooks, TrainerPlan,
                                           WorkerHandle)
from mdgan.algorithms.base import WorkerLost
from mdgan.config import DataConfig, TrainingConfig
from mdgan.roster import RejoinPlan, Roster, SlotRefused
from mdgan.run import EvaluationOptions, RunFinished
from mdgan.algorithms.mdgan.inprocess import parse_churn
from mdgan.simulation import Durability, Emulation, simulate


class Handle:
    def __init__(self, name: str):
        self.worker_id = name


def test_a_slot_belongs_to_the_first_identity_that_holds_it():
    roster = Roster(3)
    a = Handle("a")
    roster.arrive(1, "site-a", a)
    with pytest.raises(SlotRefused) as busy:
        roster.claim(1, "site-a")  # still connected
    assert busy.value.kind == "busy"
    assert roster.depart(a) and not roster.depart(a)
    with pytest.raises(SlotRefused) as other:
        roster.claim(1, "site-b")
    assert other.value.kind == "taken_by_other" and "site-a" in str(other.value)
    assert roster.claim(1, "site-a") == 1  # the same identity gets its slot back
    assert roster.claim(None, "site-a") == 1  # also when it does not say which
    assert roster.claim(None, "site-c") == 0  # a newcomer gets the lowest free slot
    with pytest.raises(SlotRefused, match="holds slot 1"):
        roster.claim(2, "site-a")  # one identity, one slot
    with pytest.raises(SlotRefused) as out:
        roster.claim(3, "site-d")
    assert out.value.kind == "out_of_range"


def test_membership_changes_only_at_iteration_boundaries_in_rank_order():
    roster = Roster(3)
    handles = [Handle(f"w{i}") for i in range(3)]
    roster.arrive(2, "w2", handles[2])
    roster.arrive(0, "w0", handles[0])
    boundary = roster.at_boundary(0)
    assert boundary.members == [handles[0], handles[2]] and boundary.newcomers == [handles[0], handles[2]]
    roster.arrive(1, "w1", handles[1])
    assert roster.members() == [handles[0], handles[2]]  # not before the next boundary
    boundary = roster.at_boundary(1)
    assert boundary.members == handles and boundary.newcomers == [handles[1]]
    roster.depart(handles[0])
    assert roster.members() == handles[1:]


def test_quorum_waits_and_times_out():
    roster = Roster(3, min_workers=2, pause_timeout=5)
    assert roster.start_quorum == 2 and roster.keep_quorum == 2

    async def scenario():
        assert not await roster.wait_for(2, 0.05)
        roster.arrive(0, "w0", Handle("w0"))
        later = asyncio.get_running_loop().call_later(0.05, roster.arrive, 1, "w1", Handle("w1"))
        ok = await roster.wait_for(2, 5)
        later.cancel()
        return ok

    assert asyncio.run(scenario())
    assert Roster(3).start_quorum == 3 and Roster(3).keep_quorum == 1
    with pytest.raises(ValueError):
        Roster(3, min_workers=4)


def test_rejoin_plans():
    roster = Roster(3)
    assert roster.rejoin_plan([50], 120) == RejoinPlan()  # a fresh run: everyone starts from the seed
    roster.load_state_dict({"bindings": {"0": "w0"}, "alive": [0, 1]}, iteration=100)
    assert roster.expected == {0, 1} and roster.start_quorum == 2
    assert roster.rejoin_plan([50, 100], 130) == RejoinPlan(restore=100)  # resume: the checkpoint's state
    assert roster.rejoin_plan([50], 130) == RejoinPlan(copy=True)  # not the checkpoint's: a copy
    roster.started = True
    roster.at_boundary(140)
    assert roster.rejoin_plan([50, 100], 130) == RejoinPlan()  # mid-run, back after a blip: keep its D
    assert roster.rejoin_plan([50, 100], 0) == RejoinPlan(restore=100)  # restarted: its newest state
    assert roster.rejoin_plan([], 0) == RejoinPlan(copy=True)  # nothing of its own: a peer's copy


class CopyPeer(WorkerHandle):
    """A worker as the copy to a late joiner sees it: a donor that gives (or is lost), a joiner that takes."""

    def __init__(self, index: int, lost: bool = False, needs_copy: bool = False, push_fails: bool = False):
        self.worker_id, self.shard_index, self.shard_size = f"worker-{index}", index, 100
        self.lost, self.needs_copy, self.push_fails = lost, needs_copy, push_fails
        self.orders: list[SwapOrder] = []
        self.cancels: list[tuple[int, str, str]] = []
        self.inbox: dict[int, asyncio.Future] = {}  # a joiner's: copy round -> who sent it (None: cancelled)
        self.peers: dict[str, "CopyPeer"] = {}

    def _box(self, swap_round: int) -> asyncio.Future:
        return self.inbox.setdefault(swap_round, asyncio.get_running_loop().create_future())

    async def swap(self, order: SwapOrder) -> SwapReport:
        self.orders.append(order)
        if self.lost:
            raise WorkerLost(f"{self.worker_id}: stream closed")
        if order.send_to and self.push_fails:  # alive, but its push did not get through
            return SwapReport(order.swap_round, False, False, 0, f"push to {order.send_to} failed: UNAVAILABLE")
        if order.send_to:  # the donor gives
            self.peers[order.send_to]._box(order.swap_round).set_result(self.worker_id)
            return SwapReport(order.swap_round, True, False, 1)
        sender = await self._box(order.swap_round)  # the joiner waits for it
        return SwapReport(order.swap_round, False, sender is not None, 0)

    async def cancel_swap(self, swap_round: int, sender: str, reason: str, kind: str = SWAP) -> None:
        self.cancels.append((swap_round, sender, kind))
        self._box(swap_round).set_result(None)

    async def step(self, iteration, batch):
        raise AssertionError("no step here")

    async def stop(self, reason: str) -> None:
        pass


def test_a_copy_tried_again_at_a_boundary_has_a_new_number_and_a_lost_donor_ends_the_joiners_wait():
    # The run stood at a boundary for good: the donor of a late joiner's copy died, the joiner waited
    # out the swap deadline (the run standing still), and every later try at that boundary had the same
    # number, which the joiner's mailbox refuses as too old.
    config = TrainingConfig(workers=3, batch_size=10).validate()
    lost, donor, joiner = CopyPeer(0, lost=True), CopyPeer(1), CopyPeer(2, needs_copy=True)
    lost.peers = donor.peers = {joiner.worker_id: joiner}
    trainer = Trainer(config, None, [lost, donor, joiner], plan=TrainerPlan(swap_timeout=3600))

    async def admit_twice():
        await asyncio.wait_for(trainer.membership.admit([joiner], 7), 30)  # not the hour of the swap deadline
        assert joiner.needs_copy  # no copy: it waits for the next try
        await asyncio.wait_for(trainer.membership.admit([joiner], 7), 30)  # the same boundary (nobody else could step)

    asyncio.run(admit_twice())
    assert [o.swap_round for o in joiner.orders] == [7, 8]  # a new number for the second try
    assert [o.receive_from for o in joiner.orders] == ["worker-0", "worker-1"]
    assert joiner.cancels == [(7, "worker-0", COPY)]  # told at once that its donor left
    assert not joiner.needs_copy and lost not in trainer.roster.members()
    assert [(o.swap_round, o.send_to, o.kind) for o in donor.orders] == [(8, "worker-2", COPY)]


def test_a_copy_whose_push_failed_ends_the_joiners_wait_and_the_donor_stays():
    config = TrainingConfig(workers=2, batch_size=10).validate()
    donor, joiner = CopyPeer(0, push_fails=True), CopyPeer(1, needs_copy=True)
    donor.peers = {joiner.worker_id: joiner}
    trainer = Trainer(config, None, [donor, joiner], plan=TrainerPlan(swap_timeout=3600))
    asyncio.run(asyncio.wait_for(trainer.membership.admit([joiner], 3), 30))  # not the hour of the swap deadline
    assert joiner.cancels == [(3, "worker-0", COPY)] and joiner.needs_copy
    assert donor in trainer.roster.members()  # alive: it may give the copy at the next boundary


class Listener(CopyPeer):
    def __init__(self, index: int):
        super().__init__(index)
        self.told: list[str] = []

    async def stop(self, reason: str) -> None:
        self.told.append(reason)

    async def checkpoint(self, iteration: int) -> None:
        return None  # saved


def test_the_end_is_saved_before_any_worker_hears_it_and_a_server_resumed_there_only_tells_who_comes_back():
    # A worker told the run is over forgets it and leaves: a server killed after telling them, before
    # its outputs, resumed from its last periodic checkpoint and waited (the join timeout) for workers
    # that would never come back.
    config = TrainingConfig(workers=2, batch_size=10, iterations=4).validate()
    saved, told_at_save = [], []
    workers = [Listener(0), Listener(1)]
    first = Trainer(config, None, workers,
                    plan=TrainerPlan(checkpoint_every=3),
                    hooks=TrainerHooks(save_checkpoint=lambda t, ok: (
        saved.append((t, ok)), told_at_save.append([list(w.told) for w in workers]))))
    first.iteration = lambda t: asyncio.sleep(0)  # the math is not what this is about
    asyncio.run(first.run())
    assert saved == [(3, True), (4, True)]  # the periodic one, then the end (not a multiple of 3)
    assert told_at_save[-1] == [[], []]  # saved before anyone was told
    assert [w.told for w in workers] == [["run finished"]] * 2

    # resumed from that end: one worker had heard it and left, the other comes back a moment later
    roster = Roster(2)
    resumed = Trainer(config, None, roster=roster,
                      plan=TrainerPlan(checkpoint_every=3),
                      hooks=TrainerHooks(save_checkpoint=lambda t, ok: None))
    resumed.load_state_dict(first.state_dict())
    assert resumed.finished and roster.expected == {0, 1}
    late = Listener(1)

    async def resume():
        asyncio.get_running_loop().call_later(0.2, roster.arrive, 1, late.worker_id, late)
        await asyncio.wait_for(resumed.wait_to_finish(1.0), 30)
        return await resumed.run()

    result = asyncio.run(resume())
    assert result.iterations == 4 and result.stopped_early is None
    assert late.told == ["run finished"] and result.alive == ["worker-1"]


class LostAtCheckpoint(Listener):
    async def checkpoint(self, iteration: int) -> None:
        raise WorkerLost(f"{self.worker_id}: stream closed")


def test_a_checkpoint_a_worker_was_lost_during_is_not_complete():
    # A SIGTERM to the whole cluster ends the workers as the server checkpoints at the boundary: the
    # checkpoint was counted complete without them, and resumed, every discriminator lost.
    config = TrainingConfig(workers=2, batch_size=10).validate()
    for workers in ([LostAtCheckpoint(0), LostAtCheckpoint(1)], [Listener(0), LostAtCheckpoint(1)]):
        saved = []
        trainer = Trainer(config, None, workers,
                          plan=TrainerPlan(checkpoint_every=5),
                          hooks=TrainerHooks(save_checkpoint=lambda t, ok: saved.append(ok)))
        assert asyncio.run(trainer.checkpoint(5)) is False and saved == [False]
        assert [w.worker_id for w in trainer.roster.members()] == [w.worker_id for w in workers
                                                                   if type(w) is Listener]  # the lost are dropped
    gone = [Listener(0), Listener(1)]  # every worker lost before the boundary: a checkpoint of nobody's state
    saved = []
    trainer = Trainer(config, None, gone,
                      plan=TrainerPlan(checkpoint_every=5),
                      hooks=TrainerHooks(save_checkpoint=lambda t, ok: saved.append(ok)))
    for worker in gone:
        trainer.roster.depart(worker)
    assert asyncio.run(trainer.checkpoint(5)) is False and saved == [False]


def test_checkpoints_are_counted_only_when_complete_and_the_last_k_are_kept(tmp_path):
    store = CheckpointStore(str(tmp_path), keep=2)
    for it in (10, 20, 30, 40):
        store.save(it, "server", {"iteration": it, "w": torch.full((3,), float(it))})
        if it != 40:
            store.mark_complete(it, {"run_id": "r"})
    assert store.latest_complete() == 30 and store.iterations() == [20, 30, 40]
    assert store.load(30, "server")["iteration"] == 30
    assert store.info(30)["run_id"] == "r"
    with pytest.raises(CheckpointError):
        store.load(10, "server")


def test_a_crash_mid_write_leaves_the_last_checkpoint_usable(tmp_path, monkeypatch):
    store = CheckpointStore(str(tmp_path), keep=3)
    store.save(10, "server", {"iteration": 10})
    store.mark_complete(10, {})

    def crash(*args, **kwargs):
        raise OSError("disk gone mid-write")

    # dies after writing the temporary file, before the rename: the old file stays whole
    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(OSError):
        store.save(10, "server", {"iteration": 999})
    with pytest.raises(OSError):
        store.save(20, "server", {"iteration": 20})
    monkeypatch.undo()
    assert store.latest_complete() == 10 and store.load(10, "server") == {"iteration": 10}
    assert not [f for _, _, files in os.walk(tmp_path) for f in files if f.endswith(".tmp")]
    # a file cut short (a crash of a writer that did not write atomically) is reported, never half-loaded
    with open(os.path.join(store.folder(10), "server.pt"), "r+b") as fh:
        fh.truncate(20)
    with pytest.raises(CheckpointError, match="unreadable"):
        store.load(10, "server")


class _DiskFullAfter:
    """A file that takes `room` bytes, then fails as a full disk does (ENOSPC)."""

    def __init__(self, fh, room: int):
        self.fh, self.room = fh, room

    def write(self, data) -> int:
        if len(data) > self.room:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        self.room -= len(data)
        return self.fh.write(data)

    def __getattr__(self, name):
        return getattr(self.fh, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.fh.close()


def test_a_full_disk_is_an_oserror_naming_the_file_and_the_last_checkpoint_stays(tmp_path, monkeypatch):
    # torch.save ends a write that failed in its own RuntimeError ("unexpected pos ..."); the worker
    # (which answers an OSError with "could not write state") died of it, the server with a traceback.
    store = CheckpointStore(str(tmp_path), keep=3)
    store.save(10, "server", {"weights": torch.zeros(1000)})
    store.mark_complete(10, {})
    real_fdopen = os.fdopen
    monkeypatch.setattr(os, "fdopen", lambda fd, mode: _DiskFullAfter(real_fdopen(fd, mode), room=1500))
    path = os.path.join(store.folder(20), "server.pt")
    with pytest.raises(OSError) as raised:
        store.save(20, "server", {"weights": torch.zeros(1000)})
    assert (raised.value.errno, raised.value.filename) == (errno.ENOSPC, path)
    assert "No space left on device" in str(raised.value) and path in str(raised.value)
    with pytest.raises(OSError, match="No space left on device.*history.jsonl"):  # a run's own files too
        run_module._append_line(_DiskFullAfter(open(tmp_path / "history.jsonl", "w"), room=0), "{}")
    monkeypatch.undo()
    assert not [f for _, _, files in os.walk(tmp_path) for f in files if f.endswith(".tmp")]
    assert store.latest_complete() == 10 and store.load(10, "server")["weights"].shape == (1000,)


def test_history_is_truncated_to_whole_lines_up_to_the_checkpoint(tmp_path):
    path = tmp_path / "history.jsonl"
    path.write_text("".join(json.dumps({"iteration": i}) + "\n" for i in range(1, 8)) + '{"iterat')
    assert checkpoint.truncate_jsonl(str(path), lambda r: r["iteration"] <= 5) == 5
    assert [json.loads(line)["iteration"] for line in path.read_text().splitlines()] == [1, 2, 3, 4, 5]


def test_simulate_resumes_bit_for_bit_and_replays_a_churn_schedule(tmp_path):
    config = TrainingConfig(workers=3, kappa=2, iterations=40, swap_every=7, batch_size=10).validate()
    data, quiet = DataConfig("synthetic"), EvaluationOptions(every=-1)
    out = str(tmp_path / "run")
    full = simulate(config, data, out, progress=False, evaluation=quiet, durability=Durability(checkpoint_every=10))
    store = CheckpointStore(os.path.join(out, "checkpoints"))
    assert store.complete() == [20, 30, 40]  # the last three: 40 is the run's end
    with pytest.raises(RunFinished, match="finished"):
        simulate(config, data, out, progress=False, evaluation=quiet, durability=Durability(resume="yes"))
    # as if the process died after the last iteration, before its outputs: nothing is trained again
    os.remove(os.path.join(out, "summary.json"))
    ended = simulate(config, data, out, progress=False, evaluation=quiet,
                     durability=Durability(checkpoint_every=10, resume="yes"))
    assert ended["resumed_from"] == 40 and ended["iterations"] == 40
    assert ended["generator_sha256"] == full["generator_sha256"]
    # as if the process died before checkpoint 30 completed (and so before the end)
    for iteration in (30, 40):
        for name in os.listdir(store.folder(iteration)):
            os.remove(os.path.join(store.folder(iteration), name))
    os.remove(os.path.join(out, "summary.json"))
    resumed = simulate(config, data, out, progress=False, evaluation=quiet,
                       durability=Durability(checkpoint_every=10, resume="yes"))
    assert resumed["resumed_from"] == 20 and resumed["run_id"] == full["run_id"]
    assert resumed["generator_sha256"] == full["generator_sha256"]
    with open(os.path.join(out, "history.jsonl")) as fh:
        history = [json.loads(line) for line in fh]
    assert [row["iteration"] for row in history] == list(range(1, 41))
    # the wall time is the whole run's, before the resume too (it was the resumed part's alone, so a
    # 50,000-iteration run resumed near its end reported a fraction of its time per iteration)
    assert resumed["wall_seconds"] >= sum(row["seconds"] for row in history)

    churn = simulate(config, data, str(tmp_path / "churn"), progress=False, evaluation=quiet,
                     emulation=Emulation(churn=parse_churn("leave:12:2,join:20:2")))
    with open(tmp_path / "churn" / "history.jsonl") as fh:
        active = [json.loads(line)["active_workers"] for line in fh]
    assert active == [3] * 12 + [2] * 8 + [3] * 20 and churn["workers_alive"] == 3
    with open(tmp_path / "churn" / "swaps.jsonl") as fh:
        copies = [r for r in map(json.loads, fh) if r.get("kind") == "copy"]
    assert copies == [{"kind": "copy", "iteration": 20, "from": "worker-0", "to": "worker-2", "received": True}]
    with pytest.raises(CheckpointError):
        simulate(config, data, str(tmp_path / "nothing"), progress=False, evaluation=quiet,
                 durability=Durability(resume="yes"))


def test_a_crash_run_is_the_same_wherever_its_checkpoints_fall_and_resumes_from_a_crash_bit_for_bit(tmp_path):
    # The paper's crash experiment: a worker fails after iterations 10, 20, 30 and 40. It leaves the
    # roster at once, so a checkpoint at a crash iteration is complete and the next iteration's
    # batches do not depend on whether one was taken.
    config = TrainingConfig(workers=4, kappa=2, iterations=40, swap_every=7, batch_size=10).validate()
    data, quiet = DataConfig("synthetic"), EvaluationOptions(every=-1)
    plain = simulate(config, data, str(tmp_path / "plain"), progress=False, evaluation=quiet,
                     emulation=Emulation(crash_every=10))
    odd = simulate(config, data, str(tmp_path / "odd"), progress=False, evaluation=quiet,
                   emulation=Emulation(crash_every=10), durability=Durability(checkpoint_every=7))
    out = str(tmp_path / "run")
    full = simulate(config, data, out, progress=False, evaluation=quiet, emulation=Emulation(crash_every=10),
                    durability=Durability(checkpoint_every=10))
    assert plain["generator_sha256"] == odd["generator_sha256"] == full["generator_sha256"]
    assert full["workers_alive"] == 0
    store = CheckpointStore(os.path.join(out, "checkpoints"))
    assert store.complete() == [20, 30, 40]
    # as if the process died right after the crash at 20 had been checkpointed
    for iteration in (30, 40):
        for name in os.listdir(store.folder(iteration)):
            os.remove(os.path.join(store.folder(iteration), name))
    os.remove(os.path.join(out, "summary.json"))
    resumed = simulate(config, data, out, progress=False, evaluation=quiet, emulation=Emulation(crash_every=10),
                       durability=Durability(checkpoint_every=10, resume="yes"))
    assert resumed["resumed_from"] == 20 and resumed["generator_sha256"] == full["generator_sha256"]
    with open(os.path.join(out, "history.jsonl")) as fh:
        active = [json.loads(line)["active_workers"] for line in fh]
    assert active == [4] * 10 + [3] * 10 + [2] * 10 + [1] * 10


def test_a_stop_request_checkpoints_at_the_next_boundary_and_below_min_workers_training_pauses(tmp_path):
    from mdgan.algorithms.mdgan.trainer import Trainer, TrainerHooks, TrainerPlan
    from mdgan.algorithms.mdgan.inprocess import build_in_process_workers
    from mdgan.data import load_all_shards
    from mdgan.gan import GeneratorSide

    config = TrainingConfig(workers=3, iterations=30, batch_size=10, swap_every=4).validate()
    shards = load_all_shards(DataConfig("synthetic", num_shards=3))
    workers = build_in_process_workers(config, shards, str(tmp_path / "state"))
    saved = []
    trainer = Trainer(config, GeneratorSide(config), workers,
                      plan=TrainerPlan(checkpoint_every=10),
                      hooks=TrainerHooks(save_checkpoint=lambda t, ok: saved.append((t, ok))))

    def on_iteration(record):
        if record.iteration == 13:
            trainer.stop_requested = True  # what SIGTERM does in mdgan-server

    trainer.on_iteration = on_iteration
    result = asyncio.run(trainer.run())
    assert saved == [(10, True), (13, True)] and result.iterations == 13 and "signal" in result.stopped_early
    assert CheckpointStore(str(tmp_path / "state" / "worker-2")).holding("worker") == [10, 13]

    # --min-workers 3: one worker crashes, nobody comes back within the pause timeout: the run stops
    workers = build_in_process_workers(config, shards)
    roster = Roster(3, min_workers=3, pause_timeout=0.2)
    for w in workers:
        roster.arrive(w.shard_index, w.worker_id, w)
    trainer = Trainer(config, GeneratorSide(config), roster=roster)
    trainer.on_iteration = lambda r: workers[1].crash() if r.iteration == 5 else None
    result = asyncio.run(trainer.run())
    assert result.iterations == 6 and "fewer than --min-workers 3" in result.stopped_early


def test_a_wait_for_workers_says_how_many_are_in(caplog, monkeypatch):
    monkeypatch.setattr(Roster, "report_every", 0.02)
    roster = Roster(3)

    async def scenario():
        roster.arrive(0, "w0", Handle("w0"))
        return await roster.wait_for(3, 0.2)

    with caplog.at_level("INFO", logger="mdgan.roster"):
        assert not asyncio.run(scenario())
    lines = [r.getMessage() for r in caplog.records if r.name == "mdgan.roster"]
    assert lines and all(line.startswith("waiting for workers: 1 of 3 in, ") for line in lines), lines
    assert len(lines) >= 3  # every report_every seconds, not once


def test_a_checkpoint_names_no_class_of_ours_so_moving_the_code_cannot_break_resuming(tmp_path):
    """Checkpoints hold tensors, dicts, numbers and strings only (read back with weights_only=True): no
    module path of this project is in their pickles, so a checkpoint written before the library's
    modules moved (mdgan.cluster -> mdgan.algorithms.mdgan, ...) loads and resumes after it."""
    import glob
    import pickletools
    import zipfile

    from mdgan.config import DataConfig, ModelSpec, TrainingConfig
    from mdgan.run import EvaluationOptions
    from mdgan.simulation import Durability, simulate

    config = TrainingConfig(workers=2, iterations=4, batch_size=4, swap_every=2, model=ModelSpec()).validate()
    simulate(config, DataConfig("synthetic"), str(tmp_path), progress=False, evaluation=EvaluationOptions(every=-1),
             durability=Durability(checkpoint_every=2))
    files = glob.glob(str(tmp_path / "**" / "*.pt"), recursive=True)
    assert any("/checkpoints/" in f for f in files) and any("/workers/" in f for f in files)
    for path in files:
        with zipfile.ZipFile(path) as archive:
            pickle_name = next(n for n in archive.namelist() if n.endswith("data.pkl"))
            globals_named = {str(arg) for op, arg, _ in pickletools.genops(archive.read(pickle_name))
                             if op.name in ("GLOBAL", "STACK_GLOBAL", "SHORT_BINUNICODE", "BINUNICODE")
                             and arg is not None}
        ours = sorted(g for g in globals_named if g.split(".")[0].split(" ")[0] in ("mdgan", "mdgan_app", "services"))
        assert ours == [], (path, ours)
