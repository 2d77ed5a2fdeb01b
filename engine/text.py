"""The text layer: prompts and chat templates in, text with stops and metrics out.

The token-level work happens in core.SpeculativeDecoder; this module renders the
prompt once with the target tokenizer (the draft gets the same ids), checks the
request, ends the output at EOS, a stop string or max_tokens, and fills in the
usage and metrics of FORMATS.md.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import replace

import jinja2
from jinja2 import meta

from contract.defaults import choice_seed
from contract.limits import DRAFTERS, LOGIT_BIAS_MAX, MAX_DRAFT_TOKENS, REQUEST_BOUNDS

from .batch import SpeculativeDecoder, new_decoder, request_drafter
from .grammars import Grammars
from .processors import RowLogits
from .sampling import SamplingParams
from .types import (
    ContextLengthError,
    EngineError,
    GenerationRequest,
    GenerationResult,
    InvalidRequestError,
    RequestExpired,
    SpecStats,
    StreamItem,
)


def _check(request: GenerationRequest) -> None:
    given = [f for f in ("prompt", "messages", "prompt_ids") if getattr(request, f) is not None]
    if len(given) != 1:
        raise InvalidRequestError(
            f"give exactly one of prompt, messages, prompt_ids; got {given or 'none'}"
        )
    rules = [(n, b.contains(getattr(request, n)), b.rule()) for n, b in REQUEST_BOUNDS.items()]
    rules.append(("drafter", request.drafter in DRAFTERS, f"must be one of {', '.join(DRAFTERS)}"))
    for name, ok, rule in rules:
        if not ok:
            raise InvalidRequestError(f"{name}: {rule}, got {getattr(request, name)!r}")
    if request.top_logprobs and not request.logprobs:
        raise InvalidRequestError(
            f"top_logprobs: needs logprobs true, got top_logprobs={request.top_logprobs}"
        )
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
        kwargs = _template_kwargs(pair, request.chat_template_kwargs)
        try:
            ids = tok.apply_chat_template(
                list(request.messages), add_generation_prompt=True, **kwargs
            )
        except jinja2.TemplateError as exc:  # e.g. its raise_exception("roles must alternate")
            raise InvalidRequestError(
                f"messages: the chat template of {pair.name} refuses them: {exc}"
            ) from None
        return list(ids)
    bos = getattr(tok, "bos_token", None)
    return list(
        tok.encode(
            request.prompt, add_special_tokens=bos is None or not request.prompt.startswith(bos)
        )
    )


def _template_kwargs(pair, kwargs: dict | None) -> dict:
    """chat_template_kwargs, checked: each must be a variable the target's chat template
    reads (a misspelt one would otherwise change nothing, silently)."""
    if not kwargs:
        return {}
    for name in ("messages", "add_generation_prompt"):
        if name in kwargs:
            raise InvalidRequestError(f"chat_template_kwargs.{name}: the engine sets it")
    template = getattr(pair.tokenizer, "chat_template", None)
    if not isinstance(template, str):
        raise InvalidRequestError(
            f"chat_template_kwargs: the chat template of {pair.name} takes no variables"
        )
    # As transformers renders it: {% break %} and {% continue %} on.
    env = jinja2.Environment(extensions=["jinja2.ext.loopcontrols"])
    try:
        known = meta.find_undeclared_variables(env.parse(template))
    except jinja2.TemplateSyntaxError:  # a tag of another extension: the tokenizer judges
        return dict(kwargs)
    for name in kwargs:
        if name not in known:
            raise InvalidRequestError(
                f"chat_template_kwargs.{name}: not a variable of {pair.name}'s chat template"
                f" (it reads: {', '.join(sorted(known - {'messages'})) or 'none'})"
            )
    return dict(kwargs)


def grammars(pair) -> Grammars:
    """The pair's compiled constraints (made on first use, kept with the pair)."""
    found = getattr(pair, "_grammars", None)
    if found is None:
        found = Grammars(pair.tokenizer, pair.target_vocab)
        pair._grammars = found
    return found


def _thinking(pair, ids: list[int]) -> tuple[int, int] | None:
    """(think-start, think-end) token ids where the target has single-token thinking
    markers, else None."""
    tok = pair.tokenizer
    start = getattr(tok, "think_start_tokens", None)
    end = getattr(tok, "think_end_tokens", None)
    if not start or not end or len(start) != 1 or len(end) != 1:
        return None
    return start[0], end[0]


def _thinking_open(marks: tuple[int, int] | None, ids: list[int]) -> bool:
    """Whether the prompt leaves a thinking section open (its last think-start comes
    after its last think-end): the output then begins inside it."""
    if marks is None:
        return False
    starts = [i for i, t in enumerate(ids) if t == marks[0]]
    ends = [i for i, t in enumerate(ids) if t == marks[1]]
    return bool(starts) and (not ends or starts[-1] > ends[-1])


