"""Speculative-decoding statistics: the counter schema, its flat form in Redis hash
fields, and the rates of docs/formats.md.

Everything that counts keeps raw integers (the engine's SpecStats, the `sd:*` hash
fields of jobstore.store, the report's sums), so sums over requests, workers and
batches stay exact; this module alone names the counters, lays them out as hash
fields, says which drafter a sum came from, and turns counters into rates.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

#: Counters of a request that add up as single integers (SpecStats' fields).
COUNTERS = (
    "num_spec_steps",
    "num_draft_tokens",
    "num_accepted_draft_tokens",
    "num_emitted_tokens",
    # Tokens a grammar forced (its only continuation), proposed without the drafter and
    # verified by the target: counted apart, so acceptance rates are the drafter's own.
    "num_forced_tokens",
)
#: Counters most requests leave at 0: their hash field is written only when not 0 (a
#: missing field reads 0), so a line that uses none of it costs Redis nothing more.
SPARSE_COUNTERS = ("num_forced_tokens",)
#: Counters kept as a list, one integer per index (accepted count or draft position),
#: and the short name their hash fields use: `sd:hist:<i>`, `sd:dpp:<i>`, `sd:app:<i>`.
SERIES = {
    "acceptance_histogram": "hist",
    "draft_tokens_per_position": "dpp",
    "accepted_per_position": "app",
}
#: Prefix of every statistics field of a batch's or a worker's hash.
FIELD_PREFIX = "sd:"
#: Prefixes of the series' fields, each followed by an index.
SERIES_FIELD_PREFIXES = tuple(f"{FIELD_PREFIX}{short}:" for short in SERIES.values())
#: Prefix of the fields counting requests per drafter: `sd:drafter:<name>`.
DRAFTER_FIELD_PREFIX = f"{FIELD_PREFIX}drafter:"

#: Decimal places of every rate in a result line or status object.
RATE_DIGITS = 4


def rate(numerator: float, denominator: float) -> float:
    """numerator / denominator rounded to RATE_DIGITS, 0.0 when nothing was counted."""
    return round(numerator / denominator, RATE_DIGITS) if denominator else 0.0


def tokens_per_second(completion_tokens: int, busy_ms: float) -> float:
    """Tokens/s, the one figure every command shows under that name: completion tokens
    over the wall time spent producing them, in ms (a worker's busy time, `busy_ms`;
    a batch's or a run's span). A worker decoding N rows at once counts its wall time
    once, not once per row, so `--batch 4` shows what the machine delivers; a figure
    over summed per-request times is another one, "per-request tokens/s".
    Rounded to 2 decimals; 0.0 when no time was counted."""
    return round(completion_tokens * 1000 / busy_ms, 2) if busy_ms > 0 else 0.0


def drafter_of(names: Iterable[str]) -> str:
    """The drafter of a sum of requests, from the drafter names of what was summed: the
    one name, "mixed" for more than one, or "none" for no names."""
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
    num_forced_tokens: int = 0,
) -> dict:
    """The `speculative_decoding` object of FORMATS.md from raw counters
    (`num_forced_tokens` appears only where a grammar forced some).

    num_emitted_tokens: tokens the verify steps put into the output (the completion
    tokens); accepted_per_position may be shorter than draft_tokens_per_position
    (missing positions count 0)."""
    accepted = list(accepted_per_position) + [0] * (
        len(draft_tokens_per_position) - len(accepted_per_position)
    )
    out = {
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
    if num_forced_tokens:
        out["num_forced_tokens"] = num_forced_tokens
    return out


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
        "num_forced_tokens": int(spec.get("num_forced_tokens") or 0),
        "acceptance_histogram": hist,
        "draft_tokens_per_position": proposed,
        "accepted_per_position": accepted,
    }


def to_fields(counters: Mapping) -> dict[str, int]:
    """The flat hash-field form of one request's counters (`sd:num_spec_steps`,
    `sd:hist:<i>`, ..., and `sd:drafter:<name>` set to 1), which Redis sums field by
    field. counters: SpecStats' fields (`dataclasses.asdict(SpecStats)`) or the
    result of `counters_of_line`."""
    fields = {
        f"{FIELD_PREFIX}{name}": int(counters.get(name, 0))
        for name in COUNTERS
        if name not in SPARSE_COUNTERS or counters.get(name)
    }
    for name, short in SERIES.items():
        for i, n in enumerate(counters.get(name) or []):
            fields[f"{FIELD_PREFIX}{short}:{i}"] = int(n)
    fields[f"{DRAFTER_FIELD_PREFIX}{counters.get('drafter', 'none')}"] = 1
    return fields


def from_fields(fields: Mapping[str, str]) -> dict:
    """Counters from summed hash fields (other fields are ignored): the keyword
    arguments of `summary`. A series runs up to its highest index, missing ones 0."""

    def n(name: str) -> int:
        return int(fields.get(name, 0) or 0)

    def series(short: str) -> list[int]:
        prefix = f"{FIELD_PREFIX}{short}:"
        idx = sorted(int(k.split(":")[2]) for k in fields if k.startswith(prefix))
        return [n(f"{prefix}{i}") for i in range(idx[-1] + 1)] if idx else []

    drafters = (k.split(":", 2)[2] for k in fields if k.startswith(DRAFTER_FIELD_PREFIX))
    counters: dict = {"drafter": drafter_of(drafters)}
    counters.update({name: n(f"{FIELD_PREFIX}{name}") for name in COUNTERS})
    counters.update({name: series(short) for name, short in SERIES.items()})
    return counters
