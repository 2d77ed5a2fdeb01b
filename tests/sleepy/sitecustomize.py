"""Test-only: make every decode step of this process wait SPEC_TEST_STEP_SLEEP_S seconds.

conftest.worker_env puts this folder on the PYTHONPATH of the spec-worker processes
that serve the slow pair, so their jobs outlast signals and heartbeat TTLs by waiting,
not by computing: on a 2-core machine a test that waits on a long job then leaves the
CPU to the tests beside it. Python imports `sitecustomize` at start-up; this one wraps
`step` of both decoders (engine/batch.py, engine/plain.py) when their modules load.
Nothing of the project imports it.

SPEC_TEST_HOLD names a file: while it exists, every decode step waits for it to go. A
test creates it once its workers are up and removes it when it is done looking, so a
job cannot finish early however slow the machine is (conftest.Hold).
"""

from __future__ import annotations

import functools
import importlib.abc
import os
import sys
import time

SLEEP_S = float(os.environ.get("SPEC_TEST_STEP_SLEEP_S") or 0)
HOLD = os.environ.get("SPEC_TEST_HOLD") or None
DECODERS = {"engine.batch": "BatchDecoder", "engine.plain": "PlainDecoder"}


def _slowed(step):
    @functools.wraps(step)
    def slow_step(self, *args, **kwargs):
        time.sleep(SLEEP_S)
        while HOLD is not None and os.path.exists(HOLD):
            time.sleep(0.02)
        return step(self, *args, **kwargs)

    return slow_step


class _SlowDecoders(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name not in DECODERS:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                break
        else:
            return None
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            cls = getattr(module, DECODERS[name])
            cls.step = _slowed(cls.step)

        spec.loader.exec_module = exec_module
        return spec


if SLEEP_S > 0:
    sys.meta_path.insert(0, _SlowDecoders())
