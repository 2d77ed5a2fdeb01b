"""Speculative sampling follows the target's law exactly (Pearson chi-square).

A target with a 6-token vocabulary whose next-token law depends on the prefix;
the exact law of the first three tokens under target-only sampling (mlx-lm's
sampler law, temperature 0.7, top_p 0.9) is enumerated, and sequences drawn from
the engine with mixed draft lengths and both drafters must match it (tests/chisquare.py:
the batched path, and the single path seed for seed and on its own). The same test,
run on deliberately broken copies of the algorithm, must fail.
"""

from __future__ import annotations

import chisquare
import mlx.core as mx
import numpy as np
import pytest
from scipy.stats import chisquare as pearson
from tiny_models import build_llama

import engine
from engine import core, sampling
from engine.batch import SpeculativeDecoder
from engine.loading import ModelPair
from engine.sampling import SamplingParams

VOCAB = 6
PROMPT = [1, 4]
LENGTH = 3
PARAMS = SamplingParams(temperature=0.7, top_p=0.9)
P_FAIL = chisquare.P_FAIL
#: Through the batched decoder, which draws them fastest. The law has 4 sequences of
#: p > 0 (df 3); the subtlest mutant below (resample_from_p) adds 0.068 to the chi-square
#: statistic per draw (measured at 3,000 draws), so at 10,000 draws a bug a quarter as
#: large still fails at p < 1e-6 with probability > 0.9999 (noncentral chi-square).
N_SEQUENCES = 10_000
N_SINGLE = 1_000  # through the single-request decoder, on top of seed-for-seed equality
N_EQUAL = 300  # seeds drawn alone and in a batch
N_MUTANT = 3_000


@pytest.fixture(scope="module")
def small_vocab_pair(tmp_path_factory) -> ModelPair:
    tmp = tmp_path_factory.mktemp("v6")
    target = build_llama(tmp / "t", vocab_size=VOCAB, hidden=16, layers=1, seed=11, scale=6.0)
    draft = build_llama(tmp / "d", vocab_size=VOCAB, hidden=16, layers=1, seed=12, scale=6.0)
    from mlx_lm.utils import load_model

    t_model, _ = load_model(target)
    d_model, _ = load_model(draft)
    return ModelPair(t_model, d_model, None, str(target), str(draft), 512, VOCAB, VOCAB, "v6")


def exact_law(pair: ModelPair) -> dict[tuple[int, ...], float]:
    """P(first LENGTH tokens) under target-only sampling, by enumeration."""
    return chisquare.exact_law(pair.target, PROMPT, PARAMS, LENGTH, VOCAB)


def draw(pair: ModelPair, n: int, seed0: int, rows: int = chisquare.ROWS) -> dict:
    """n sequences from the engine, cycling draft lengths 1..3 and both drafters."""
    return chisquare.draw(pair, n, seed0, PROMPT, PARAMS, LENGTH, rows=rows)


chi_square_p = chisquare.chi_square_p


def test_sampler_law_equals_mlx_lm_make_sampler():
    """sampling.probs is the law mlx-lm's make_sampler draws from (100k draws)."""
    from mlx_lm.sample_utils import make_sampler

    mx.random.seed(0)
    logits = mx.random.normal((12,)) * 2
    logprobs = logits - mx.logsumexp(logits)
    for params in (PARAMS, SamplingParams(1.3, 1.0, 4, 0.05), SamplingParams(0.5, 0.8, 0, 0.1)):
        sampler = make_sampler(params.temperature, params.top_p, params.min_p, 1, params.top_k)
        draws = np.array(sampler(mx.broadcast_to(logprobs, (100_000, 12))))
        observed = np.bincount(draws, minlength=12)
        p = np.array(sampling.probs(logits, params), dtype=np.float64)
        assert np.all(observed[p == 0] == 0), "mlx-lm drew a token our law excludes"
        keep = p > 0
        assert pearson(observed[keep], p[keep] / p[keep].sum() * 100_000).pvalue > P_FAIL


@pytest.mark.slow
def test_speculative_sampling_matches_target_law(small_vocab_pair):
    law = exact_law(small_vocab_pair)
    assert min(law.values()) < 0.001 < max(law.values()), "the law should be far from uniform"
    counts = draw(small_vocab_pair, N_SEQUENCES, seed0=3_000_000)
    assert chi_square_p(law, counts) > P_FAIL


