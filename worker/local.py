"""`spec-run`: the worker without a queue. Same validation, engine and lines, no Redis.

Lines run together in batches (batched speculation across requests: `max_batch`
rows at a time, a window of lines ahead) and are written in input order as soon as
every earlier line is done (results to the output file; error lines to the errors
file, or also to the output when none is given), so a long run can be watched and
a killed run keeps what it did.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import engine
from jobstore.jobfile import JobLine, LineError, Verdict, validate_lines
from jobstore.lines import dumps, error_line
from worker.batching import decode_together
from worker.execute import Outcome, execute, failure, to_request

log = logging.getLogger("specfleet.run")

#: Rows decoded together by default, and how many lines per row are read ahead.
DEFAULT_BATCH = 16
WINDOW_PER_ROW = 4


@dataclass
class RunSummary:
    lines: int = 0
    completed: int = 0
    failed: int = 0
    invalid: int = 0
    completion_tokens: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens the prefix cache gave
    seconds: float = 0.0
    stats: engine.SpecStats = field(default_factory=engine.SpecStats)


def context_check(pair, alias: str) -> Callable[[JobLine], LineError | None]:
    """The exact prompt-versus-context check, with the loaded target's tokenizer."""

    def check(job: JobLine) -> LineError | None:
        try:
            n = engine.count_prompt_tokens(pair, to_request(job, None))
        except engine.EngineError:
            return None  # reported when the line runs
        if n + job.params["max_tokens"] > pair.context_length:
            return LineError(
                job.line,
                job.prefix + job.prompt_field,
                f"too long for model {alias}: {n} prompt tokens + max_tokens "
                f"{job.params['max_tokens']} > context {pair.context_length} tokens",
                job.custom_id,
            )
        return None

    return check


def run_file(
    pair,
    alias: str,
    path: str,
    batch_id: str,
    out,
    errors_out,
    model_override: str | None = None,
    progress: Callable[[str], None] = lambda s: print(s, file=sys.stderr),
    max_batch: int = DEFAULT_BATCH,
    on_summary: Callable[[RunSummary], None] | None = None,
) -> RunSummary:
    """Run every line of an already validated file; invalid lines become error lines.

    `out` and `errors_out` are binary files (they may be the same file).
    """
    summary = RunSummary()
    started = time.perf_counter()
    check = context_check(pair, alias)
    window: list[Verdict] = []

    def write_invalid(verdict: Verdict) -> None:
        line = error_line(
            batch_id, verdict.line, verdict.custom_id, "invalid_request", verdict.message()
        )
        errors_out.write((dumps(line) + "\n").encode())
        summary.invalid += 1
        summary.failed += 1
        summary.lines += 1

    def run_window() -> None:
        runnable = [v.job for v in window if v.job is not None and _serves(v.job, alias)]
        outcomes = dict(_run_many(pair, alias, batch_id, runnable, max_batch))
        for verdict in window:
            entry = verdict.job
            if entry is None:
                write_invalid(verdict)
                continue
            outcome = outcomes.get(entry.line) or _not_served(alias, batch_id, entry)
            summary.lines += 1
            (out if outcome.ok else errors_out).write((dumps(outcome.line) + "\n").encode())
            out.flush()
            if outcome.ok:
                summary.completed += 1
                summary.completion_tokens += outcome.completion_tokens
                usage = outcome.line["response"]["body"]["usage"]
                summary.prompt_tokens += usage["prompt_tokens"]
                summary.cached_tokens += usage["prompt_tokens_details"]["cached_tokens"]
                summary.stats.merge(outcome.stats)
            else:
                summary.failed += 1
            progress(_progress_line(summary, entry, outcome))
            if on_summary is not None:
                on_summary(summary)
        window.clear()

    for verdict in validate_lines(path, model_override, check):
        window.append(verdict)
        if sum(v.job is not None for v in window) >= WINDOW_PER_ROW * max_batch:
            run_window()
    run_window()
    summary.seconds = time.perf_counter() - started
    return summary


def _serves(job: JobLine, alias: str) -> bool:
    return job.model is None or job.model == alias


def _not_served(alias: str, batch_id: str, job: JobLine) -> Outcome:
    return failure(
        batch_id,
        job,
        "model_not_served",
        f"this run serves model {alias!r}, the line asks for {job.model!r} "
        f"(pass --model {alias} to run every line on it)",
    )


def _run_many(pair, alias: str, batch_id: str, jobs: list[JobLine], max_batch: int):
    """(line number, outcome) for each job; one by one if the batch as a whole fails."""
    if max_batch > 1:
        done: dict[int, Outcome] = {}
        try:
            lines = [(batch_id, j) for j in jobs]
            for job, outcome in decode_together(pair, alias, lines, max_batch):
                done[job.line] = outcome
            return done.items()
        except Exception:  # a request the batch cannot take: isolate it below
            log.exception("batched run failed; running these lines one by one")
    return [(job.line, _run_one(pair, alias, batch_id, job)) for job in jobs]


def _run_one(pair, alias: str, batch_id: str, job: JobLine) -> Outcome:
    try:
        return execute(pair, alias, batch_id, job)
    except Exception as exc:  # one bad line must not lose the others
        log.exception("line %d (%s) failed", job.line, job.custom_id)
        return failure(batch_id, job, "internal_error", f"{type(exc).__name__}: {exc}")


def _progress_line(summary: RunSummary, job: JobLine, outcome: Outcome) -> str:
    head = f"[{summary.lines}] line {job.line} {job.custom_id}: "
    if not outcome.ok:
        error = outcome.line["error"]
        return head + f"error {error['code']}: {error['message']}"
    metrics = outcome.line["response"]["body"]["metrics"]
    sd = metrics.get("speculative_decoding", {})
    return head + (
        f"{outcome.completion_tokens} tokens, "
        f"{metrics.get('tokens_per_second', 0):.1f} per-request tokens/s, "
        f"acceptance {sd.get('draft_acceptance_rate', 0):.2f}"
    )
