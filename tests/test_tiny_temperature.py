"""Temperatures too small for float32 sample the greedy text, never NaN or an empty line.

At T -> 0 sampling tends to greedy decoding. A temperature whose 1/T float32 cannot
hold (below ~2.94e-39) runs as greedy; one just above it still samples, through the
draft's sampler and speculative sampling, and must give the greedy text as well
(the scaled log-probabilities are shifted so the best is 0 and cannot overflow).
"""

from __future__ import annotations

import mlx.core as mx
import pytest

import engine
from engine import GenerationRequest, sampling
from engine.sampling import SamplingParams

BOUNDARY = 1.0 / 3.4028234663852886e38  # ~2.94e-39: 1/T is the largest finite float32
TINY = [1e-30, 1e-38, BOUNDARY * 1.001, BOUNDARY * 0.999, 1e-39, 1e-300, 5e-324]
PROMPTS = ["def fibonacci(n):", "# Copyright", "The quick brown fox"]


@pytest.fixture(scope="module")
def demo():
    return engine.load_pair()


def test_the_boundary_is_where_float32_stops_holding_one_over_t():
    assert not SamplingParams(BOUNDARY * 1.001).greedy
    assert SamplingParams(BOUNDARY * 0.999).greedy
    assert SamplingParams(1e-300).greedy and SamplingParams(0.0).greedy
    assert not SamplingParams(1e-30).greedy


@pytest.mark.parametrize("t", [1e-30, 1e-38, BOUNDARY * 1.001])
def test_the_law_at_a_tiny_temperature_is_the_argmax_even_when_the_model_is_unsure(t):
    # 200 near-equal logits: the best log-probability is about -5.3, which times 1/T
    # overflows float32 unless it is shifted to 0 first.
    logits = mx.arange(200).astype(mx.float32) * 1e-3
    p = sampling.probs(logits, SamplingParams(t))
    assert not mx.any(mx.isnan(p)).item()
    assert p[199].item() == 1.0 and mx.sum(p).item() == 1.0


@pytest.mark.parametrize("drafter,k", [("model", 3), ("model", "auto"), ("lookup", 2), ("none", 1)])
def test_tiny_temperatures_give_the_greedy_text_single_and_batched(demo, drafter, k):
    def requests(t):
        return [
            GenerationRequest(
                prompt=p, max_tokens=16, temperature=t, seed=3, drafter=drafter, num_draft_tokens=k
            )
            for p in PROMPTS
        ]

    greedy = [engine.generate(demo, r) for r in requests(0.0)]
    for t in TINY:
        single = [engine.generate(demo, r) for r in requests(t)]
        batched = dict(engine.generate_many(demo, requests(t), max_batch=4))
        for i, ref in enumerate(greedy):
            for got in (single[i], batched[i]):
                assert (got.text, got.finish_reason) == (ref.text, ref.finish_reason), (t, i)
                assert got.token_ids == ref.token_ids
