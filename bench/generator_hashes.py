"""Each algorithm's generator after a small run, in one process (`mdgan simulate`) and, for those the
services run, over them (`mdgan local`): the hashes a refactoring must leave as they were. Run it from
two checkouts (the command's working directory is the checkout it runs) and compare the JSON.

    python bench/generator_hashes.py > after.json
    (cd ../before && python /path/to/bench/generator_hashes.py) > before.json && diff before.json after.json
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

ALGORITHMS = ("mdgan", "flgan", "standalone", "pwgan", "psgan")
FLAGS = ["--workers", "3", "--kappa", "2", "--iterations", "12", "--batch-size", "8", "--swap-every", "4",
         "--dataset", "synthetic", "--eval-every", "-1", "--seed", "3", "--no-progress"]


def generator_sha(command: str, algorithm: str, out: str, names: dict) -> str | None:
    name = names.get(algorithm, algorithm)
    done = subprocess.run([sys.executable, "-m", "mdgan_app.cli", command, "--algorithm", name, *FLAGS,
                           *(["--insecure"] if command == "local" else []), "--out", out],
                          capture_output=True, text=True, cwd=os.getcwd())
    if done.returncode != 0:
        return f"failed: {done.stderr.strip().splitlines()[-1] if done.stderr.strip() else done.returncode}"
    with open(os.path.join(out, "summary.json")) as fh:
        return json.load(fh)["generator_sha256"]


def main() -> int:
    # a checkout from before the rename knows the parameter-server GAN as dpgan
    known = subprocess.run([sys.executable, "-c", "from mdgan.algorithms import NAMES; print(' '.join(NAMES))"],
                           capture_output=True, text=True, cwd=os.getcwd()).stdout.split()
    names = {"psgan": "dpgan"} if "dpgan" in known else {}
    hashes = {}
    with tempfile.TemporaryDirectory() as tmp:
        for algorithm in ALGORITHMS:
            hashes[algorithm] = {"simulate": generator_sha("simulate", algorithm, os.path.join(tmp, algorithm), names)}
            if algorithm != "standalone":
                hashes[algorithm]["local"] = generator_sha("local", algorithm, os.path.join(tmp, f"{algorithm}-l"),
                                                           names)
    print(json.dumps(hashes, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
