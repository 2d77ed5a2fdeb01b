"""Run one validated line on a loaded pair and build its output line.

Shared by the queue worker and `spec-run`, so both produce the same line for the same
request and seed. Engine errors a user can act on become error lines; anything else
is raised (the queue retries it, spec-run records `internal_error`). In audit mode
(an `Auditor` passed in: worker.audit), a finished greedy line may be re-run
target-only and compared.
"""

from __future__ import annotations

import dataclasses
import socket
import time
from dataclasses import dataclass

import engine
from jobstore.jobfile import JobLine
from jobstore.lines import effective_seed, error_line, result_line
from jobstore.store import result_counters
from jobstore.tokens import prompt_texts, tokens_over
from worker.audit import Auditor, audit_counters


@dataclass(frozen=True)
class Outcome:
    """What one line produced: a result line (ok) or an error line, and its counters."""

    ok: bool
    line: dict
    counters: dict
    completion_tokens: int = 0
    stats: engine.SpecStats | None = None
    #: Audit mode: True/False when re-run target-only and compared, else None.
    audited: bool | None = None


def to_request(job: JobLine, seed: int | None) -> engine.GenerationRequest:
    """The engine request for a line (params are GenerationRequest's keyword arguments)."""
    params = dict(job.params)
    params["seed"] = seed
    if params.get("stop") is not None:
        params["stop"] = tuple(params["stop"])
    return engine.GenerationRequest(**params)


#: The name result lines carry when no queue worker ran them (spec-run).
LOCAL_WORKER = "local"


def worker_identity(name: str | None) -> dict:
    """`metrics.worker` of a result line: the worker process and the host it ran on."""
    return {"name": name or LOCAL_WORKER, "host": socket.gethostname()}


def execute(
    pair,
    alias: str,
    batch_id: str,
    job: JobLine,
    worker: str | None = None,
    auditor: Auditor | None = None,
) -> Outcome:
    """Generate one line (`worker`: the name of the worker running it; `auditor`: audit
    mode, or None). Raises whatever the engine raises that is not a request error."""
    seed = effective_seed(batch_id, job)
    started = time.perf_counter()
    try:
        res = engine.generate(pair, to_request(job, seed))
    except (engine.ContextLengthError, engine.InvalidRequestError) as exc:
        return outcome_of(alias, batch_id, job, seed, exc)
    busy_ms = int((time.perf_counter() - started) * 1000)
    return outcome_of(
        alias, batch_id, job, seed, res, busy_ms, pair=pair, worker=worker, auditor=auditor
    )


def outcome_of(
    alias: str,
    batch_id: str,
    job: JobLine,
    seed,
    res,
    busy_ms: int = 0,
    pair=None,
    worker: str | None = None,
    auditor: Auditor | None = None,
) -> Outcome:
    """The line for an engine result, or for a request error the engine raised.

    With `pair` (the pair that produced res) and an `auditor`, the line may be re-run
    target-only and compared (worker.audit); busy_ms does not include that run.
    """
    if isinstance(res, engine.ContextLengthError):
        return failure(batch_id, job, "context_length_exceeded", f"{job.prompt_field}: {res}")
    if isinstance(res, engine.InvalidRequestError):
        return failure(batch_id, job, "invalid_request", str(res))
    # busy_ms: the worker's wall time this line is charged (rows decoded together share
    # it), so a worker's lines sum to its busy time and the report divides like status.
    metrics = {**res.metrics, "busy_ms": busy_ms, "worker": worker_identity(worker)}
    line = result_line(batch_id, job, alias, res.text, res.finish_reason, res.usage, metrics, seed)
    counters = result_counters(res.usage, dataclasses.asdict(res.stats), busy_ms)
    audited = None
    if auditor is not None and pair is not None:
        label = f"line {job.line} ({job.custom_id})"
        audited = auditor.check(pair, batch_id, label, to_request(job, seed), res)
        if audited is not None:
            counters.update(audit_counters(audited))
    return Outcome(True, line, counters, int(res.usage["completion_tokens"]), res.stats, audited)


def context_overflow(pair, batch_id: str, job: JobLine) -> Outcome | None:
    """The `context_length_exceeded` line of a prompt that cannot fit the pair's context
    with its max_tokens, found in bounded memory and time (jobstore.tokens: the same
    check as at submit, for a request written straight into Redis), else None. The
    engine still checks every prompt exactly (chat template included)."""
    tokenizer = getattr(getattr(pair.tokenizer, "_tokenizer", None), "backend_tokenizer", None)
    if tokenizer is None:
        return None
    max_tokens, context = job.params["max_tokens"], pair.context_length
    n = tokens_over(tokenizer, prompt_texts(job), max_tokens, context)
    if n is None:
        return None
    message = (
        f"{job.prompt_field}: at least {n} prompt tokens + max_tokens {max_tokens} exceed "
        f"the context of {pair.name} ({context} tokens); shorten the prompt or lower max_tokens"
    )
    return failure(batch_id, job, "context_length_exceeded", message)


def failure(batch_id: str, job: JobLine, code: str, message: str) -> Outcome:
    """An error line for a line that could not be run."""
    return Outcome(False, error_line(batch_id, job.line, job.custom_id, code, message), {})
