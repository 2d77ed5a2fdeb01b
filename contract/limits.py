"""Limits of the data contract (docs/formats.md), stated once: drafter names, the
largest draft length, the bounds of a request's fields, batch statuses. The job-file
validation, the engine's request check and the CLIs all take them from here."""

from __future__ import annotations

from dataclasses import dataclass

#: Where draft tokens come from (a request's `speculative.drafter`).
DRAFTERS = ("model", "lookup", "none")
#: A request's `speculative.num_draft_tokens`: "auto" or an integer 1..MAX_DRAFT_TOKENS.
MAX_DRAFT_TOKENS = 16
#: `custom_id` is 1..MAX_CUSTOM_ID_CHARS characters.
MAX_CUSTOM_ID_CHARS = 64
#: `stop` holds at most this many strings.
MAX_STOP_STRINGS = 16
#: `seed` is an integer in [SEED_MIN, SEED_MAX): a signed or unsigned 64-bit value.
SEED_MIN, SEED_MAX = -(2**63), 2**64

#: Batch statuses of `spec-status --json`; a batch in a terminal one changes no more.
BATCH_STATUSES = ("queued", "in_progress", "completed", "failed", "cancelled")
TERMINAL_STATUSES = ("completed", "failed", "cancelled")


@dataclass(frozen=True)
class Bound:
    """An interval a numeric request field must lie in (None: unbounded on that side)."""

    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False

    def contains(self, value: float) -> bool:
        """Whether value lies in the interval (NaN lies in none, as pydantic's check says)."""
        above = self.low is None or (value > self.low if self.low_open else value >= self.low)
        below = self.high is None or (value < self.high if self.high_open else value <= self.high)
        return above and below

    def rule(self) -> str:
        """The rule in words: `must be >= 0`, `must be in (0, 1]`."""
        if self.low is not None and self.high is not None:
            left, right = "(" if self.low_open else "[", ")" if self.high_open else "]"
            return f"must be in {left}{_num(self.low)}, {_num(self.high)}{right}"
        if self.low is not None:
            return f"must be {'>' if self.low_open else '>='} {_num(self.low)}"
        if self.high is not None:
            return f"must be {'<' if self.high_open else '<='} {_num(self.high)}"
        return "any value"

    def pydantic(self) -> dict[str, float]:
        """The bound as pydantic `Field` constraints (ge/gt/le/lt)."""
        out = {}
        if self.low is not None:
            out["gt" if self.low_open else "ge"] = self.low
        if self.high is not None:
            out["lt" if self.high_open else "le"] = self.high
        return out


#: Bounds of the numeric sampling fields of a request.
REQUEST_BOUNDS = {
    "max_tokens": Bound(low=1),
    "temperature": Bound(low=0),
    "top_p": Bound(low=0, high=1, low_open=True),
    "top_k": Bound(low=0),
    "min_p": Bound(low=0, high=1, high_open=True),
    "n": Bound(low=1, high=128),
    "top_logprobs": Bound(low=0, high=20),
    "frequency_penalty": Bound(low=-2, high=2),
    "presence_penalty": Bound(low=-2, high=2),
    "repetition_penalty": Bound(low=0, low_open=True),
}
#: A `logit_bias` value lies in [-LOGIT_BIAS_MAX, LOGIT_BIAS_MAX] (OpenAI's range).
LOGIT_BIAS_MAX = 100
#: The completions endpoint's integer `logprobs` (its legacy shape) is 0..this.
MAX_COMPLETION_LOGPROBS = 5


def _num(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else str(value)
