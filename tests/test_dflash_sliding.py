"""DFlash drafters with sliding-window layers (the Gemma 4 drafters' layout: `layer_types`
with `sliding_attention`, `sliding_window`) on a gemma3_text target, itself sliding-window.

z-lab's rule, which this follows: in a sliding layer a block position sees the context
keys less than `sliding_window` positions before it, and, unless config.json says
`is_causal`, only the block positions up to itself; full layers see the whole context and
the whole block. Texts run well past both windows, so holes left by rejected drafts and
the window's edge are both exercised.
"""

from __future__ import annotations

import mlx.core as mx
import pytest
from drafter_checks import (
    SMALL,
    TEXTS,
    bound_pair,
    check_greedy_exact,
    check_sampling_law,
    drafter_config,
    family_target,
    greedy_requests,
    six_token_target,
    write_spread_drafter,
)
from test_engine_sampling import VOCAB

import engine
from engine.dflash import DFlashModel, load_dflash, save_dflash
from engine.loading import ModelPair

SLIDING = ("sliding_attention", "full_attention")


def write_sliding(path, vocab: int, layers: int, seed: int = 0, **over) -> None:
    mx.random.seed(seed)
    settings = dict(
        vocab_size=vocab,
        num_target_layers=layers,
        target_layer_ids=(0, layers - 1),
        block_size=4,
        mask_token_id=vocab - 1,
        layer_types=SLIDING,
        sliding_window=4,
    )
    config = drafter_config(**{**settings, **over})
    save_dflash(DFlashModel(config), path)


@pytest.fixture(scope="module")
def gemma_pair(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("gemma")
    target, vocab, layers = family_target(tmp, "gemma3_text")
    write_sliding(tmp / "d", vocab, layers, seed=5)
    return engine.load_pair(target, tmp / "d")


def test_sliding_layers_are_causal_inside_the_block_unless_the_config_says_not(gemma_pair):
    drafter = gemma_pair.dflash
    assert drafter.kind == "dflash" and drafter.info()["sliding_window"] == 4
    assert [drafter.config.causal_of(i) for i in (0, 1)] == [True, False]
    with drafter.capture(gemma_pair.target) as cap:
        gemma_pair.target(mx.array([[5, 9, 11, 40, 2, 7, 8, 30]]))
    state = drafter.new_state(1)
    state.extend(cap.features, [8])
    layer0 = state._mask(0, state.length[:, None] + mx.arange(4)[None, :])[0]
    # Block position 2 (true position 10) sees context 7 only (10 - p < 4), block 0..2.
    assert layer0[2].tolist() == [False] * 7 + [True] + [True, True, True, False]
    layer1 = state._mask(1, state.length[:, None] + mx.arange(4)[None, :])[0]
    assert layer1[2].tolist() == [True] * 12


def test_sliding_dflash_on_gemma3_text_is_exact_past_both_windows(gemma_pair):
    pair = gemma_pair
    ids_list = [pair.tokenizer.encode(t) for t in TEXTS]
    for k in (1, 3):
        requests = greedy_requests(ids_list, k, 30, grow=4)
        check_greedy_exact(pair, requests, "dflash", max_batch=2)


@pytest.fixture(scope="module")
def v6_gemma(tmp_path_factory) -> ModelPair:
    """A 6-token gemma3_text target and a sliding DFlash drafter whose window (2) is
    shorter than the texts."""
    tmp = tmp_path_factory.mktemp("v6gemma")
    target = six_token_target(tmp, "gemma3_text")
    config = drafter_config(
        **SMALL,
        vocab_size=VOCAB,
        num_target_layers=2,
        target_layer_ids=(0, 1),
        mask_token_id=5,
        layer_types=SLIDING,
        sliding_window=2,
    )

    def bind(t_model, tcfg):
        write_spread_drafter(tmp / "d", config, seed=23)
        return load_dflash(tmp / "d", t_model, tcfg)

    return bound_pair(target, str(tmp / "d"), "g6", bind)


@pytest.mark.slow
def test_sliding_dflash_sampling_on_gemma3_text_follows_its_law(v6_gemma):
    check_sampling_law(v6_gemma, 6_000, 15_000_000, 100, 16_000_000)


def test_a_drafter_whose_every_layer_slides_lets_go_of_old_context(gemma_pair, tmp_path):
    """Slots a row has moved a window past are never seen again: they are dropped, and the
    drafts are what the whole context gives."""
    target, vocab, layers = family_target(tmp_path, "gemma3_text")
    write_sliding(
        tmp_path / "d", vocab, layers, layer_types=("sliding_attention",) * 2, sliding_window=3
    )
    drafter = load_dflash(tmp_path / "d", gemma_pair.target, {"hidden_size": 64})
    assert drafter.info()["sliding_window"] == 3
    feats = mx.random.normal((2, 300, 2 * 64), key=mx.random.key(2))
    trimmed, whole = drafter.new_state(2), drafter.new_state(2)
    whole.horizon = None  # keeps every slot
    for start in range(0, 300, 4):
        for state in (trimmed, whole):
            state.extend(feats[:, start : start + 4], [4, 1 + start % 3])
    assert trimmed.lengths() == whole.lengths() == [300, 75 + 75]
    assert trimmed.used < whole.used == 300
    assert mx.allclose(trimmed.block_logits([3, 4]), whole.block_logits([3, 4]), atol=1e-5)
