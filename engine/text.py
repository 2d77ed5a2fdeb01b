"""The text layer: prompts and chat templates in, text with stops and metrics out.

The token-level work happens in core.SpeculativeDecoder; this module renders the
prompt once with the target tokenizer (the draft gets the same ids), checks the
request, ends the output at EOS, a stop string or max_tokens, and fills in the
usage and metrics of FORMATS.md.
"""

from __future__ import annotations

import os
import time
from collections.abc import Generator, Iterator

from .core import MAX_DRAFT_TOKENS, SpeculativeDecoder
from .drafters import DRAFTERS
from .sampling import SamplingParams
from .types import (
    ContextLengthError,
    GenerationRequest,
    GenerationResult,
    InvalidRequestError,
    SpecStats,
)


def _check(request: GenerationRequest) -> None:
    given = [f for f in ("prompt", "messages", "prompt_ids") if getattr(request, f) is not None]
    if len(given) != 1:
        raise InvalidRequestError(
            f"give exactly one of prompt, messages, prompt_ids; got {given or 'none'}"
        )
    rules = [
        ("max_tokens", request.max_tokens >= 1, "must be >= 1"),
        ("temperature", request.temperature >= 0, "must be >= 0"),
        ("top_p", 0 < request.top_p <= 1, "must be in (0, 1]"),
        ("top_k", request.top_k >= 0, "must be >= 0"),
        ("min_p", 0 <= request.min_p < 1, "must be in [0, 1)"),
        ("drafter", request.drafter in DRAFTERS, f"must be one of {', '.join(DRAFTERS)}"),
    ]
    for name, ok, rule in rules:
        if not ok:
            raise InvalidRequestError(f"{name}: {rule}, got {getattr(request, name)!r}")
    k = request.num_draft_tokens
    if k != "auto" and not (isinstance(k, int) and 1 <= k <= MAX_DRAFT_TOKENS):
        raise InvalidRequestError(
            f"num_draft_tokens: must be 'auto' or 1..{MAX_DRAFT_TOKENS}, got {k!r}"
        )


def prompt_ids(pair, request: GenerationRequest) -> list[int]:
    """The prompt as target token ids (chat messages rendered with its template)."""
    tok = pair.tokenizer
    if request.prompt_ids is not None:
        ids = [int(i) for i in request.prompt_ids]
        bad = [i for i in ids if not 0 <= i < pair.target_vocab]
        if bad:
            raise InvalidRequestError(
                f"prompt_ids: ids must be in 0..{pair.target_vocab - 1}, got {bad[0]}"
            )
        return ids
    if request.messages is not None:
        if not getattr(tok, "has_chat_template", False):
            raise InvalidRequestError(
                f"messages: the target {pair.name} has no chat template; send a prompt instead"
            )
        return list(tok.apply_chat_template(list(request.messages), add_generation_prompt=True))
    bos = getattr(tok, "bos_token", None)
    return list(
        tok.encode(
            request.prompt, add_special_tokens=bos is None or not request.prompt.startswith(bos)
        )
    )


def count_prompt_tokens(pair, request: GenerationRequest) -> int:
    """How many target tokens the request's prompt takes."""
    return len(prompt_ids(pair, request))


def _find_stop(text: str, stops: tuple[str, ...], start: int) -> int:
    found = [i for i in (text.find(s, max(start, 0)) for s in stops) if i >= 0]
    return min(found) if found else -1


def _run(pair, request: GenerationRequest) -> Generator[str, None, GenerationResult]:
    _check(request)
    t_start = time.perf_counter()
    ids = prompt_ids(pair, request)
    if not ids:
        raise InvalidRequestError("the prompt is empty: it encodes to no tokens")
    if len(ids) + request.max_tokens > pair.context_length:
        raise ContextLengthError(
            f"prompt ({len(ids)} tokens) + max_tokens ({request.max_tokens}) = "
            f"{len(ids) + request.max_tokens} exceeds the context of {pair.name} "
            f"({pair.context_length} tokens); shorten the prompt or lower max_tokens"
        )
    params = SamplingParams(request.temperature, request.top_p, request.top_k, request.min_p)
    seed = request.seed if request.seed is not None else int.from_bytes(os.urandom(8), "little")
    drafter = request.drafter
    if drafter == "model" and pair.draft is None:
        raise InvalidRequestError(
            "drafter: 'model' needs a draft model and this engine has none; use 'lookup' or 'none'"
        )
    plan = None
    if request.num_draft_tokens == "auto" and drafter != "none":
        plan = pair.controller.plan(drafter, params.greedy)
    decoder = SpeculativeDecoder(
        pair,
        ids,
        params,
        seed=seed,
        drafter=drafter,
        num_draft_tokens=request.num_draft_tokens,
        max_tokens=request.max_tokens,
        plan=plan,
    )
    stats = SpecStats(drafter=drafter)
    stops = request.stop_strings()
    hold = max((len(s) for s in stops), default=1) - 1
    eos = pair.tokenizer.eos_token_ids
    detok = pair.tokenizer.detokenizer
    out: list[int] = []
    sent = 0
    finish = None
    t_first = None
    stop_at = -1
    for step in decoder.steps():
        used = 0
        for tok in step.tokens:
            used += 1
            if tok in eos:
                finish = "stop"
                break
            out.append(tok)
            detok.add_token(tok)
            if stops:
                text = detok.text
                stop_at = _find_stop(text, stops, sent - hold - 1)
                if stop_at >= 0:
                    finish = "stop"
                    break
            if len(out) >= request.max_tokens:
                finish = "length"
                break
        if t_first is None:
            t_first = time.perf_counter()
        stats.record_step(step.proposed, min(step.accepted, used), len(step.tokens[:used]))
        if finish:
            break
        text = detok.text
        safe = len(text) - hold if stops else len(text)
        if safe > sent:
            yield text[sent:safe]
            sent = safe
    detok.finalize()
    text = detok.text
    if stops:
        stop_at = _find_stop(text, stops, 0)
        if stop_at >= 0:
            text, finish = text[:stop_at], "stop"
    if len(text) > sent:
        yield text[sent:]
    finish = finish or "length"
    t_end = time.perf_counter()
    gen_s = t_end - t_start
    n_out = len(out)
    stats.num_emitted_tokens = n_out
    return GenerationResult(
        text=text,
        token_ids=out,
        finish_reason=finish,
        usage={
            "prompt_tokens": len(ids),
            "completion_tokens": n_out,
            "total_tokens": len(ids) + n_out,
        },
        metrics={
            "time_to_first_token_ms": round(((t_first or t_end) - t_start) * 1000, 3),
            "generation_time_ms": round(gen_s * 1000, 3),
            "tokens_per_second": round(n_out / gen_s, 3) if gen_s > 0 else 0.0,
            "speculative_decoding": stats.to_dict(),
        },
        stats=stats,
    )


def stream(pair, request: GenerationRequest) -> Iterator[str]:
    """Yield text pieces as tokens are accepted; the generator returns the result.

    Raises InvalidRequestError, ContextLengthError or CacheError before any output.
    """
    return _run(pair, request)


def generate(pair, request: GenerationRequest) -> GenerationResult:
    """Run one request to completion and return text, usage and metrics."""
    gen = _run(pair, request)
    while True:
        try:
            next(gen)
        except StopIteration as done:
            return done.value
