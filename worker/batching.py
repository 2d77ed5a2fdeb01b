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
from engine.sampling import SamplingParams
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

    A line of n choices takes n rows, each choice its own engine request
    (engine.choice_requests: choice i's seed derived from the line's), and is yielded
    once, when its last choice finishes; a greedy line's choices are one decoding,
    run once. A choice the engine refuses fails its line at once (its other choices
    leave the batch). Each outcome's busy time is the wall time since the previous
    line finished, so busy times add up to the time the batch took. A line for which
    `expired(line)` turns true is dropped and yielded with a RequestExpired.
    Raises what the engine raises that is not a request error.
    """
    rows: list[_Line] = []  # engine request index -> its line

    def requests():
        for batch_id, job in lines:
            seed = effective_seed(batch_id, job)
            request = to_request(job, seed)
            line = _Line(batch_id, job, seed, request.n)
            choices = engine.choice_requests(request)
            if line.repeat:
                choices = choices[:1]
            for choice, row in enumerate(choices):
                if line.done:  # refused by the engine: its other choices never start
                    break
                rows.append(line)
                line.index[len(rows) - 1] = choice
                yield row

    def expired_row(i: int) -> bool:
        line = rows[i]
        return line.done or (expired is not None and expired(line.job))

    results = engine.generate_many(pair, requests(), max_batch=max_batch, expired=expired_row)
    last = time.perf_counter()
    for i, res in results:
        line = rows[i]
        if line.done:
            continue  # a choice of a line already yielded
        if isinstance(res, engine.RequestExpired):
            line.done = True
            yield line.job, res
            continue
        if isinstance(res, engine.EngineError):
            line.done = True
            finished: object = res
        else:
            line.results[line.index[i]] = res
            if len(line.results) < line.rows:
                continue
            line.done = True
            finished = line.choices()
        now = time.perf_counter()
        busy_ms, last = int((now - last) * 1000), now
        yield (
            line.job,
            outcome_of(
                alias,
                line.batch_id,
                line.job,
                line.seed,
                finished,
                busy_ms,
                pair=pair,
                worker=worker,
                auditor=auditor,
            ),
        )


class _Line:
    """One line in the batch: its rows' results by choice index, until all are in."""

    def __init__(self, batch_id: str, job: JobLine, seed: int | None, n: int):
        self.batch_id, self.job, self.seed, self.n = batch_id, job, seed, n
        #: A greedy line's choices are all the same: decoded once, repeated.
        self.repeat = n > 1 and SamplingParams(job.params["temperature"]).greedy
        self.rows = 1 if self.repeat else n
        self.index: dict[int, int] = {}  # engine request index -> choice index
        self.results: dict[int, engine.GenerationResult] = {}
        self.done = False

    def choices(self) -> list:
        if self.repeat:
            return [self.results[0]] * self.n  # outcome_of gives each copy the stats
        return [self.results[i] for i in range(self.n)]
