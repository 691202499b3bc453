"""Loaded by every Python process that bench/step_cpu.py starts (this folder is put first on
PYTHONPATH, with MDGAN_STEP_PROBE naming an output folder): wraps DiscriminatorSide.step to count
the thread CPU time of each D step past the first SKIP (and of the thread over the steps counted),
apart for steps that follow a wait of the process (at least WAIT_MS since its previous step ended)
and steps that follow another step directly. Each process rewrites its own JSON file in that
folder every 100 steps. Inert without MDGAN_STEP_PROBE."""

import os

if os.environ.get("MDGAN_STEP_PROBE"):
    import json
    import time

    from mdgan.gan import DiscriminatorSide

    OUT = os.environ["MDGAN_STEP_PROBE"]
    SKIP = 200  # warm-up steps not counted (bench/step_cpu.py prints it)
    WAIT_MS = 1.0
    _step = DiscriminatorSide.step
    # [steps, CPU ns]; and the thread's CPU clock when the first counted step began and the last ended
    counts = {"steps": 0, "after_wait": [0, 0], "back_to_back": [0, 0], "thread": [0, 0]}
    previous_end = [0.0]

    def step(self, batch):
        started_wall, started_cpu = time.perf_counter(), time.thread_time_ns()
        try:
            return _step(self, batch)
        finally:
            cpu = time.thread_time_ns() - started_cpu
            counts["steps"] += 1
            if counts["steps"] > SKIP:
                if not counts["thread"][0]:
                    counts["thread"][0] = started_cpu
                counts["thread"][1] = time.thread_time_ns()
                kind = "after_wait" if (started_wall - previous_end[0]) * 1000 >= WAIT_MS else "back_to_back"
                counts[kind][0] += 1
                counts[kind][1] += cpu
            previous_end[0] = time.perf_counter()
            if counts["steps"] % 100 == 0:
                path = os.path.join(OUT, f"{os.getpid()}.json")
                with open(path + ".tmp", "w") as fh:
                    json.dump(counts, fh)
                os.replace(path + ".tmp", path)

    DiscriminatorSide.step = step
