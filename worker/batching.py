"""Run many lines together on one pair: batched speculation across requests.

`decode_together` feeds lines to `engine.generate_many` lazily, so a row that frees up
takes the next line at once, and yields each line's outcome as it finishes.
Used by `spec-run` and by `spec-worker --batch N`; a line's output is the same as
when it runs alone (greedy exactly; seeded sampling by the same seed).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator

import engine
from jobstore.jobfile import JobLine
from jobstore.lines import effective_seed
from worker.audit import Auditor
from worker.execute import Outcome, outcome_of, to_request


def decode_together(
    pair,
    alias: str,
    lines: Iterable[tuple[str, JobLine]],
    max_batch: int,
    expired: Callable[[JobLine], bool] | None = None,
    worker: str | None = None,
    auditor: Auditor | None = None,
) -> Iterator[tuple[JobLine, Outcome | engine.RequestExpired]]:
    """Yield (line, outcome) for every (batch id, line), in the order they finish
    (`auditor`: audit mode, or None).

    Each outcome's busy time is the wall time since the previous line finished,
    so busy times add up to the time the batch took. A line for which
    `expired(line)` turns true is dropped and yielded with a RequestExpired.
    Raises what the engine raises that is not a request error.
    """
    taken: list[tuple[str, JobLine, int | None]] = []

    def requests():
        for batch_id, job in lines:
            seed = effective_seed(batch_id, job)
            taken.append((batch_id, job, seed))
            yield to_request(job, seed)

    def expired_row(i: int) -> bool:
        return expired(taken[i][1])

    rows = engine.generate_many(
        pair, requests(), max_batch=max_batch, expired=expired_row if expired else None
    )
    last = time.perf_counter()
    for i, res in rows:
        batch_id, job, seed = taken[i]
        if isinstance(res, engine.RequestExpired):
            yield job, res
            continue
        now = time.perf_counter()
        busy_ms, last = int((now - last) * 1000), now
        yield (
            job,
            outcome_of(
                alias, batch_id, job, seed, res, busy_ms, pair=pair, worker=worker, auditor=auditor
            ),
        )
