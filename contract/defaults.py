"""What a request gets for each sampling field it does not set.

Two doors take requests, and they differ on purpose in one default only, temperature:
a job-file line follows the OpenAI API (1.0, sampling), while `engine.GenerationRequest`
is a programmatic API whose callers get greedy decoding unless they ask to sample.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True, kw_only=True)
class RequestDefaults:
    """One default per sampling field, named as `engine.GenerationRequest`'s fields."""

    max_tokens: int = 256
    temperature: float
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    num_draft_tokens: int | str = "auto"
    drafter: str = "model"
    #: Choices per request, each its own row, its seed `choice_seed(seed, index)`.
    n: int = 1
    #: The target's log-probabilities of each emitted token (raw: before temperature and filters).
    logprobs: bool = False
    top_logprobs: int = 0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    #: {token id (str, as JSON keys are): bias}; None is no bias.
    logit_bias: dict | None = None
    #: One normalised output constraint (contract.constraints.normalise), or None.
    constraint: dict | None = None
    #: Extra variables for the chat template (e.g. {"enable_thinking": false}).
    chat_template_kwargs: dict | None = None

    def as_dict(self) -> dict:
        """{field: default}, in field order."""
        return asdict(self)


#: A job-file line (spec-submit, spec-run, spec-serve): temperature 1.0, as in the OpenAI
#: API whose request format the job file follows.
JOB_FILE = RequestDefaults(temperature=1.0)
#: `engine.GenerationRequest`, a programmatic API: greedy (temperature 0) unless asked.
ENGINE = RequestDefaults(temperature=0.0)


_MASK63 = (1 << 63) - 1


def choice_seed(seed: int | None, index: int) -> int | None:
    """The seed choice `index` of a request runs with: the request's own for choice 0 (so
    n = 1 gives what it always gave), else one derived from (seed, index) by a fixed hash
    (splitmix64), so every choice is reproducible alone and independent of the batch.
    None stays None (an unseeded request draws its own per choice)."""
    if seed is None or index == 0:
        return seed
    x = (seed ^ (index * 0x9E3779B97F4A7C15)) & ((1 << 64) - 1)
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & ((1 << 64) - 1)
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & ((1 << 64) - 1)
    return (x ^ (x >> 31)) & _MASK63
