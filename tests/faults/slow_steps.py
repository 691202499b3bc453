"""A step that holds the worker's thread (its event loop included) for MDGAN_TEST_SLOW_STEP seconds, as a long
computation on a slow CPU does, for tests (installed with MDGAN_TEST_FAULT's "wrap")."""

from __future__ import annotations

import functools
import os
import time


def blocking(original):
    seconds = float(os.environ.get("MDGAN_TEST_SLOW_STEP") or 0)

    @functools.wraps(original)
    def slow(*args, **kwargs):
        time.sleep(seconds)  # (not asyncio's: nothing else of the worker runs meanwhile)
        return original(*args, **kwargs)

    return slow
