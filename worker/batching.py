"""Run many lines together on one pair: batched speculation across requests.

`run_lines` feeds requests to `engine.generate_many` lazily, so a row that frees
up takes the next line at once, and yields each line's outcome as it finishes.
Used by `spec-run` and by `spec-worker --batch N`; a line's output is the same as
when it runs alone (greedy exactly; seeded sampling by the same seed).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator

import engine
from producer.jobfile import JobLine
from producer.lines import effective_seed
from worker.execute import Outcome, outcome_of, to_request


def run_lines(
    pair, alias: str, batch_id: str, jobs: Iterable[JobLine], max_batch: int
) -> Iterator[tuple[JobLine, Outcome]]:
    """Yield (line, outcome) for every line, in the order they finish.

    Each outcome's busy time is the wall time since the previous line finished,
    so busy times add up to the time the batch took. Raises what the engine raises
    that is not a request error (the caller decides how to retry).
    """
    taken: list[tuple[JobLine, int | None]] = []

    def requests():
        for job in jobs:
            seed = effective_seed(batch_id, job)
            taken.append((job, seed))
            yield to_request(job, seed)

    last = time.perf_counter()
    for i, res in engine.generate_many(pair, requests(), max_batch=max_batch):
        job, seed = taken[i]
        now = time.perf_counter()
        busy_ms, last = int((now - last) * 1000), now
        yield job, outcome_of(alias, batch_id, job, seed, res, busy_ms)