def _row_logits(
    pair, request: GenerationRequest, ids: list[int], gate: int | None
) -> RowLogits | None:
    """The request's logits pipeline, or None where it asks for nothing of it."""
    r = request
    penalised = r.frequency_penalty or r.presence_penalty or r.repetition_penalty != 1.0
    if not (r.logprobs or penalised or r.logit_bias or r.constraint):
        return None
    vocab = pair.target_vocab
    bias = None
    if r.logit_bias:
        bias = {}
        for key, value in r.logit_bias.items():
            try:
                token = int(key)
            except (TypeError, ValueError):
                raise InvalidRequestError(
                    f"logit_bias: keys must be token ids, got {key!r}"
                ) from None
            if not 0 <= token < vocab:
                raise InvalidRequestError(
                    f"logit_bias.{key}: token ids must be in 0..{vocab - 1}, got {token}"
                )
            if (
                not isinstance(value, (int, float))
                or not -LOGIT_BIAS_MAX <= value <= LOGIT_BIAS_MAX
            ):
                raise InvalidRequestError(
                    f"logit_bias.{key}: must be in [-{LOGIT_BIAS_MAX}, {LOGIT_BIAS_MAX}], got {value!r}"
                )
            bias[token] = float(value)
    matcher = grammars(pair).matcher(r.constraint) if r.constraint else None
    return RowLogits(
        vocab=vocab,
        eos=tuple(pair.tokenizer.eos_token_ids),
        bias=bias,
        frequency=float(r.frequency_penalty),
        presence=float(r.presence_penalty),
        repetition=float(r.repetition_penalty),
        matcher=matcher,
        gate=gate if matcher is not None else None,
        top_logprobs=int(r.top_logprobs) if r.logprobs else None,
        prompt=ids if r.repetition_penalty != 1.0 else [],
    )


def _token_bytes(pair) -> Callable[[list[int]], bytes] | None:
    """A token's own bytes, as logprobs report them: a piece of a character (one byte of
    "é") has no text of its own, and its text's bytes would be U+FFFD's. None where the
    target has no fast tokenizer (then the bytes of the token's text)."""
    try:
        return grammars(pair).tokenizer.decode_bytes
    except InvalidRequestError:
        return None


def count_prompt_tokens(pair, request: GenerationRequest) -> int:
    """How many target tokens the request's prompt takes."""
    return len(prompt_ids(pair, request))


def _find_stop(text: str, stops: tuple[str, ...], start: int) -> int:
    found = [i for i in (text.find(s, max(start, 0)) for s in stops) if i >= 0]
    return min(found) if found else -1


