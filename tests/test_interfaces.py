"""The declared interfaces: every proposer is an interfaces.Proposer, both decoders are
interfaces.Decoder, a pair's decoder and a request's drafter are settled in one place
each, and a row's draft comes from `BatchDecoder._choose` within its budget and cap."""

from __future__ import annotations

import pytest

import engine
from engine import batch, drafters, heads, interfaces, plain
from engine.draft_length import DraftLengthPolicy
from engine.loading import ModelPair
from engine.sampling import SamplingParams


def _pair(plain_only=None, draft=None) -> ModelPair:
    # No models: what is asked here reads only the pair's fields.
    return ModelPair(None, draft, None, "t", None, 512, 8, 8, "p", plain_only=plain_only)


@pytest.mark.parametrize(
    "proposer", [drafters.ModelProposer, drafters.DFlashProposer, heads.HeadProposer]
)
def test_every_proposer_declares_the_interface_and_one_admit(proposer):
    assert interfaces.Proposer in proposer.__mro__
    assert not hasattr(proposer, "admit_state")
    assert proposer.admit is not interfaces.Proposer.admit


def test_capabilities_are_declared_with_defaults():
    assert (drafters.ModelProposer.needs_features, drafters.ModelProposer.block) == (False, False)
    assert (drafters.DFlashProposer.needs_features, drafters.DFlashProposer.block) == (True, True)
    assert (heads.HeadProposer.needs_features, heads.HeadProposer.block) == (True, False)
    assert drafters.DFlashProposer.rows is None and drafters.DFlashProposer.cold == {}


def test_the_pair_picks_its_decoder_in_one_place():
    assert interfaces.Decoder in batch.BatchDecoder.__mro__
    assert interfaces.Decoder in plain.PlainDecoder.__mro__
    assert batch.decoder_class(_pair()) is batch.BatchDecoder
    assert batch.decoder_class(_pair(plain_only="falcon_h1: CacheList")) is plain.PlainDecoder


@pytest.mark.parametrize(
    "plain_only, draft, drafter, expected",
    [
        (None, object(), "model", "model"),
        (None, None, "lookup", "lookup"),
        (None, None, "none", "none"),
        ("CacheList", None, "model", "none"),  # plain decoding: the same text as any drafter
        ("CacheList", None, "lookup", "none"),
    ],
)
def test_a_request_drafter_is_settled_by_the_pair(plain_only, draft, drafter, expected):
    assert batch.request_drafter(_pair(plain_only, draft), drafter) == expected


def test_model_without_a_draft_model_is_refused_with_one_message():
    with pytest.raises(engine.InvalidRequestError) as err:
        batch.request_drafter(_pair(), "model")
    assert str(err.value) == batch.NO_DRAFT_MODEL
    assert "needs a draft model" in batch.NO_DRAFT_MODEL


class _Plan:
    """A sampled "auto" row's schedule stand-in: fixed lengths."""

    def __init__(self, ks):
        self.ks = list(ks)

    def choose(self, budget: int) -> int:
        return self.ks.pop(0)


def _choose(rows, max_draft=None):
    """The drafts a decoder (no models: `_choose` reads rows, policy and proposer only)
    gives these rows."""
    decoder = object.__new__(batch.BatchDecoder)
    decoder.rows, decoder.policy = rows, DraftLengthPolicy()
    decoder.proposer = type("P", (), {"max_draft": max_draft})()
    return decoder._choose()


def _row(key, drafter, fixed_k, plan, budget=16, greedy=False):
    row = batch._Row(key, SamplingParams(0.0 if greedy else 1.0), 0, drafter, fixed_k, plan, 99, 1)
    row.generated = 99 - 1 - budget
    if drafter == "lookup":
        row.lookup = drafters.LookupIndex([1, 2, 3, 1, 2, 3, 1, 2])
    return row


def test_fixed_and_sampled_rows_draft_what_they_ask_within_budget_and_cap():
    choices = _choose(
        [
            _row(0, "model", 5, None),
            _row(1, "model", 12, None, budget=3),  # budget: at most 3
            _row(2, "model", None, _Plan([4])),  # a sampled "auto" row's own schedule
            _row(3, "lookup", 2, None),  # the tokens that followed "1 2" last time
            _row(4, "none", 1, None),
            _row(5, "model", 4, None, budget=0),  # its last token: no drafts
        ]
    )
    got = [(c.k, c.source, c.tokens) for c in choices]
    assert got == [
        (5, "model", None),
        (3, "model", None),
        (4, "model", None),
        (2, "lookup", [3, 1]),
        (0, "none", None),
        (0, "none", None),
    ]
    assert _choose([_row(0, "model", 8, None)], max_draft=3)[0].k == 3  # a block drafter's cap


def test_every_layer_kind_declares_the_row_layer_interface():
    # RaggedRows calls these on every layer kind hanging off its rows; one missing
    # would surface only when a batch of that family first compacts or joins.
    from engine import dflash, ragged, recurrent

    wanted = [name for name in vars(ragged.RowLayer) if not name.startswith("_") and name != "mro"]
    assert "arrays" in wanted and "concat" in wanted
    for kind in (ragged.RaggedLayerCache, recurrent.RecurrentLayerCache, dflash._ContextLayer):
        missing = [name for name in wanted if not callable(getattr(kind, name, None))]
        assert not missing, f"{kind.__name__} lacks {missing}"


def test_each_layer_kind_names_the_arrays_it_holds():
    import mlx.core as mx

    from engine import ragged, recurrent

    rows = ragged.RaggedRows(2)
    kv = ragged.RaggedLayerCache(rows)
    rec = recurrent.RecurrentLayerCache(rows, 2)
    assert kv.arrays() == [] and rec.arrays() == []
    kv.update_and_fetch(mx.ones((2, 1, 3, 4)), mx.ones((2, 1, 3, 4)))
    rec[1] = mx.ones((2, 5))
    assert [id(a) for a in kv.arrays()] == [id(kv.keys), id(kv.values)]
    assert [id(a) for a in rec.arrays()] == [id(rec[1])]
    rows.advance(3, [3, 2])
    rows.evaluate()