def test_single_requests_draw_what_batched_rows_draw(small_vocab_pair):
    """Seed for seed, so the single path's law is the batched path's law."""
    chisquare.single_equals_batched(small_vocab_pair, N_EQUAL, 8_000, PROMPT, PARAMS, LENGTH)


@pytest.mark.slow
def test_single_requests_match_target_law(small_vocab_pair):
    counts = draw(small_vocab_pair, N_SINGLE, seed0=1_000_000, rows=1)
    assert chi_square_p(exact_law(small_vocab_pair), counts) > P_FAIL


def _resample_from_p(p, q, drafts, lengths, u, noise):
    # Mutation: at a rejection, sample from p instead of the residual max(0, p - q).
    n = [0] * len(lengths)
    if p.shape[1] > 1:
        x = drafts[..., None]
        px = mx.take_along_axis(p[:, :-1], x, axis=-1)[..., 0]
        qx = mx.take_along_axis(q, x, axis=-1)[..., 0]
        accept = (u * qx < px).tolist()
        for r, k in enumerate(lengths):
            while n[r] < k and accept[r][n[r]]:
                n[r] += 1
    cands = sampling.sample_rows(p, noise).tolist()
    return [(n[r], cands[r][n[r]]) for r in range(len(lengths))]


def _logits_off_by_one(original):
    def mutated(p, q, drafts, lengths, u, noise):
        # Mutation: judge draft i against the target row of position i + 1.
        if p.shape[1] > 1:
            p = mx.concatenate([p[:, 1:], p[:, -1:]], axis=1)
        return original(p, q, drafts, lengths, u, noise)

    return mutated


def _bonus_from_wrong_row(original):
    def mutated(p, q, drafts, lengths, u, noise):
        # Mutation: the bonus token comes from the row before the last.
        out = original(p, q, drafts, lengths, u, noise)
        wrong = sampling.sample_rows(p[:, :-1], noise[:, 1:]).tolist() if p.shape[1] > 1 else []
        return [
            (n, wrong[r][k - 1] if k and n == k else tok)
            for r, ((n, tok), k) in enumerate(zip(out, lengths, strict=True))
        ]

    return mutated


@pytest.mark.parametrize("mutation", ["resample_from_p", "logits_off_by_one", "bonus_wrong_row"])
def test_chi_square_catches_broken_algorithms(small_vocab_pair, monkeypatch, mutation):
    original = core.accept_sampled
    broken = {
        "resample_from_p": _resample_from_p,
        "logits_off_by_one": _logits_off_by_one(original),
        "bonus_wrong_row": _bonus_from_wrong_row(original),
    }[mutation]
    monkeypatch.setattr(core, "accept_sampled", broken)
    law = exact_law(small_vocab_pair)
    counts = draw(small_vocab_pair, N_MUTANT, seed0=2_000_000)
    assert chi_square_p(law, counts) < P_FAIL


def test_same_seed_same_output_whatever_ran_before(small_vocab_pair):
    def run(seed, k):
        dec = SpeculativeDecoder(
            small_vocab_pair,
            PROMPT,
            PARAMS,
            seed=seed,
            drafter="model",
            num_draft_tokens=k,
            max_tokens=12,
        )
        return [t for s in dec.steps() for t in s.tokens]

    first = run(7, 3)
    for other in range(5):
        run(100 + other, 2)  # unrelated work in between
    assert run(7, 3) == first
    assert engine.GenerationRequest().drafter == "model"


def test_batched_rows_draw_what_single_rows_draw(small_vocab_pair):
    """Same seed, same tokens, alone or in a batch: randomness is keyed by position."""
    single = {}
    for i in range(40):
        dec = SpeculativeDecoder(
            small_vocab_pair,
            PROMPT,
            PARAMS,
            seed=i,
            drafter="model",
            num_draft_tokens=1 + i % 3,
            max_tokens=8,
        )
        single[i] = [t for s in dec.steps() for t in s.tokens][:8]
    from engine.batch import BatchDecoder

    batch = BatchDecoder(small_vocab_pair)
    got = {i: [] for i in range(40)}
    for i in range(40):
        batch.add(
            i, PROMPT, PARAMS, seed=i, drafter="model", num_draft_tokens=1 + i % 3, max_tokens=8
        )
    while len(batch):
        for key, step in batch.step().items():
            got[key].extend(step.tokens)
            if len(got[key]) >= 8:
                batch.remove(key)
    assert {k: v[:8] for k, v in got.items()} == single
