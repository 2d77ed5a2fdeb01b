"""Speculative sampling stays exact on a sliding-window pair and on a hybrid pair.

As tests/test_engine_sampling.py does for llama: a 6-token vocabulary, the exact law
of the first three tokens under target-only sampling enumerated with mlx-lm's own
caches, and sequences drawn through the batched decoder (what generate_many runs)
with mixed drafters and draft lengths, rows joining as others finish; Pearson
chi-square fails at p < 1e-6. The gemma3_text pair has a window of 2 and a prompt
of 4, so every draw depends on the window; the qwen3_5 pair is gated delta-net
layers between full attention. A broken rollback of each kind must fail the test.
"""

from __future__ import annotations

import functools
import itertools

import mlx.core as mx
import numpy as np
import pytest
from scipy.stats import chisquare
from tiny_families import build_model, tokenizer_dir

from engine import sampling
from engine.batch import BatchDecoder
from engine.loading import ModelPair
from engine.sampling import SamplingParams

VOCAB = 6
PROMPT = [1, 4, 2, 5]
LENGTH = 3
PARAMS = SamplingParams(temperature=0.7, top_p=0.9)
P_FAIL = 1e-6
N_SEQUENCES = 20_000  # the full test (slow: sampled rows verify one by one, ~4 ms each here)
N_QUICK = 600  # the default run: enough for a law over 10-20 sequences
N_MUTANT = 600
SCALE = 2.0  # a law spread over 10-20 sequences: few draws test it well
SETUPS = [("model", 1), ("model", 2), ("model", 3), ("lookup", 2), ("none", 1)]


def _pair(tmp, family: str) -> ModelPair:
    from mlx_lm.utils import load_model

    tok, _ = tokenizer_dir(tmp)
    over = {"sliding_window": 2} if family == "gemma3_text" else {}
    models = []
    for role, seed in (("t", 11), ("d", 12)):
        path = build_model(
            tmp / role,
            family,
            vocab_size=VOCAB,
            tokenizer_from=tok,
            hidden=16,
            seed=seed,
            scale=SCALE,
            layers=2,
            overrides=over,
        )
        models.append(load_model(path)[0])
    return ModelPair(models[0], models[1], None, "t", "d", 512, VOCAB, VOCAB, family)


@pytest.fixture(scope="module", params=["gemma3_text", "qwen3_5"])
def pair(request, tmp_path_factory) -> ModelPair:
    return _pair(tmp_path_factory.mktemp(request.param), request.param)


def exact_law(pair: ModelPair) -> dict[tuple[int, ...], float]:
    """P(first LENGTH tokens) under target-only sampling, by enumeration."""

    @functools.cache
    def next_law(prefix):
        logits = pair.target(mx.array([PROMPT + list(prefix)]), cache=pair.target.make_cache())
        return np.array(sampling.probs(logits[0, -1], PARAMS), dtype=np.float64)

    law = {}
    for seq in itertools.product(range(VOCAB), repeat=LENGTH):
        p = 1.0
        for i in range(LENGTH):
            p *= next_law(seq[:i])[seq[i]]
        law[seq] = p
    return law


def draw(pair: ModelPair, n: int, seed0: int, rows: int) -> dict[tuple[int, ...], int]:
    """n sequences through the batched decoder, at most `rows` at a time."""
    batch = BatchDecoder(pair)
    out: dict[int, list[int]] = {}
    counts: dict[tuple[int, ...], int] = {}
    started = 0
    while started < n or out:
        while started < n and len(out) < rows:
            drafter, k = SETUPS[started % len(SETUPS)]
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


def chi_square_p(law, counts) -> float:
    n = sum(counts.values())
    if any(law.get(s, 0) == 0 for s in counts):
        return 0.0
    keys = [s for s, p in law.items() if p > 0]
    observed = np.array([counts.get(s, 0) for s in keys], dtype=np.float64)
    expected = np.array([law[s] for s in keys]) * n
    return float(chisquare(observed, expected * n / expected.sum()).pvalue)


def test_sampling_matches_target_law_quick(pair):
    law = exact_law(pair)
    assert min(law.values()) < 0.001 < max(law.values()), "the law should be far from uniform"
    assert sum(p > 0.01 for p in law.values()) >= 7, "the law should spread over many sequences"
    assert chi_square_p(law, draw(pair, N_QUICK, seed0=5_000_000, rows=250)) > P_FAIL


@pytest.mark.slow
@pytest.mark.parametrize("rows", [250, 1])
def test_sampling_matches_target_law(pair, rows):
    law = exact_law(pair)
    assert chi_square_p(law, draw(pair, N_SEQUENCES, seed0=6_000_000, rows=rows)) > P_FAIL


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
    assert chi_square_p(law, draw(pair, N_MUTANT, seed0=7_000_000, rows=250)) < P_FAIL
