"""Speculative sampling follows the target's law exactly (Pearson chi-square).

A target with a 6-token vocabulary whose next-token law depends on the prefix;
the exact law of the first three tokens under target-only sampling (mlx-lm's
sampler law, temperature 0.7, top_p 0.9) is enumerated, and sequences drawn from
the engine with mixed draft lengths and both drafters must match it. The same
test, run on deliberately broken copies of the algorithm, must fail.
"""

from __future__ import annotations

import itertools

import mlx.core as mx
import numpy as np
import pytest
from scipy.stats import chisquare
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
P_FAIL = 1e-6
N_SEQUENCES = 50_000  # through the batched decoder, which draws them fastest
N_SINGLE = 20_000  # through the single-request decoder
N_MUTANT = 6_000


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

    def next_law(prefix):
        logits = pair.target(mx.array([PROMPT + list(prefix)]))[0, -1]
        return np.array(sampling.probs(logits, PARAMS), dtype=np.float64)

    law = {}
    for seq in itertools.product(range(VOCAB), repeat=LENGTH):
        p = 1.0
        for i in range(LENGTH):
            p *= next_law(seq[:i])[seq[i]]
        law[seq] = p
    return law


def draw(pair: ModelPair, n: int, seed0: int) -> dict[tuple[int, ...], int]:
    """n sequences from the engine, cycling draft lengths 1..3 and both drafters."""
    setups = [("model", 1), ("model", 2), ("model", 3), ("lookup", 2), ("none", 0)]
    counts: dict[tuple[int, ...], int] = {}
    for i in range(n):
        drafter, k = setups[i % len(setups)]
        dec = SpeculativeDecoder(
            pair,
            PROMPT,
            PARAMS,
            seed=seed0 + i,
            drafter=drafter,
            num_draft_tokens=max(k, 1),
            max_tokens=LENGTH,
        )
        out: list[int] = []
        for step in dec.steps():
            out.extend(step.tokens)
        seq = tuple(out[:LENGTH])
        counts[seq] = counts.get(seq, 0) + 1
    return counts


def chi_square_p(law, counts) -> float:
    n = sum(counts.values())
    keys = [s for s, p in law.items() if p > 0]
    impossible = sum(c for s, c in counts.items() if law.get(s, 0) == 0)
    if impossible:
        return 0.0
    observed = np.array([counts.get(s, 0) for s in keys], dtype=np.float64)
    expected = np.array([law[s] for s in keys]) * n
    expected *= n / expected.sum()
    return float(chisquare(observed, expected).pvalue)


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
        assert chisquare(observed[keep], p[keep] / p[keep].sum() * 100_000).pvalue > P_FAIL


@pytest.mark.slow
def test_speculative_sampling_matches_target_law(small_vocab_pair):
    law = exact_law(small_vocab_pair)
    assert min(law.values()) < 0.001 < max(law.values()), "the law should be far from uniform"
    counts = draw(small_vocab_pair, N_SINGLE, seed0=1_000_000)
    assert chi_square_p(law, counts) > P_FAIL


def _resample_from_p(logits, drafts, q, params, seed, position):
    # Mutation: at a rejection, sample from p instead of the residual max(0, p - q).
    k = len(drafts)
    p = sampling.probs(logits, params)
    noise = sampling.gumbel_rows(seed, position, k + 1, p.shape[-1], 3)
    if k == 0:
        return 0, sampling.sample_rows(p, noise)[0].item()
    x = mx.array(drafts)
    if q is None:
        q = (mx.arange(p.shape[-1])[None, :] == x[:, None]).astype(mx.float32)
    rows = mx.arange(k)
    accept = (sampling.uniforms(seed, position, k) * q[rows, x] < p[rows, x]).tolist()
    cands = sampling.sample_rows(p, noise).tolist()
    n = 0
    while n < k and accept[n]:
        n += 1
    return n, cands[n]


def _logits_off_by_one(original):
    def mutated(logits, drafts, q, params, seed, position):
        # Mutation: judge draft i against the target row of position i + 1.
        shifted = mx.concatenate([logits[1:], logits[-1:]]) if len(drafts) else logits
        return original(shifted, drafts, q, params, seed, position)

    return mutated


def _bonus_from_wrong_row(original):
    def mutated(logits, drafts, q, params, seed, position):
        # Mutation: the bonus token comes from the row before the last.
        n, tok = original(logits, drafts, q, params, seed, position)
        if drafts and n == len(drafts):
            p = sampling.probs(logits[-2], params)
            noise = sampling.gumbel_rows(seed, position + n, 1, p.shape[-1], 3)
            tok = sampling.sample_rows(p[None], noise)[0].item()
        return n, tok

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


def draw_batched(pair: ModelPair, n: int, seed0: int, rows: int = 100) -> dict:
    """Like draw(), through the batched decoder: rows join as others finish."""
    from engine.batch import BatchDecoder

    setups = [("model", 1), ("model", 2), ("model", 3), ("lookup", 2), ("none", 1)]
    batch = BatchDecoder(pair)
    out: dict[int, list[int]] = {}
    counts: dict[tuple[int, ...], int] = {}
    started = 0
    while started < n or out:
        while started < n and len(out) < rows:
            drafter, k = setups[started % len(setups)]
            batch.add(
                started,
                PROMPT,
                PARAMS,
                seed=seed0 + started,
                drafter=drafter,
                num_draft_tokens=k,
                max_tokens=LENGTH,
            )
            out[started] = []
            started += 1
        for key, step in batch.step().items():
            out[key].extend(step.tokens)
            if len(out[key]) >= LENGTH:
                seq = tuple(out.pop(key)[:LENGTH])
                counts[seq] = counts.get(seq, 0) + 1
                batch.remove(key)
    return counts


@pytest.mark.slow
def test_batched_speculative_sampling_matches_target_law(small_vocab_pair):
    law = exact_law(small_vocab_pair)
    counts = draw_batched(small_vocab_pair, N_SEQUENCES, seed0=3_000_000)
    assert chi_square_p(law, counts) > P_FAIL


def test_batched_chi_square_catches_a_broken_residual(small_vocab_pair, monkeypatch):
    monkeypatch.setattr(core, "accept_sampled", _resample_from_p)
    counts = draw_batched(small_vocab_pair, N_MUTANT, seed0=4_000_000)
    assert chi_square_p(exact_law(small_vocab_pair), counts) < P_FAIL


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
