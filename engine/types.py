"""Values that cross the engine's boundary: requests, results, statistics, errors.

This module imports nothing from MLX, so schemas and tests can use it cheaply; the
defaults, drafter names, counter schema and rates come from `contract` (standard
library only).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from contract import stats
from contract.defaults import ENGINE
from contract.limits import DRAFTERS

Drafter = Literal[DRAFTERS]
FinishReason = Literal["stop", "length"]


class EngineError(Exception):
    """Base class of every error the engine raises on purpose."""


class ModelLoadError(EngineError):
    """A model directory is missing, unreadable or not a causal LM."""


class TokenizerMismatchError(EngineError):
    """Draft and target tokenizers disagree on the shared vocabulary."""


class ContextLengthError(EngineError):
    """Prompt plus max_tokens does not fit the target's context."""


class InvalidRequestError(EngineError):
    """A request the engine cannot run as given (bad option, missing draft...)."""


class RequestExpired(EngineError):
    """A batched request was dropped because its caller's deadline passed."""


class CacheError(EngineError):
    """A KV cache cannot be rolled back, so speculation would corrupt output."""


@dataclass(frozen=True)
class GenerationRequest:
    """One generation. Exactly one of prompt, messages, prompt_ids is set.

    temperature 0 means greedy; top_k 0 and top_p 1 mean off. num_draft_tokens is
    an int in 1..MAX_DRAFT_TOKENS or "auto"; drafter picks where draft tokens come from.
    Defaults: `contract.defaults.ENGINE` (greedy, unlike a job-file line).
    """

    prompt: str | None = None
    messages: tuple | list | None = None
    prompt_ids: tuple | list | None = None
    max_tokens: int = ENGINE.max_tokens
    temperature: float = ENGINE.temperature
    top_p: float = ENGINE.top_p
    top_k: int = ENGINE.top_k
    min_p: float = ENGINE.min_p
    seed: int | None = ENGINE.seed
    stop: tuple[str, ...] | list[str] | str | None = ENGINE.stop
    num_draft_tokens: int | Literal["auto"] = ENGINE.num_draft_tokens
    drafter: Drafter = ENGINE.drafter
    #: n > 1: several choices; run them with `engine.generate_choices` (each choice is a
    #: request of its own, `engine.choice_requests`).
    n: int = ENGINE.n
    logprobs: bool = ENGINE.logprobs
    top_logprobs: int = ENGINE.top_logprobs
    frequency_penalty: float = ENGINE.frequency_penalty
    presence_penalty: float = ENGINE.presence_penalty
    repetition_penalty: float = ENGINE.repetition_penalty
    #: {token id: bias in -100..100} (keys may be ints or their decimal strings).
    logit_bias: dict | None = ENGINE.logit_bias
    #: A normalised output constraint (`contract.constraints.normalise`), or None.
    constraint: dict | None = ENGINE.constraint
    chat_template_kwargs: dict | None = ENGINE.chat_template_kwargs

    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        if isinstance(self.stop, str):
            return (self.stop,) if self.stop else ()
        return tuple(s for s in self.stop if s)


@dataclass
class SpecStats:
    """Speculative-decoding counters, named and defined as in docs/formats.md (the
    schema: `contract.stats.COUNTERS` and `SERIES`).

    Counters add up: the sum of two requests' stats describes both. The
    per-position draft counts are kept raw so sums stay exact.
    """

    drafter: str = "none"
    num_spec_steps: int = 0
    num_draft_tokens: int = 0
    num_accepted_draft_tokens: int = 0
    num_emitted_tokens: int = 0
    num_forced_tokens: int = 0
    acceptance_histogram: list[int] = field(default_factory=list)
    draft_tokens_per_position: list[int] = field(default_factory=list)
    accepted_per_position: list[int] = field(default_factory=list)

    def record_step(self, num_proposed: int, num_accepted: int, num_emitted: int) -> None:
        """Count one verify step: proposed draft tokens, how many were accepted,
        and how many tokens the step put into the output (after stops/max_tokens)."""
        self.num_spec_steps += 1
        self.num_draft_tokens += num_proposed
        self.num_accepted_draft_tokens += num_accepted
        self.num_emitted_tokens += num_emitted
        _grow(self.acceptance_histogram, num_accepted + 1)
        self.acceptance_histogram[num_accepted] += 1
        _grow(self.draft_tokens_per_position, num_proposed)
        _grow(self.accepted_per_position, num_proposed)
        for i in range(num_proposed):
            self.draft_tokens_per_position[i] += 1
            if i < num_accepted:
                self.accepted_per_position[i] += 1

    def merge(self, other: SpecStats) -> None:
        """Add another request's counters to these."""
        # Stats that counted no step yet name no drafter of the sum.
        names = (self.drafter, other.drafter) if self.num_spec_steps else (other.drafter,)
        self.drafter = stats.drafter_of(names)
        self.num_spec_steps += other.num_spec_steps
        self.num_draft_tokens += other.num_draft_tokens
        self.num_accepted_draft_tokens += other.num_accepted_draft_tokens
        self.num_emitted_tokens += other.num_emitted_tokens
        self.num_forced_tokens += other.num_forced_tokens
        for mine, theirs in (
            (self.acceptance_histogram, other.acceptance_histogram),
            (self.draft_tokens_per_position, other.draft_tokens_per_position),
            (self.accepted_per_position, other.accepted_per_position),
        ):
            _grow(mine, len(theirs))
            for i, v in enumerate(theirs):
                mine[i] += v

    def to_dict(self) -> dict:
        """The `speculative_decoding` object of a result line (FORMATS.md)."""
        return stats.summary(
            self.drafter,
            self.num_spec_steps,
            self.num_draft_tokens,
            self.num_accepted_draft_tokens,
            self.num_emitted_tokens,
            self.acceptance_histogram,
            self.draft_tokens_per_position,
            self.accepted_per_position,
            self.num_forced_tokens,
        )


def _grow(values: list[int], n: int) -> None:
    if len(values) < n:
        values.extend([0] * (n - len(values)))


@dataclass(frozen=True)
class StreamItem:
    """One item of `engine.stream`: new text, and on the last item only, the result."""

    text: str
    result: GenerationResult | None = None

    @property
    def finished(self) -> bool:
        return self.result is not None


@dataclass
class GenerationResult:
    """What one request produced.

    usage: {"prompt_tokens", "completion_tokens", "total_tokens"}.
    metrics: {"time_to_first_token_ms", "generation_time_ms", "tokens_per_second",
    "speculative_decoding": SpecStats.to_dict()}.
    """

    text: str
    token_ids: list[int]
    finish_reason: FinishReason
    usage: dict
    metrics: dict
    stats: SpecStats
    #: With `logprobs`: one entry per output token, {"token", "logprob", "bytes",
    #: "top_logprobs": [{"token", "logprob", "bytes"}, ...]} (OpenAI's chat shape).
    logprobs: list[dict] | None = None
    #: A thinking model's reasoning, split from `text` (None: the template has none).
    reasoning: str | None = None
