"""Speculative-decoding statistics: raw counters in, the rates of FORMATS.md out.

Everything that counts keeps raw integers (the engine's SpecStats, the Redis hash
fields of jobstore.store, the report's sums), so sums over requests, workers and
batches stay exact; this module alone turns counters into rates. Pure Python: the
engine imports it, so it imports neither MLX nor Redis.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

#: Decimal places of every rate in a result line or status object.
RATE_DIGITS = 4


def rate(numerator: float, denominator: float) -> float:
    """numerator / denominator rounded to RATE_DIGITS, 0.0 when nothing was counted."""
    return round(numerator / denominator, RATE_DIGITS) if denominator else 0.0


def drafter_of(names: Iterable[str]) -> str:
    """The drafter of a sum of requests: the one name, "mixed", or "none" for no names."""
    distinct = sorted(set(names))
    if not distinct:
        return "none"
    return distinct[0] if len(distinct) == 1 else "mixed"


def accepted_per_position(histogram: Sequence[int], positions: int) -> list[int]:
    """Accepted draft tokens per position from an acceptance histogram: a step that
    accepted j drafts accepted positions 0..j-1, so position i was accepted by the
    steps that accepted more than i. Exact: both are raw counts."""
    return [sum(histogram[i + 1 :]) for i in range(positions)]


def summary(
    drafter: str,
    num_spec_steps: int,
    num_draft_tokens: int,
    num_accepted_draft_tokens: int,
    num_emitted_tokens: int,
    acceptance_histogram: Sequence[int],
    draft_tokens_per_position: Sequence[int],
    accepted_per_position: Sequence[int],
) -> dict:
    """The `speculative_decoding` object of FORMATS.md from raw counters.

    num_emitted_tokens: tokens the verify steps put into the output (the completion
    tokens); accepted_per_position may be shorter than draft_tokens_per_position
    (missing positions count 0)."""
    accepted = list(accepted_per_position) + [0] * (
        len(draft_tokens_per_position) - len(accepted_per_position)
    )
    return {
        "drafter": drafter,
        "num_spec_steps": num_spec_steps,
        "num_draft_tokens": num_draft_tokens,
        "num_accepted_draft_tokens": num_accepted_draft_tokens,
        "draft_acceptance_rate": rate(num_accepted_draft_tokens, num_draft_tokens),
        "mean_acceptance_length": rate(num_emitted_tokens, num_spec_steps),
        "acceptance_histogram": list(acceptance_histogram),
        "per_position_acceptance": [
            rate(a, d) for a, d in zip(accepted, draft_tokens_per_position, strict=True)
        ],
        "draft_tokens_per_position": list(draft_tokens_per_position),
    }


def counters_of_line(spec: dict, completion_tokens: int) -> dict:
    """Raw counters of one result line: its `speculative_decoding` object and its
    `usage.completion_tokens` (the tokens the verify steps emitted). Returns the keyword
    arguments of `summary`, all exact counts read from the line.

    Lines written by other tools may omit `draft_tokens_per_position`; only then are
    the proposed counts estimated, from the accepted counts and the rounded
    `per_position_acceptance` (a position never accepted is taken as proposed by
    every step)."""
    hist = [int(x) for x in spec.get("acceptance_histogram") or []]
    steps = int(spec.get("num_spec_steps") or 0)
    proposed = spec.get("draft_tokens_per_position")
    if proposed is not None:
        proposed = [int(x) for x in proposed]
        accepted = accepted_per_position(hist, len(proposed))
    else:
        ppa = [float(x) for x in spec.get("per_position_acceptance") or []]
        accepted = accepted_per_position(hist, len(ppa))
        proposed = [round(a / p) if p else steps for a, p in zip(accepted, ppa, strict=True)]
    return {
        "drafter": str(spec.get("drafter", "none")),
        "num_spec_steps": steps,
        "num_draft_tokens": int(spec.get("num_draft_tokens") or 0),
        "num_accepted_draft_tokens": int(spec.get("num_accepted_draft_tokens") or 0),
        "num_emitted_tokens": int(completion_tokens),
        "acceptance_histogram": hist,
        "draft_tokens_per_position": proposed,
        "accepted_per_position": accepted,
    }
