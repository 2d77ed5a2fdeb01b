"""DFlash block drafters through the one decoder: exact greedy output, the target's
law when sampling, single and batched, on the demo target and a hybrid target.

`drafter: "model"` means the worker's draft whatever its kind; with a DFlash drafter
loaded, statistics say "dflash". Block position j's law (given the context up to the
block) is the q of speculative sampling; the chi-square test of test_engine_sampling
checks the law over a 6-token vocabulary with mixed block lengths, and a drafter whose
law is not the one given to the acceptance rule must fail it. One sampling-law test per
proposer kind: this one on a full-attention target; recurrent layer state has its own
(test_families_sampling's qwen3_5 pair), and DFlash on a hybrid target its greedy test.
"""

from __future__ import annotations

import json

import chisquare
import mlx.core as mx
import pytest
from drafter_checks import (
    MIXED_K,
    SMALL,
    bound_pair,
    check_greedy_exact,
    drafter_config,
    draw,
    greedy_requests,
    write_spread_drafter,
)
from test_engine_sampling import (
    LENGTH,
    P_FAIL,
    PARAMS,
    PROMPT,
    VOCAB,
    chi_square_p,
    exact_law,
)
from tiny_families import build_model, tokenizer_dir
from tiny_models import build_llama, reference_greedy

import engine
from engine import GenerationRequest, drafters
from engine.dflash import DFlashModel, load_dflash, save_dflash
from engine.loading import DEMO_DIR, ModelPair

PROMPTS = [
    "def parse_header(line):\n    ",
    "import os\n",
    "class Stack:\n    def __init__(self):",
    "x = [",
    "for i in range(10):",
]
MODES = [1, 3, 7, "auto"]
N_DRAWS = 20_000  # batched
N_SINGLE = 1_000  # one row at a time through the single-request path, on top of ...
N_EQUAL = 300  # ... seed-for-seed equality with the batched path
N_MUTANT = 10_000  # a sharpened q is a subtle error: it takes more draws to show


@pytest.fixture(scope="module")
def demo_dflash():
    return engine.load_pair(draft=DEMO_DIR / "dflash")


@pytest.mark.parametrize("k", MODES)
def test_greedy_equals_target_only_single_and_batched(demo_dflash, k):
    requests = greedy_requests(PROMPTS, k, 20, grow=4)
    single = check_greedy_exact(demo_dflash, requests, "dflash", max_batch=2, drafted=False)
    if k != "auto":
        accepted = [r.metrics["speculative_decoding"]["num_accepted_draft_tokens"] for r in single]
        assert sum(accepted) > 0


def test_other_drafters_still_work_beside_a_dflash_draft(demo_dflash):
    ids = demo_dflash.tokenizer.encode(PROMPTS[2])
    ref = reference_greedy(demo_dflash, ids, 24)
    for drafter in ("lookup", "none"):
        got = engine.generate(
            demo_dflash, GenerationRequest(prompt_ids=ids, max_tokens=24, drafter=drafter)
        )
        assert got.token_ids == ref
        assert got.metrics["speculative_decoding"]["drafter"] == drafter


def test_a_hybrid_qwen3_5_target_with_a_dflash_drafter_is_exact(tmp_path):
    # qwen3_5: gated delta-net layers between full-attention ones (recurrent rollback).
    tok, vocab = tokenizer_dir(tmp_path)
    target = build_model(tmp_path / "qwen3_5", "qwen3_5", vocab_size=vocab, tokenizer_from=tok)
    layers = json.loads((target / "config.json").read_text())["num_hidden_layers"]
    mx.random.seed(3)
    config = drafter_config(
        vocab_size=vocab,
        num_target_layers=layers,
        target_layer_ids=(0, layers - 1),
        block_size=4,
        mask_token_id=vocab - 1,
    )
    save_dflash(DFlashModel(config), tmp_path / "dflash")
    pair = engine.load_pair(target, tmp_path / "dflash")
    assert pair.dflash is not None
    ids_list = [pair.tokenizer.encode(p) for p in PROMPTS[:3]]
    for k in (1, 3, "auto"):
        requests = greedy_requests(ids_list, k, 16, grow=3)
        check_greedy_exact(pair, requests, "dflash", max_batch=2, drafted=k != "auto")


# -- the sampling law --------------------------------------------------------------------
def _v6_pair(tmp, target, name: str, seed: int, layers: int) -> ModelPair:
    """A 6-token target and a DFlash drafter with random weights reading its first
    `layers` layers."""
    config = drafter_config(
        **SMALL,
        vocab_size=VOCAB,
        num_target_layers=layers,
        target_layer_ids=tuple(range(layers)),
        mask_token_id=5,
    )

    def bind(t_model, tcfg):
        # The target's LM head is scaled up; the drafter's small final norm keeps its block
        # laws spread out (far from one-hot), so a wrong q shows in the statistics.
        write_spread_drafter(tmp / "d", config, seed)
        return load_dflash(tmp / "d", t_model, tcfg)

    return bound_pair(target, str(tmp / "d"), name, bind)


@pytest.fixture(scope="module")
def small_vocab_dflash(tmp_path_factory) -> ModelPair:
    tmp = tmp_path_factory.mktemp("v6dflash")
    target = build_llama(tmp / "t", vocab_size=VOCAB, hidden=16, layers=1, seed=11, scale=6.0)
    return _v6_pair(tmp, target, "v6", seed=21, layers=1)


@pytest.mark.slow
@pytest.mark.parametrize("rows", [chisquare.ROWS, 1])
def test_dflash_sampling_follows_the_target_law(small_vocab_dflash, rows):
    law = exact_law(small_vocab_dflash)
    assert min(law.values()) < 0.001 < max(law.values()), "the law should be far from uniform"
    n = N_DRAWS if rows > 1 else N_SINGLE
    counts = draw(small_vocab_dflash, n, seed0=5_000_000 + rows, rows=rows)
    assert chi_square_p(law, counts) > P_FAIL


def test_dflash_single_requests_draw_what_batched_rows_draw(small_vocab_dflash):
    """Seed for seed, so the single path's law is the batched path's law."""
    chisquare.single_equals_batched(
        small_vocab_dflash, N_EQUAL, 7_000_000, PROMPT, PARAMS, LENGTH, setups=MIXED_K
    )


def test_a_dflash_law_at_the_wrong_temperature_fails_the_test(small_vocab_dflash, monkeypatch):
    original = drafters.DFlashProposer.propose

    def wrong_law(self, want, positions, last):
        # Mutation: the q given to the acceptance rule is not the law the drafts were
        # drawn from (sharpened, as if taken at a quarter of the temperature).
        found, laws = original(self, want, positions, last)
        sharp = {k: q**4 / mx.sum(q**4, axis=-1, keepdims=True) for k, q in laws.items()}
        return found, sharp

    monkeypatch.setattr(drafters.DFlashProposer, "propose", wrong_law)
    counts = draw(small_vocab_dflash, N_MUTANT, seed0=6_000_000)
    assert chi_square_p(exact_law(small_vocab_dflash), counts) < P_FAIL
