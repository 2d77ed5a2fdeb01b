"""Audit mode (`spec-worker --audit RATE`): check losslessness in production.

A random share RATE of greedy requests (temperature 0, or one so small that the engine
runs it as greedy) is run a second time target-only (drafter "none", same pair, same
request) and the two outputs are compared token by token.
Greedy speculative decoding must reproduce target-only decoding exactly, so any
difference is a bug (or a numerical tie the verify pass broke differently): it is
logged with the line, and counted in the batch hash (`audit_checked`,
`audit_mismatches`, shown by `spec-status`) in the same write that stores the line,
so a line that runs twice counts once.

The worker makes one `Auditor` at start-up and keeps it in its context
(worker.jobs.WorkerContext); `worker.execute` is given it and calls `check` after each
generation. Sampled requests are not audited: the same seed gives
the same distribution, not the same tokens.
"""

from __future__ import annotations

import dataclasses
import logging
import random
from dataclasses import dataclass, field

import engine
from engine.sampling import SamplingParams
from jobstore.keys import AUDIT_CHECKED, AUDIT_MISMATCHES

log = logging.getLogger("specfleet.audit")

__all__ = ["Auditor", "audit", "audit_counters", "maybe_audit"]


def auditable(request: engine.GenerationRequest) -> bool:
    """Greedy requests that speculate: only those have one right answer to compare
    (a temperature too small for float32's 1/T runs as greedy, so it counts too)."""
    return SamplingParams(request.temperature).greedy and request.drafter != "none"


def audit(pair, request: engine.GenerationRequest, result: engine.GenerationResult) -> bool:
    """Run `request` target-only on `pair`; True when it gives result's tokens and text.
    Raises what engine.generate raises."""
    reference = engine.generate(pair, dataclasses.replace(request, drafter="none"))
    return reference.token_ids == result.token_ids and reference.text == result.text


def maybe_audit(
    pair,
    request: engine.GenerationRequest,
    result: engine.GenerationResult,
    rate: float,
    rng: random.Random,
) -> bool | None:
    """Audit with probability `rate` if the request is auditable: True (matched),
    False (mismatch) or None (not audited)."""
    if rate <= 0 or not auditable(request) or rng.random() >= rate:
        return None
    return audit(pair, request, result)


def audit_counters(matched: bool) -> dict[str, int]:
    """The batch counters of one audit; they are stored with the line, in the same
    atomic write, so a line that runs twice is audited (and counted) once."""
    return {AUDIT_CHECKED: 1, AUDIT_MISMATCHES: 0 if matched else 1}


@dataclass
class Auditor:
    """Audit mode of one worker: the rate and its own random stream."""

    rate: float
    rng: random.Random = field(default_factory=random.Random)

    def __post_init__(self) -> None:
        if not 0 <= self.rate <= 1:
            raise ValueError(f"audit rate must be in [0, 1], got {self.rate}")

    def check(
        self,
        pair,
        batch_id: str,
        label: str,
        request: engine.GenerationRequest,
        result: engine.GenerationResult,
    ) -> bool | None:
        """Maybe audit one finished request; `label` names it in logs. The caller
        counts it (audit_counters). An error of the target-only run is logged, not
        raised: the result stands."""
        try:
            matched = maybe_audit(pair, request, result, self.rate, self.rng)
        except Exception:
            log.exception("audit of %s %s could not run", batch_id, label)
            return None
        if matched is None:
            return None
        if matched:
            log.info("audit %s %s: matches target-only", batch_id, label)
        else:
            log.error(
                "audit %s %s: MISMATCH: speculative output differs from target-only "
                "(drafter %s, %d tokens)",
                batch_id,
                label,
                request.drafter,
                len(result.token_ids),
            )
        return matched
