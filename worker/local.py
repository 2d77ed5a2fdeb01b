"""`spec-run`: the worker without a queue. Same validation, engine and lines, no Redis.

Lines are run one by one in input order and written as they finish (results to the
output file; error lines to the errors file, or also to the output when none is
given), so a long run can be watched and a killed run keeps what it did.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import engine
from producer.jobfile import JobLine, LineError, validate_file
from producer.lines import dumps, error_line
from worker.execute import Outcome, execute, failure, to_request

log = logging.getLogger("specfleet.run")


@dataclass
class RunSummary:
    lines: int = 0
    completed: int = 0
    failed: int = 0
    invalid: int = 0
    completion_tokens: int = 0
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
) -> RunSummary:
    """Run every line of an already validated file; invalid lines become error lines.

    `out` and `errors_out` are binary files (they may be the same file).
    """
    summary = RunSummary()
    started = time.perf_counter()
    check = context_check(pair, alias)
    pending: list[LineError] = []

    def flush_invalid() -> None:
        if pending:
            message = "; ".join(
                f"{e.field}: {e.message}" if e.field else e.message for e in pending
            )
            line = error_line(
                batch_id, pending[0].line, pending[0].custom_id, "invalid_request", message
            )
            errors_out.write((dumps(line) + "\n").encode())
            summary.invalid += 1
            summary.failed += 1
            summary.lines += 1
            pending.clear()

    for item in validate_file(path, model_override, check):
        if isinstance(item, LineError):
            if pending and pending[0].line != item.line:
                flush_invalid()
            pending.append(item)
            continue
        flush_invalid()
        outcome = _run_one(pair, alias, batch_id, item)
        summary.lines += 1
        (out if outcome.ok else errors_out).write((dumps(outcome.line) + "\n").encode())
        out.flush()
        if outcome.ok:
            summary.completed += 1
            summary.completion_tokens += outcome.completion_tokens
            summary.stats.merge(outcome.stats)
        else:
            summary.failed += 1
        progress(_progress_line(summary, item, outcome))
    flush_invalid()
    summary.seconds = time.perf_counter() - started
    return summary


def _run_one(pair, alias: str, batch_id: str, job: JobLine) -> Outcome:
    if job.model is not None and job.model != alias:
        return failure(
            batch_id,
            job,
            "model_not_served",
            f"this run serves model {alias!r}, the line asks for {job.model!r} "
            f"(pass --model {alias} to run every line on it)",
        )
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
        f"{outcome.completion_tokens} tokens, {metrics.get('tokens_per_second', 0):.1f} tok/s, "
        f"acceptance {sd.get('draft_acceptance_rate', 0):.2f}"
    )
