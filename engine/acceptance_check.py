"""A drafter's acceptance measured on a few greedy tokens of a short fixed prompt.

A drafter can load and still never get a draft accepted: a draft of another family
whose tokenizer agrees with the target's on every shared id (a superset vocabulary
loads without a word), a head trained for another target, a head read in the wrong
norm layout. Output stays exact, so the only symptom is lost speed ("auto" backs off
quietly). The worker's start-up and `spec-doctor` run this check and name such a
drafter with its likely causes. It runs on a copy of the pair without the prefix cache
and with a fresh policy, so it leaves the pair's kept prefixes and measured speeds
as they were.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

#: The fixed prompt, and how many tokens the check decodes greedily after it, drafting
#: PROBE_DRAFT_TOKENS per step (a fixed K: "auto" may back off and draft nothing).
PROBE_PROMPT = "def fibonacci(n):\n    "
PROBE_TOKENS = 32
PROBE_DRAFT_TOKENS = 2

#: Below this share of drafts accepted, over at least MIN_DRAFTS drafts, the drafter is
#: named as likely broken (a real pair accepts far more on code; a broken one about 0).
NEAR_ZERO = 0.05
MIN_DRAFTS = 8

_CAUSES = {
    "model": (
        "a draft of another family or training whose tokenizer agrees with the target's "
        "on the shared ids (e.g. a superset vocabulary), so it loads but predicts other "
        "text"
    ),
    "mtp": (
        "the head's norms read in the wrong layout (read: {layout}), or mtp.* tensors "
        "that belong to another checkpoint"
    ),
    "eagle3": (
        "a head trained for another target (its aux layer ids or draft vocabulary do not "
        "match this target), or a head for another revision of it"
    ),
    "dflash": "a drafter trained for another target (its target_layer_ids do not match)",
}


@dataclass(frozen=True)
class AcceptanceCheck:
    """What the check measured: drafter kind, drafts proposed and accepted, tokens."""

    drafter: str
    drafted: int
    accepted: int
    tokens: int
    layout: str | None = None  # the MTP head's norm layout, when it has one

    @property
    def rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def near_zero(self) -> bool:
        """True when enough drafts were made and almost none were accepted."""
        return self.drafted >= MIN_DRAFTS and self.rate < NEAR_ZERO

    def summary(self) -> str:
        return (
            f"drafter {self.drafter}: {self.accepted} of {self.drafted} drafts accepted "
            f"({self.rate:.2f}) on a {self.tokens}-token greedy check"
        )

    def warning(self) -> str | None:
        """The summary with the likely causes when acceptance is about 0, else None."""
        if not self.near_zero:
            return None
        cause = _CAUSES.get(self.drafter, "a drafter for another target").format(layout=self.layout)
        return (
            f"{self.summary()}: the drafter loads but its drafts are (almost) never "
            f"accepted; output stays exact but slower than plain. Likely causes: {cause}; "
            "or a wrong pair (a draft or head made for another target). Use a draft of the "
            "target's own family, or serve with drafter 'none' until it is fixed"
        )


def check_acceptance(pair, tokens: int = PROBE_TOKENS) -> AcceptanceCheck | None:
    """Decode `tokens` greedy tokens of PROBE_PROMPT with the pair's drafter, K fixed.

    Returns None where there is nothing to check: no draft or drafting head, or a target
    served with plain decoding only. Raises what the engine raises on a broken pair.
    """
    from .batch import SpeculativeDecoder
    from .draft_length import DraftLengthPolicy
    from .sampling import SamplingParams
    from .text import prompt_ids
    from .types import GenerationRequest

    if pair.plain_only or (pair.draft is None and pair.dflash is None):
        return None
    # A copy: no prefix cache and its own policy, so the pair's state stays as it was.
    probe = replace(pair, prefix=None, policy=DraftLengthPolicy())
    ids = prompt_ids(probe, GenerationRequest(prompt=PROBE_PROMPT))
    decoder = SpeculativeDecoder(
        probe,
        ids,
        SamplingParams(0.0),
        num_draft_tokens=PROBE_DRAFT_TOKENS,
        max_tokens=tokens,
    )
    drafted = accepted = 0
    for step in decoder.steps():
        drafted += step.proposed
        accepted += step.accepted
    layout = pair.dflash.info().get("layout") if pair.dflash is not None else None
    return AcceptanceCheck(pair.drafter_kind, drafted, accepted, tokens, layout)


__all__ = ["AcceptanceCheck", "check_acceptance"]
