"""Run one validated line on a loaded pair and build its output line.

Shared by the queue worker and `spec-run`, so both produce the same line for the same
request and seed. Engine errors a user can act on become error lines; anything else
is raised (the queue retries it, spec-run records `internal_error`). In audit mode
(an `Auditor` passed in: worker.audit), a finished greedy line may be re-run
target-only and compared.
"""

from __future__ import annotations

import copy
import dataclasses
import socket
import time
from dataclasses import dataclass

import engine
from engine.sampling import SamplingParams
from jobstore.grammars import check_constraint
from jobstore.jobfile import JobLine
from jobstore.lines import cached_tokens, effective_seed, error_line, result_line
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


#: Rows a line's choices decode in when the line runs alone (engine.generate_choices).
CHOICE_ROWS = 16


def execute(
    pair,
    alias: str,
    batch_id: str,
    job: JobLine,
    worker: str | None = None,
    auditor: Auditor | None = None,
) -> Outcome:
    """Generate one line, all its choices (`worker`: the name of the worker running it;
    `auditor`: audit mode, or None). A line of n > 1 choices decodes them as rows of one
    batch (engine.generate_choices). Raises whatever the engine raises that is not a
    request error."""
    seed = effective_seed(batch_id, job)
    request = to_request(job, seed)
    started = time.perf_counter()
    try:
        if request.n == 1:
            res: list | engine.EngineError = [engine.generate(pair, request)]
        else:
            res = engine.generate_choices(pair, request, max_batch=CHOICE_ROWS)
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
    """The line for its choices' engine results (a list, in choice order), or for a
    request error the engine raised.

    With `pair` (the pair that produced res) and an `auditor`, the line may be re-run
    target-only and compared (worker.audit; choice 0); busy_ms does not include that run.
    """
    if isinstance(res, engine.ContextLengthError):
        return failure(batch_id, job, "context_length_exceeded", f"{job.prompt_field}: {res}")
    if isinstance(res, engine.InvalidRequestError):
        return failure(batch_id, job, "invalid_request", str(res))
    results = as_decoded(job, res)
    usage, metrics, stats = combine(results)
    # busy_ms: the worker's wall time this line is charged (rows decoded together share
    # it), so a worker's lines sum to its busy time and the report divides like status.
    metrics["busy_ms"] = busy_ms
    metrics["worker"] = worker_identity(worker)
    line = result_line(batch_id, job, alias, results, usage, metrics, seed)
    counters = result_counters(usage, dataclasses.asdict(stats), busy_ms, choices=len(results))
    audited = None
    if auditor is not None and pair is not None:
        label = f"line {job.line} ({job.custom_id})"
        first = engine.choice_requests(to_request(job, seed))[0]
        audited = auditor.check(pair, batch_id, label, first, results[0])
        if audited is not None:
            counters.update(audit_counters(audited))
    return Outcome(True, line, counters, int(usage["completion_tokens"]), stats, audited)


def as_decoded(job: JobLine, results: list) -> list:
    """The choices of a greedy line with n > 1 are one decoding repeated (the engine
    decodes it once); each copy gets that decoding's statistics, so a line's
    statistics, like its usage, sum over its choices (num_emitted_tokens equals
    completion_tokens, as every reader of a stored line assumes)."""
    if len(results) < 2 or not SamplingParams(job.params["temperature"]).greedy:
        return results
    first = results[0]
    return [first] + [
        r
        if r.stats.num_emitted_tokens
        else dataclasses.replace(r, stats=copy.deepcopy(first.stats))
        for r in results[1:]
    ]


def combine(results: list) -> tuple[dict, dict, engine.SpecStats]:
    """(usage, metrics, stats) of a line from its choices' results: the prompt counted
    once (choice 0's, with its cached tokens), completion tokens and speculative-decoding
    counters summed over choices; the first token's time is the earliest, the
    generation time the longest (choices decode together), tokens per second the sum's
    rate over it. One choice: its own usage and metrics, unchanged."""
    if len(results) == 1:
        res = results[0]
        return dict(res.usage), dict(res.metrics), res.stats
    stats = engine.SpecStats()
    for res in results:
        stats.merge(res.stats)
    first = results[0].usage
    completion = sum(int(r.usage["completion_tokens"]) for r in results)
    usage = {
        "prompt_tokens": int(first["prompt_tokens"]),
        "completion_tokens": completion,
        "total_tokens": int(first["prompt_tokens"]) + completion,
        "prompt_tokens_details": {"cached_tokens": cached_tokens(first)},
    }
    gen_ms = max(float(r.metrics.get("generation_time_ms", 0.0)) for r in results)
    metrics = {
        "time_to_first_token_ms": min(
            float(r.metrics.get("time_to_first_token_ms", 0.0)) for r in results
        ),
        "generation_time_ms": gen_ms,
        "tokens_per_second": round(completion / gen_ms * 1000, 3) if gen_ms > 0 else 0.0,
        "speculative_decoding": stats.to_dict(),
    }
    return usage, metrics, stats


def unusable_constraint(batch_id: str, job: JobLine) -> Outcome | None:
    """The `invalid_request` line of a request whose output constraint does not compile
    (jobstore.grammars, the submit-time check, cached per process), else None: a record
    written straight into Redis must not reach the engine's compiler, which some
    grammars crash (a stack overflow takes the whole process)."""
    constraint = job.params.get("constraint")
    if constraint is None:
        return None
    problem = check_constraint("constraint", constraint)
    if problem is None:
        return None
    return failure(batch_id, job, "invalid_request", str(problem))


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
