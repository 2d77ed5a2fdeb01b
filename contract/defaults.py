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

    def as_dict(self) -> dict:
        """{field: default}, in field order."""
        return asdict(self)


#: A job-file line (spec-submit, spec-run, spec-serve): temperature 1.0, as in the OpenAI
#: API whose request format the job file follows.
JOB_FILE = RequestDefaults(temperature=1.0)
#: `engine.GenerationRequest`, a programmatic API: greedy (temperature 0) unless asked.
ENGINE = RequestDefaults(temperature=0.0)
