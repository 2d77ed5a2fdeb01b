"""The two interfaces of the decoding core, declared: a proposer (where a row's model
drafts come from) and a decoder (what the text layer and the workers drive).

`batch.BatchDecoder` speaks to its proposer only through `Proposer`: rows join
(`admit`) and leave (`remove`), `propose` drafts for the rows that want drafts this
step, `commit` hears what the target accepted. What a proposer can do is declared as
attributes with the defaults below, never probed for. `drafters.ModelProposer` (a draft
LM), `heads.HeadProposer` (an MTP or EAGLE-3 head) and `drafters.DFlashProposer` (a
block drafter) declare it; `drafters.new_proposer(pair)` makes the one a pair needs.

`Decoder` is what `batch.BatchDecoder` and `plain.PlainDecoder` both are; the pair's
decoder is picked in one place, `batch.decoder_class`.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any, ClassVar, NamedTuple, Protocol

from .core import Step
from .sampling import SamplingParams


class Joining(NamedTuple):
    """A row joining a proposer: its key, every token it has (the newest one pending
    in the target), its sampling settings and seed, and whether it drafts by the model
    (a proposer whose context follows the decoder's rows keeps the others too)."""

    key: object
    ids: list[int]
    params: SamplingParams
    seed: int
    drafts: bool


class Proposer(Protocol):
    """Batched drafting for the rows of one decoder.

    A proposer that `needs_features` reads the target's hidden states: the decoder runs
    every target pass inside `capture(target)`, hands the prefill's context (built with
    `new_context`) to `admit`, and the verify pass's features to `observe_target`.
    """

    #: What drafts: "model" (a draft LM), "dflash", "mtp" or "eagle3" (statistics name it).
    kind: str = "model"
    #: It reads the target's hidden states of every prefill and verify pass.
    needs_features: ClassVar[bool] = False
    #: Any number of drafts costs one drafter pass (else K drafts cost K passes).
    block: ClassVar[bool] = False
    #: Most drafts it gives a row in one step; None: as many as the decoder asks.
    max_draft: int | None = None
    #: Rows admitted but not read yet ({key: ...}); they are read when first drafted for.
    cold: Mapping = MappingProxyType({})
    #: The ragged rows of its own cache, which the decoder compacts with the target's
    #: (None: it keeps none, or compacts its context itself).
    rows: Any = None
    #: What one drafter pass costs against one target pass (by their sizes): the one
    #: figure a sampled "auto" row's static schedule prices drafts by. The batch's policy
    #: measures the real costs (draft_length.DraftLengthPolicy); a drafter keeps none.
    draft_cost: float = 0.1
    #: `propose(..., stop=f)` ends the drafts where f, shown its confidence in each draft
    #: so far, returns False (early stopping; see drafters.ModelProposer.propose).
    stops_early: bool = False
    #: The rows it has read, in its row order (cold rows excluded).
    members: list
    #: It takes `propose(..., grammar={key: processors.RowLogits})` and drafts under those
    #: rows' processors: logit_bias and penalties over the row's tokens and its own drafts
    #: before each depth, and only tokens the row's grammar allows (its law processed the
    #: same way), walking each matcher over its drafts and rolling it back before it
    #: returns. A proposer without it has its drafts cut at a grammar's first refusal.
    masks_drafts: bool = False

    def admit(self, joining: list[Joining], context: Any = None) -> None:
        """Rows join; `context` is what `new_context` built over their prefill passes
        (None for a proposer that does not need features)."""
        ...

    def remove(self, keys: set) -> None:
        """Rows leave (finished or cancelled); unknown keys are ignored."""
        ...

    def propose(self, want: dict, positions: dict, last: dict) -> tuple[dict, dict]:
        """Draft want[key] tokens per row (0 or absent: none); positions[key] is the
        row's output position, last[key] its newest (pending) token. Returns
        ({key: tokens}, {key: (k, V) law}), laws only for sampled rows."""
        ...

    def commit(self, emitted: dict, accepted: dict) -> None:
        """After verification: emitted[key] = the tokens the row put out this step,
        accepted[key] = how many of its drafts passed."""
        ...

    def lengths(self) -> dict:
        """{key: tokens the proposer holds of the row} (accepted tokens minus pending)."""
        ...

    def pending(self, key) -> list[int]:
        """Accepted tokens of a row the proposer has not read yet."""
        ...

    def capture(self, target):
        """A context manager: target passes inside it record their features."""
        raise NotImplementedError

    def new_context(self, batch: int) -> Any:
        """An empty context for `batch` joining rows, filled by `extend(features, keep)`
        after each of their prefill passes."""
        raise NotImplementedError

    def observe_target(self, features, keep: list[int]) -> None:
        """After a verify pass: row i's first keep[i] positions of `features` are real."""


class Decoder(Protocol):
    """Rows decoded together: `add` them, `step` until each is done, `remove` them."""

    #: Whether rows may draft (False: every row runs as drafter "none").
    speculative: ClassVar[bool] = True

    def __len__(self) -> int:
        """Rows added and not removed."""
        ...

    def add(
        self,
        key,
        prompt_ids: list[int],
        params: SamplingParams,
        *,
        seed: int,
        drafter: str,
        num_draft_tokens,
        max_tokens: int,
    ) -> None:
        """Queue a row; raises core.InvalidRequestError for an empty prompt."""
        ...

    def remove(self, key) -> None:
        """Drop a finished (or cancelled) row."""
        ...

    def step(self) -> dict[object, Step]:
        """One step for every row: {row key: Step}."""
        ...

    def cached_tokens(self, key) -> int:
        """Prompt tokens of a row that the prefix cache gave."""
        ...
