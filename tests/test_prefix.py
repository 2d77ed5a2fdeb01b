"""The prefix cache (engine/prefix.py): rows that share a prompt prefix reuse its state
exactly, for every layer kind (full attention, sliding window, recurrent) and the draft.

Greedy output must equal target-only decoding with the cache on and off, single and
batched; a reused state must give the very logits a fresh prefill gives (a segment off
by one position, or another prompt's state behind a colliding hash, fails that); the
sampling law is unchanged with reuse on (chi-square, tests/chisquare.py).
"""

from __future__ import annotations

import random

import chisquare
import mlx.core as mx
import pytest
from tiny_families import family_pair, six_token_pair
from tiny_models import reference_greedy

import engine
from engine import prefix
from engine.drafters import prefill_rows
from engine.loading import ModelPair
from engine.prefix import PairCaches, PrefixCache, pair_caches, prefill_cached
from engine.sampling import SamplingParams

FAMILIES = ["llama", "gemma3_text", "qwen3_5"]
BIG = 1 << 30


@pytest.fixture(scope="module", params=FAMILIES)
def fam_pair(request, tmp_path_factory):
    return family_pair(tmp_path_factory.mktemp(request.param), request.param, "llama")


def _prompts(vocab: int, shared: int, n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    head = [rng.randrange(3, vocab) for _ in range(shared)]
    return [head + [rng.randrange(3, vocab) for _ in range(3 + 4 * i)] for i in range(n)]


SETUPS = (("model", 3), ("model", "auto"), ("none", 1), ("lookup", 2), ("model", 2))


def _requests(prompts):
    return [
        engine.GenerationRequest(
            prompt_ids=p, max_tokens=10, temperature=0.0, drafter=d, num_draft_tokens=k
        )
        for p, (d, k) in zip(prompts, SETUPS * 4, strict=False)
    ]


def test_greedy_output_is_target_only_with_and_without_reuse(fam_pair):
    """Five lines sharing 140 tokens: 128 (two blocks) are reused by every line, the
    first batch included (its shared prefix is prefilled once), then alone."""
    pair = fam_pair
    pair.prefix = pair_caches(pair, BIG)
    prompts = _prompts(pair.target_vocab, 140, 5)
    reqs = _requests(prompts)
    batched = dict(engine.generate_many(pair, reqs, max_batch=3))
    single = [engine.generate(pair, r) for r in reqs]
    stats = pair.prefix.info()
    pair.prefix = pair_caches(pair, 0)
    off = dict(engine.generate_many(pair, reqs, max_batch=3))
    for i, p in enumerate(prompts):
        want = reference_greedy(pair, p, 10)
        assert batched[i].token_ids == want[: len(batched[i].token_ids)]
        assert single[i].token_ids == batched[i].token_ids == off[i].token_ids
        assert batched[i].usage["prompt_tokens_details"] == {"cached_tokens": 128}
        assert single[i].usage["prompt_tokens_details"] == {"cached_tokens": 128}
        assert off[i].usage["prompt_tokens_details"] == {"cached_tokens": 0}
    assert stats["target"]["reused_tokens"] == 128 * 10
    assert stats["draft"]["hits"] > 0  # rows that drafted read the draft's kept prefix


def _next_logits(model, rows_cache, token: int) -> mx.array:
    rows, cache = rows_cache
    out = model(mx.array([[token]] * rows.batch), cache=cache)
    return out[:, -1]


@pytest.mark.parametrize("family", FAMILIES)
def test_a_reused_state_is_the_state_a_fresh_prefill_gives(family, tmp_path, monkeypatch):
    """B reuses the 24 tokens it shares with A (blocks of 8; A kept from the second row
    of a batch, beside an unrelated prompt): its next logits equal a fresh prefill's. C shares nothing with A but, with every hash colliding, looks the
    same to the index: the kept tokens must refuse it."""
    pair = family_pair(tmp_path, family, None)
    model, cache = pair.target, PrefixCache(BIG, block=8)
    rng = random.Random(3)
    head = [rng.randrange(3, 200) for _ in range(24)]
    a, b = head + [5, 6, 7, 8, 9], head + [11, 12, 13]
    other = [rng.randrange(3, 200) for _ in range(35)]
    prefill_cached(model, [other, a], cache)
    rows, caches, reused = prefill_cached(model, [b], cache)
    assert reused == [24]
    fresh = _next_logits(model, prefill_rows(model, [b]), 17)
    assert mx.allclose(_next_logits(model, (rows, caches), 17), fresh, atol=1e-4).item()

    monkeypatch.setattr(prefix, "_digest", lambda parent, block: b"same")
    collide = PrefixCache(BIG, block=8)
    prefill_cached(model, [a], collide)
    c = [rng.randrange(3, 200) for _ in range(27)]
    rows, caches, reused = prefill_cached(model, [c], collide)
    assert reused == [0]
    fresh = _next_logits(model, prefill_rows(model, [c]), 17)
    assert mx.allclose(_next_logits(model, (rows, caches), 17), fresh, atol=1e-4).item()


def test_the_budget_bounds_memory_and_evicts_least_recently_used(tmp_path):
    pair = family_pair(tmp_path, "llama", None)
    model = pair.target
    one = PrefixCache(BIG, block=8)
    prefill_cached(model, [list(range(3, 20))], one)  # 17 tokens: two blocks kept
    block_bytes = one.stats.bytes // 2
    cache = PrefixCache(3 * block_bytes, block=8)
    p, q = [list(range(3, 20)), list(range(40, 57))]
    prefill_cached(model, [p], cache)
    prefill_cached(model, [q], cache)  # needs two blocks: p's leaf goes first
    assert cache.stats.bytes <= cache.budget and cache.stats.evicted == 1
    assert cache.kept_length(q) == 16 and cache.kept_length(p) == 8
    prefill_cached(model, [p], cache)  # p's root is the most recent: q's leaf goes
    assert cache.kept_length(p) == 16 and cache.kept_length(q) == 8


# -- the sampling law with reuse on -------------------------------------------------
VOCAB = 6
PROMPT = [1, 4, 2, 5, 3]
LENGTH = 3
PARAMS = SamplingParams(temperature=0.7, top_p=0.9)
N_REUSED = 3_000


def _small_pair(tmp, family: str) -> ModelPair:
    pair = six_token_pair(tmp, family)
    # Blocks of 3: every row reuses the first three prompt tokens and prefills one.
    pair.prefix = PairCaches(PrefixCache(BIG, block=3), PrefixCache(BIG, block=3), 2 * BIG)
    return pair


@pytest.mark.parametrize("family", FAMILIES)
def test_sampling_law_is_unchanged_with_reuse(family, tmp_path):
    pair = _small_pair(tmp_path, family)
    law = chisquare.exact_law(pair.target, PROMPT, PARAMS, LENGTH, VOCAB)
    counts = chisquare.draw(pair, N_REUSED, 4_200_000, PROMPT, PARAMS, LENGTH)
    target, draft = pair.prefix.target.stats, pair.prefix.draft.stats
    assert target.reused_tokens >= 3 * (N_REUSED - chisquare.ROWS)
    assert draft.reused_tokens > 0
    assert chisquare.chi_square_p(law, counts) > chisquare.P_FAIL
