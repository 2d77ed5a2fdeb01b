"""DFlash block drafters: published layout, checks against the target, features, batched context.

Tiny random targets are built in the test; the drafters are written in the published layout
(config.json + model.safetensors with the names `fc`, `hidden_norm`, `layers.*`, `norm`).
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import mlx_lm
import pytest
from drafter_checks import drafter_config
from mlx.utils import tree_flatten
from mlx_lm.models.cache import make_prompt_cache
from tiny_models import build_llama

import engine
from engine.dflash import (
    DFlashDrafter,
    DFlashModel,
    greedy_reference,
    is_dflash_dir,
    load_dflash,
    save_dflash,
)
from engine.families import make_ragged_cache
from engine.loading import DEMO_DIR
from engine.types import ModelLoadError

VOCAB = 96
HIDDEN = 64


def write_drafter(path: Path, seed: int = 0, **over) -> DFlashModel:
    mx.random.seed(seed)
    model = DFlashModel(drafter_config(**over))
    save_dflash(model, path)
    return model


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    path = build_llama(
        tmp_path_factory.mktemp("t") / "target", vocab_size=VOCAB, hidden=HIDDEN, layers=3
    )
    model, config = mlx_lm.utils.load_model(path)
    return model, config


def test_published_layout_is_recognised_and_loads(tmp_path, llama):
    target, tcfg = llama
    written = write_drafter(tmp_path / "d")
    names = {k for k, _ in tree_flatten(written.parameters())}
    assert {"fc.weight", "hidden_norm.weight", "norm.weight"} <= names
    assert "layers.1.self_attn.k_norm.weight" in names and "layers.0.mlp.down_proj.weight" in names
    assert not any("embed" in n or "lm_head" in n for n in names)
    cfg = json.loads((tmp_path / "d" / "config.json").read_text())
    assert cfg["architectures"] == ["DFlashDraftModel"]
    assert cfg["dflash_config"] == {"mask_token_id": 3, "target_layer_ids": [0, 2]}
    assert is_dflash_dir(tmp_path / "d") and not is_dflash_dir(tmp_path)

    # block_size may sit inside dflash_config instead of at the top level
    cfg["dflash_config"]["block_size"] = cfg.pop("block_size")
    (tmp_path / "d" / "config.json").write_text(json.dumps(cfg))
    drafter = load_dflash(tmp_path / "d", target, tcfg)
    assert drafter.block_size == 5 and drafter.mask_token_id == 3
    loaded = dict(tree_flatten(drafter.model.parameters()))
    for name, value in tree_flatten(written.parameters()):
        assert mx.array_equal(loaded[name], value), name


def test_load_pair_detects_a_dflash_draft(tmp_path):
    build_llama(tmp_path / "t", vocab_size=VOCAB, hidden=HIDDEN, layers=3)
    (tmp_path / "t" / "tokenizer.json").write_bytes(
        (DEMO_DIR / "target" / "tokenizer.json").read_bytes()
    )
    (tmp_path / "t" / "tokenizer_config.json").write_bytes(
        (DEMO_DIR / "target" / "tokenizer_config.json").read_bytes()
    )
    write_drafter(tmp_path / "d")
    pair = engine.load_pair(tmp_path / "t", tmp_path / "d")
    assert pair.draft is None
    assert pair.dflash is not None and pair.dflash.kind == "dflash"
    assert pair.draft_path == str(tmp_path / "d")


@pytest.mark.parametrize(
    "over, message",
    [
        (
            dict(target_layer_ids=(0, 3)),
            "DFlash drafter reads target layer 3, but the target has 3 layers (0..2)",
        ),
        (
            dict(hidden_size=32, head_dim=8),
            "DFlash drafter hidden_size 32 differs from the target's hidden_size 64",
        ),
        (
            dict(vocab_size=100),
            "DFlash drafter vocab_size 100 differs from the target's vocab_size 96",
        ),
        (
            dict(num_target_layers=4),
            "DFlash drafter was made for a target of 4 layers, the target has 3",
        ),
        (
            dict(mask_token_id=96),
            "DFlash mask_token_id 96 is outside the target's vocabulary (0..95)",
        ),
    ],
)
def test_a_drafter_for_another_target_is_refused_naming_both_values(tmp_path, llama, over, message):
    target, tcfg = llama
    write_drafter(tmp_path / "d", **over)
    with pytest.raises(ModelLoadError) as err:
        load_dflash(tmp_path / "d", target, tcfg)
    assert str(err.value) == message


@pytest.mark.parametrize("bits", [4, 8])
def test_quantized_drafter_loads_and_computes_like_the_quantized_model(tmp_path, llama, bits):
    target, tcfg = llama
    model = write_drafter(tmp_path / "d", intermediate_size=128)
    nn.quantize(model, group_size=32, bits=bits)
    weights = dict(tree_flatten(model.parameters()))
    mx.save_safetensors(str(tmp_path / "d" / "model.safetensors"), weights)
    cfg = json.loads((tmp_path / "d" / "config.json").read_text())
    cfg["quantization"] = {"group_size": 32, "bits": bits}
    (tmp_path / "d" / "config.json").write_text(json.dumps(cfg))

    drafter = load_dflash(tmp_path / "d", target, tcfg)
    assert isinstance(drafter.model.fc, nn.QuantizedLinear) and drafter.model.fc.bits == bits
    feats = mx.random.normal((1, 6, 2 * HIDDEN), key=mx.random.key(1))
    state = drafter.new_state(1)
    state.extend(feats, [6])
    ref = DFlashDrafter(model, target).new_state(1)
    ref.extend(feats, [6])
    assert mx.allclose(state.block_logits([7]), ref.block_logits([7]), atol=1e-5)


def test_incomplete_weights_are_a_load_error(tmp_path, llama):
    target, tcfg = llama
    model = write_drafter(tmp_path / "d")
    weights = {k: v for k, v in tree_flatten(model.parameters()) if k != "norm.weight"}
    mx.save_safetensors(str(tmp_path / "d" / "model.safetensors"), weights)
    with pytest.raises(ModelLoadError) as info:
        load_dflash(tmp_path / "d", target, tcfg)
    # One line (mlx's message breaks before the names), naming the missing tensor.
    assert str(info.value) == (
        f"DFlash drafter {tmp_path / 'd'}: weights do not match config: "
        "Missing 1 parameters: norm.weight."
    )


# ----------------------------------------------------------------------------- features


def test_capture_returns_logits_and_the_named_layer_outputs(tmp_path, llama):
    target, tcfg = llama
    write_drafter(tmp_path / "d", target_layer_ids=(1, 2))
    drafter = load_dflash(tmp_path / "d", target, tcfg)
    x = mx.array([[5, 9, 11, 40, 2, 7]])
    plain = target(x)
    with drafter.capture(target) as cap:
        logits = target(x, cache=make_prompt_cache(target))
    assert mx.allclose(logits, plain, atol=1e-5)
    feats = cap.features
    assert feats.shape == (1, 6, 2 * HIDDEN)
    # The last layer's output, normed, is what the LM head reads.
    assert mx.allclose(target.model.norm(feats[..., HIDDEN:]), target.model(x), atol=1e-5)
    assert all(type(layer).__name__ == "TransformerBlock" for layer in target.model.layers)


def test_capture_works_with_the_ragged_batched_cache(tmp_path, llama):
    target, tcfg = llama
    write_drafter(tmp_path / "d")
    drafter = load_dflash(tmp_path / "d", target, tcfg)
    x = mx.array([[5, 9, 11, 40], [8, 8, 1, 30]])
    rows, caches = make_ragged_cache(target.model, 2)
    with drafter.capture(target) as cap:
        target(x, cache=caches)
        rows.advance(4, [4, 4])
        target(mx.array([[6], [12]]), cache=caches)
        step = cap.features
    for i in range(2):
        with drafter.capture(target) as cap:
            target(mx.concatenate([x[i : i + 1], mx.array([[[6], [12]][i]])], axis=1))
        assert mx.allclose(step[i, 0], cap.features[0, -1], atol=1e-4)


def test_capture_on_a_hybrid_qwen3_5_target(tmp_path):
    from mlx_lm.models import qwen3_5

    args = qwen3_5.ModelArgs.from_dict(
        {
            "model_type": "qwen3_5",
            "hidden_size": HIDDEN,
            "intermediate_size": 128,
            "num_hidden_layers": 4,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 16,
            "vocab_size": VOCAB,
            "linear_num_value_heads": 4,
            "linear_num_key_heads": 2,
            "linear_key_head_dim": 16,
            "linear_value_head_dim": 16,
            "full_attention_interval": 2,
            "tie_word_embeddings": False,
        }
    )
    mx.random.seed(0)
    target = qwen3_5.Model(args)
    tcfg = {"text_config": {"hidden_size": HIDDEN, "vocab_size": VOCAB}}
    write_drafter(tmp_path / "d", target_layer_ids=(1, 3), num_target_layers=4)
    drafter = load_dflash(tmp_path / "d", target, tcfg)
    assert drafter.lm_head is target.language_model.lm_head
    x = mx.array([[5, 9, 11, 40, 2]])
    with drafter.capture(target) as cap:
        logits = target(x, cache=target.make_cache())
    assert mx.allclose(logits, target(x), atol=1e-4)
    inner = target.language_model.model
    assert mx.allclose(inner.norm(cap.features[..., HIDDEN:]), inner(x), atol=1e-4)
    state = drafter.new_state(1)
    state.extend(cap.features, [5])
    assert state.block_logits([2]).shape == (1, 4, VOCAB)


# ----------------------------------------------------------------------------- batched context


def test_batched_context_rows_match_the_same_row_alone(tmp_path, llama):
    """Rows extended with different keeps, leaving and joining, draft as if they were alone."""
    target, tcfg = llama
    write_drafter(tmp_path / "d", block_size=4)
    drafter = load_dflash(tmp_path / "d", target, tcfg)
    width = 2 * HIDDEN
    key = iter(mx.random.split(mx.random.key(7), 32))

    def feats(b, w):
        return mx.random.normal((b, w, width), key=next(key))

    history: dict[str, list[mx.array]] = {"a": [], "b": [], "c": [], "d": []}
    names = ["a", "b", "c"]
    state = drafter.new_state(3)

    def extend(state, names, f, keep):
        state.extend(f, keep)
        for i, n in enumerate(names):
            history[n].append(f[i, : keep[i]])

    extend(state, names, feats(3, 7), [7, 3, 5])  # prefill of different lengths
    extend(state, names, feats(3, 4), [1, 4, 2])
    extend(state, names, feats(3, 4), [4, 1, 1])
    state.select([2, 0])  # b finished
    names = ["c", "a"]
    joining = drafter.new_state(1)
    extend(joining, ["d"], feats(1, 9), [9])  # d joins with its prompt's features
    state.append(joining)
    names = names + ["d"]
    extend(state, names, feats(3, 4), [2, 3, 1])
    extend(state, names, feats(3, 4), [0, 1, 4])
    state.compact()
    assert state.lengths() == [sum(h.shape[0] for h in history[n]) for n in names]

    last = [11, 12, 13]
    batched = state.block_logits(last)
    assert batched.shape == (3, 3, VOCAB)
    for i, n in enumerate(names):
        alone = drafter.new_state(1)
        alone.extend(mx.concatenate(history[n])[None], [sum(h.shape[0] for h in history[n])])
        assert mx.allclose(batched[i], alone.block_logits([last[i]])[0], atol=1e-4), n


def test_block_positions_see_the_whole_block(tmp_path, llama):
    # Attention inside the block is bidirectional: position 1's logits depend on the masks
    # after it, so changing block size changes them (a causal block would not).
    target, tcfg = llama
    write_drafter(tmp_path / "d4", block_size=4)
    write_drafter(tmp_path / "d6", block_size=6)
    f = mx.random.normal((1, 5, 2 * HIDDEN), key=mx.random.key(3))
    out = []
    for d in ("d4", "d6"):
        s = load_dflash(tmp_path / d, target, tcfg).new_state(1)
        s.extend(f, [5])
        out.append(s.block_logits([9])[0, 0])
    assert not mx.allclose(out[0], out[1], atol=1e-4)


def test_sliding_layers_ignore_context_outside_the_window(tmp_path, llama):
    target, tcfg = llama
    write_drafter(
        tmp_path / "d",
        num_hidden_layers=1,
        layer_types=("sliding_attention",),
        sliding_window=6,
    )
    drafter = load_dflash(tmp_path / "d", target, tcfg)
    f = mx.random.normal((1, 12, 2 * HIDDEN), key=mx.random.key(4))
    g = f.at[:, :7].add(5.0)  # positions 0..6: no block query (12..16) is within 6 of them
    outs = []
    for x in (f, g):
        s = drafter.new_state(1)
        s.extend(x, [12])
        outs.append(s.block_logits([9]))
    # Query at position 12 sees context keys 7..11, the last block position (16) only 11.
    assert mx.allclose(outs[0], outs[1], atol=1e-6)
    h = f.at[:, 9].add(5.0)
    s = drafter.new_state(1)
    s.extend(h, [12])
    assert not mx.allclose(outs[0], s.block_logits([9]), atol=1e-4)


# ----------------------------------------------------------------------------- exactness


def target_greedy(target, prompt: list[int], n: int) -> list[int]:
    cache = make_prompt_cache(target)
    logits = target(mx.array([prompt]), cache=cache)
    out = []
    for _ in range(n):
        tok = int(mx.argmax(logits[0, -1]).item())
        out.append(tok)
        logits = target(mx.array([[tok]]), cache=cache)
    return out


def test_greedy_speculation_with_a_random_drafter_equals_target_only(tmp_path, llama):
    target, tcfg = llama
    write_drafter(tmp_path / "d", block_size=4)
    drafter = load_dflash(tmp_path / "d", target, tcfg)
    prompt = [5, 9, 11, 40, 2, 7]
    out, stats = greedy_reference(target, drafter, prompt, 24)
    assert out == target_greedy(target, prompt, 24)
    assert stats["target_passes"] == len(stats["accepted"])


def test_the_reference_loop_takes_a_wholly_accepted_block(tmp_path, llama, monkeypatch):
    """A drafter whose every block is right: each pass emits block_size tokens."""
    from engine import dflash

    target, tcfg = llama
    write_drafter(tmp_path / "d", block_size=4)
    drafter = load_dflash(tmp_path / "d", target, tcfg)
    prompt = [5, 9, 11, 40, 2, 7]
    ref = target_greedy(target, prompt, 30)
    calls = []

    def perfect(self, last_tokens, embed=None, lm_head=None):
        start = 1 + 4 * len(calls)  # every earlier block was wholly accepted
        calls.append(start)
        nxt = (ref + [0] * 8)[start : start + 3]
        return mx.eye(tcfg["vocab_size"])[mx.array(nxt)][None] * 10

    monkeypatch.setattr(dflash.DFlashState, "block_logits", perfect)
    out, stats = greedy_reference(target, drafter, prompt, 25)
    assert out == ref[:25]
    assert stats["accepted"][:6] == [3] * 6


def test_demo_dflash_drafter_is_exact_and_drafts_more_than_one_token_per_pass(capsys):
    """The shipped demo drafter on the demo target: greedy output equals target-only."""
    pair = engine.load_pair(draft=DEMO_DIR / "dflash")
    assert pair.dflash is not None and pair.dflash.block_size == 8
    prompt = pair.tokenizer.encode("def parse_header(line):\n    ")
    out, stats = greedy_reference(pair.target, pair.dflash, prompt, 64)
    assert out == target_greedy(pair.target, prompt, 64)
    per_pass = sum(a + 1 for a in stats["accepted"]) / stats["target_passes"]
    with capsys.disabled():
        print(f"\ndemo DFlash drafter: {per_pass:.2f} tokens per target pass (greedy)")
    assert per_pass > 1.2