class RequestRun:
    """One request's text-level state: checks it, then turns verified token blocks
    into text, ending at EOS, a stop string or max_tokens.

    Drive it with `feed(step)` until `finished`, then take `result()`. Both the
    single-request and the batched decoder use it, so their output is the same.
    """

    def __init__(self, pair, request: GenerationRequest):
        _check(request)
        self.t_start = time.perf_counter()
        self.request = request
        self.ids = prompt_ids(pair, request)
        if not self.ids:
            raise InvalidRequestError("the prompt is empty: it encodes to no tokens")
        total = len(self.ids) + request.max_tokens
        if total > pair.context_length:
            raise ContextLengthError(
                f"prompt ({len(self.ids)} tokens) + max_tokens ({request.max_tokens}) = "
                f"{total} exceeds the context of {pair.name} "
                f"({pair.context_length} tokens); shorten the prompt or lower max_tokens"
            )
        self.drafter = request_drafter(pair, request.drafter)
        self.params = SamplingParams(
            request.temperature, request.top_p, request.top_k, request.min_p
        )
        self.seed = (
            request.seed if request.seed is not None else int.from_bytes(os.urandom(8), "little")
        )
        # "model" is the worker's draft, whatever its kind; statistics name the kind.
        self.stats = SpecStats(
            drafter=pair.drafter_kind if self.drafter == "model" else self.drafter
        )
        marks = _thinking(pair, self.ids) if request.messages is not None else None
        self.thinking = marks if marks is not None and (_thinking_open(marks, self.ids)) else None
        self.marks = marks
        self.logits = _row_logits(pair, request, self.ids, marks[1] if self.thinking else None)
        self.tokenizer = pair.tokenizer
        self.logprobs: list | None = [] if request.logprobs else None
        self.token_bytes = _token_bytes(pair) if request.logprobs else None
        self.stops = request.stop_strings()
        self.hold = max((len(s) for s in self.stops), default=1) - 1
        self.eos = pair.tokenizer.eos_token_ids
        self.detok = pair.tokenizer.detokenizer
        self.out: list[int] = []
        self.sent = 0
        self.finish: str | None = None
        self.t_first: float | None = None
        self.finished = False
        self.cached_tokens: int | None = None  # set by the decoder loop once admitted

    def decoder(self, pair) -> SpeculativeDecoder:
        """A single-request token decoder for this request."""
        r = self.request
        return SpeculativeDecoder(
            pair,
            self.ids,
            self.params,
            seed=self.seed,
            drafter=self.drafter,
            num_draft_tokens=r.num_draft_tokens,
            max_tokens=r.max_tokens,
            logits=self.logits,
        )

    def feed(self, step) -> str:
        """Take one verified block; return the new text that is safe to show."""
        used = 0
        for j, tok in enumerate(step.tokens):
            used += 1
            if tok in self.eos:
                self.finish = "stop"
                break
            self.out.append(tok)
            if self.logprobs is not None and step.logprobs is not None:
                self.logprobs.append((tok, *step.logprobs[j]))
            self.detok.add_token(tok)
            if (
                self.stops
                and _find_stop(self.detok.text, self.stops, self.sent - self.hold - 1) >= 0
            ):
                self.finish = "stop"
                break
            if len(self.out) >= self.request.max_tokens:
                self.finish = "length"
                break
        if self.t_first is None:
            self.t_first = time.perf_counter()
        if step.source == "forced":  # the grammar's tokens, counted apart from drafts
            self.stats.record_step(0, 0, used)
            self.stats.num_forced_tokens += min(step.accepted, used)
        else:
            self.stats.record_step(step.proposed, min(step.accepted, used), used)
        if self.finish:
            return self._close()
        text = self.detok.text
        safe = len(text) - self.hold if self.stops else len(text)
        if safe <= self.sent:
            return ""
        piece, self.sent = text[self.sent : safe], safe
        return piece

    def _close(self) -> str:
        self.finished = True
        self.detok.finalize()
        text = self.detok.text
        if self.stops:
            at = _find_stop(text, self.stops, 0)
            if at >= 0:
                text, self.finish = text[:at], "stop"
        self.text = text
        self.finish = self.finish or "length"
        self.t_end = time.perf_counter()
        return text[self.sent :] if len(text) > self.sent else ""

    def result(self) -> GenerationResult:
        """The finished request's text, usage and metrics (FORMATS.md)."""
        if not self.finished:
            self._close()
        gen_s = self.t_end - self.t_start
        n_out, n_in = len(self.out), len(self.ids)
        self.stats.num_emitted_tokens = n_out
        text, reasoning = self._split_reasoning()
        return GenerationResult(
            text=text,
            token_ids=self.out,
            finish_reason=self.finish,
            usage={
                "prompt_tokens": n_in,
                "completion_tokens": n_out,
                "total_tokens": n_in + n_out,
                "prompt_tokens_details": {"cached_tokens": self.cached_tokens or 0},
            },
            metrics={
                "time_to_first_token_ms": round(
                    ((self.t_first or self.t_end) - self.t_start) * 1000, 3
                ),
                "generation_time_ms": round(gen_s * 1000, 3),
                "tokens_per_second": round(n_out / gen_s, 3) if gen_s > 0 else 0.0,
                "speculative_decoding": self.stats.to_dict(),
            },
            stats=self.stats,
            logprobs=self._logprobs(),
            reasoning=reasoning,
        )

    def _split_reasoning(self) -> tuple[str, str | None]:
        """(answer, reasoning) of a chat request to a thinking target: the text inside
        the thinking section is the reasoning, what follows its end (leading newlines
        dropped) the answer. (text, None) where the target or the prompt has none."""
        if self.marks is None:
            return self.text, None
        tok = self.tokenizer
        start, end = tok.think_start, tok.think_end
        text = self.text
        if self.thinking is None:
            if not (self.out and self.out[0] == self.marks[0]):
                return text, None
            at = text.find(start)
            text = text[at + len(start) :] if at >= 0 else text
        at = text.find(end)
        if at < 0:  # cut off (max_tokens) while still thinking
            return "", text.strip("\n")
        return text[at + len(end) :].lstrip("\n"), text[:at].strip("\n")

    def _logprobs(self) -> list[dict] | None:
        """OpenAI's `logprobs.content` entries for the output tokens."""
        if self.logprobs is None:
            return None

        def entry(token: int, logprob: float) -> dict:
            raw = self.token_bytes([token]) if self.token_bytes is not None else None
            if raw is None:
                raw = self.tokenizer.decode([token]).encode("utf-8")
            text = raw.decode("utf-8", errors="replace")
            return {"token": text, "logprob": logprob, "bytes": list(raw)}

        return [
            {**entry(tok, lp), "top_logprobs": [entry(t, v) for t, v in top]}
            for tok, lp, top in self.logprobs[: len(self.out)]
        ]


