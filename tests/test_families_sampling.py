"""Speculative sampling stays exact on a sliding-window pair and on a hybrid pair.

As tests/test_engine_sampling.py does for llama: a 6-token vocabulary, the exact law
of the first three tokens under target-only sampling enumerated with mlx-lm's own
caches, and sequences drawn through the batched decoder (what generate_many runs)
with mixed drafters and draft lengths, rows joining as others finish; the single path
draws seed for seed what the batched path draws (its own chi-square test, one per
proposer kind, is in test_engine_sampling and test_dflash_decoding). Pearson
chi-square fails at p < 1e-6 (tests/chisquare.py). The gemma3_text pair has a window
of 2 and a prompt of 4, so every draw depends on the window; the qwen3_5 pair is
gated delta-net layers between full attention: the suite's one sampling-law test of
each of these two kinds of layer state. A broken rollback of each kind must fail it.
"""

from __future__ import annotations

import chisquare
import mlx.core as mx
import pytest
from tiny_families import six_token_pair

from engine.loading import ModelPair
from engine.sampling import SamplingParams

VOCAB = 6
PROMPT = [1, 4, 2, 5]
LENGTH = 3
PARAMS = SamplingParams(temperature=0.7, top_p=0.9)
P_FAIL = chisquare.P_FAIL
#: Through the batched decoder. At 10,000 draws the test fails (p < 1e-6) with
#: probability >= 0.999 on any law at Cohen's w >= 0.093 from the target's (gemma3_text,
#: df 9) or >= 0.101 (qwen3_5, df 19): noncentral chi-square, lambda = n * w^2. The
#: subtlest algorithm mutant of test_engine_sampling is at w = 0.26; the rollback
#: mutants below draw sequences the target never does.
N_SEQUENCES = 10_000
N_EQUAL = 300  # seeds drawn alone and in a batch
N_MUTANT = 600
SCALE = 2.0  # a law spread over 10-20 sequences: few draws test it well


@pytest.fixture(scope="module", params=["gemma3_text", "qwen3_5"])
def pair(request, tmp_path_factory) -> ModelPair:
    return six_token_pair(tmp_path_factory.mktemp(request.param), request.param, SCALE)


def exact_law(pair: ModelPair) -> dict[tuple[int, ...], float]:
    """P(first LENGTH tokens) under target-only sampling, by enumeration."""
    return chisquare.exact_law(pair.target, PROMPT, PARAMS, LENGTH, VOCAB)


def draw(pair: ModelPair, n: int, seed0: int, rows: int = chisquare.ROWS) -> dict:
    return chisquare.draw(pair, n, seed0, PROMPT, PARAMS, LENGTH, rows=rows)


chi_square_p = chisquare.chi_square_p


def test_the_law_is_spread_out(pair):
    law = exact_law(pair)
    assert min(law.values()) < 0.001 < max(law.values()), "the law should be far from uniform"
    assert sum(p > 0.01 for p in law.values()) >= 7, "the law should spread over many sequences"


@pytest.mark.slow
def test_sampling_matches_target_law(pair):
    law = exact_law(pair)
    assert chi_square_p(law, draw(pair, N_SEQUENCES, seed0=6_000_000)) > P_FAIL


def test_single_requests_draw_what_batched_rows_draw(pair):
    """Seed for seed, so the single path's law is the batched path's law."""
    chisquare.single_equals_batched(pair, N_EQUAL, 9_000_000, PROMPT, PARAMS, LENGTH)


def _break_rollback(monkeypatch, family: str) -> None:
    from engine import ragged, recurrent

    if family == "qwen3_5":
        # Mutation: rows keep the recurrent state of their rejected drafts.
        monkeypatch.setattr(recurrent.RecurrentLayerCache, "_replay", lambda self, c, s, x, n: s)
    else:
        # Mutation: the window counts slots, so holes of rejected drafts shift it.
        monkeypatch.setattr(
            ragged.RaggedRows,
            "positions",
            lambda self: mx.broadcast_to(mx.arange(self.length)[None], self.valid.shape),
        )


def test_chi_square_catches_a_broken_rollback(pair, monkeypatch):
    law = exact_law(pair)
    _break_rollback(monkeypatch, pair.name)
    assert chi_square_p(law, draw(pair, N_MUTANT, seed0=7_000_000)) < P_FAIL