def stream(pair, request: GenerationRequest) -> Iterator[StreamItem]:
    """Yield text pieces as tokens are accepted; the last item carries the result.

    Each item is a StreamItem: `text` is the new text that is safe to show, and
    `result` is None until the last item, which holds the GenerationResult (its
    `text` may be empty). Raises InvalidRequestError, ContextLengthError or
    CacheError before any output.
    """
    run = RequestRun(pair, request)
    decoder = run.decoder(pair)

    def items() -> Iterator[StreamItem]:
        for step in decoder.steps():
            if run.cached_tokens is None:
                run.cached_tokens = decoder.batch.cached_tokens(decoder.KEY)
            piece = run.feed(step)
            if run.finished:
                yield StreamItem(piece, run.result())
                return
            if piece:
                yield StreamItem(piece)
        yield StreamItem("", run.result())

    return items()


def generate_many(
    pair,
    requests: Iterable[GenerationRequest],
    max_batch: int = 16,
    expired: Callable[[int], bool] | None = None,
) -> Iterator[tuple[int, GenerationResult | EngineError]]:
    """Run requests together in batches of up to max_batch rows.

    Yields (index, result) as each request finishes, or (index, error) for a
    request the engine refused (bad option, too long); the others go on. A new
    request joins as soon as a row frees up: `requests` is read lazily. After
    every step, rows for which `expired(index)` is true are dropped and yielded
    as (index, RequestExpired).
    """
    batch = new_decoder(pair)
    runs: dict[int, RequestRun] = {}
    waiting = iter(enumerate(requests))
    while True:
        while len(runs) < max_batch:
            item = next(waiting, None)
            if item is None:
                break
            i, request = item
            try:
                run = RequestRun(pair, request)
            except EngineError as exc:
                yield i, exc
                continue
            runs[i] = run
            batch.add(
                i,
                run.ids,
                run.params,
                seed=run.seed,
                drafter=run.drafter,
                num_draft_tokens=request.num_draft_tokens,
                max_tokens=request.max_tokens,
                logits=run.logits,
            )
        if not runs:
            return
        for i, step in batch.step().items():
            run = runs[i]
            if run.cached_tokens is None:
                run.cached_tokens = batch.cached_tokens(i)
            run.feed(step)
            if run.finished:
                batch.remove(i)
                del runs[i]
                yield i, run.result()
        for i in [i for i in runs if expired is not None and expired(i)]:
            batch.remove(i)
            del runs[i]
            yield i, RequestExpired(f"request {i} ran past its deadline")


def generate(pair, request: GenerationRequest) -> GenerationResult:
    """Run one request (n = 1) to completion and return text, usage and metrics."""
    if request.n != 1:
        raise InvalidRequestError(
            f"n: generate runs one choice; got n={request.n} (use generate_choices)"
        )
    for item in stream(pair, request):
        if item.result is not None:
            return item.result
    raise AssertionError("stream ended without a result")  # pragma: no cover


def choice_requests(request: GenerationRequest) -> list[GenerationRequest]:
    """The n choices of a request as n requests of one choice each: choice i runs with
    seed `contract.defaults.choice_seed(seed, i)` (choice 0 with the request's own), so
    each is exactly what it gives when run alone. An unseeded sampled request gets a
    fresh seed per choice."""
    if request.n == 1:
        return [request]
    seed = request.seed
    if seed is None and not SamplingParams(request.temperature).greedy:
        seed = int.from_bytes(os.urandom(8), "little") >> 1
    return [replace(request, n=1, seed=choice_seed(seed, i)) for i in range(request.n)]


def generate_choices(
    pair, request: GenerationRequest, max_batch: int = 16
) -> list[GenerationResult]:
    """Run a request's n choices as rows of one batch (up to max_batch at a time);
    returns their results in choice order. Greedy choices are all the same text, so a
    greedy request is decoded once and its result repeated. Raises the engine's request
    errors (InvalidRequestError, ContextLengthError) before any output."""
    requests = choice_requests(request)
    if SamplingParams(request.temperature).greedy:
        one = generate(pair, requests[0])
        return [one] + [
            replace(one, stats=SpecStats(drafter=one.stats.drafter)) for _ in requests[1:]
        ]
    results: list = [None] * len(requests)
    for i, res in generate_many(pair, requests, max_batch=max_batch):
        if isinstance(res, EngineError):
            raise res
        results[i] = res
    return results
