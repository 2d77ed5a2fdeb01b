"""DFlash2 drafters (z-lab's DFlash2DraftModel) and DFlash drafters with sliding layers.

Tiny random drafters are written in the published layout (config.json with its fields in
dflash_config, bare codebook tensors, `attention_conv` / `mlp_conv` / `candidate_selector`
weights as z-lab's checkpoints name them) and loaded through engine.load_pair, so they take
the path a downloaded drafter takes. They must load, really draft, give the target's exact
greedy text and the target's law when sampling, single and batched, and a layout we do not
know must be refused in one line naming the field.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import mlx_lm
import numpy as np
import pytest
from conftest import script
from drafter_checks import (
    SMALL,
    TEXTS,
    bound_pair,
    check_greedy_exact,
    check_sampling_law,
    drafter_config,
    draw,
    family_target,
    greedy_requests,
    six_token_target,
)
from mlx.utils import tree_flatten
from test_engine_sampling import P_FAIL, PARAMS, PROMPT, VOCAB, chi_square_p, exact_law
from test_queue import read_jsonl, write_jobs
from tiny_models import build_llama

import engine
from engine import drafters
from engine.batch import SpeculativeDecoder
from engine.dflash import DFlashConfig, DFlashModel, drafter_kind, load_dflash, save_dflash
from engine.dflash2 import grouped_dynamic_convolve
from engine.loading import ModelPair
from engine.sampling import SamplingParams
from engine.types import ModelLoadError

HIDDEN = 64
COMPARE = Path(__file__).resolve().parent.parent / "scripts" / "compare_mlx_vlm_dflash.py"


def dflash2_config(vocab: int, layers: int, **over) -> DFlashConfig:
    """A tiny DFlash2 drafter shaped like z-lab's published one (all layers sliding,
    non-causal blocks, an output multiplier and a soft cap)."""
    base = dict(
        vocab_size=vocab,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        mask_token_id=vocab - 1,
        target_layer_ids=(0, layers - 1),
        num_target_layers=layers,
        layer_types=("sliding_attention", "sliding_attention"),
        sliding_window=64,
        kind="dflash2",
        is_causal=False,
        output_multiplier=0.5,
        final_logit_softcapping=20.0,
        conv_kernel_size=2,
        conv_group_size=16,
        selector_rank=8,
        selector_top_k=4,
    )
    base.update(over)
    return drafter_config(**base)


def write_drafter(path, config: DFlashConfig, seed: int = 0) -> DFlashModel:
    """Random weights; the convolutions' base kernels (zeros at init) made non-zero and
    the selector's codebooks scaled up, so both change the drafts."""
    mx.random.seed(seed)
    model = DFlashModel(config)
    if config.kind == "dflash2":
        for layer in model.layers:
            for conv in (layer.attention_conv, layer.mlp_conv):
                conv.base_kernel = 0.5 * mx.random.normal(conv.base_kernel.shape)
        sel = model.candidate_selector
        for book in (sel.predecessor_codebook, sel.successor_codebook):
            book.weight = 3.0 * book.weight
    save_dflash(model, path)
    return model


# ----------------------------------------------------------------------------- layout


def test_the_published_dflash2_layout_loads(tmp_path):
    target, vocab, layers = family_target(tmp_path, "llama")
    written = write_drafter(tmp_path / "d2", dflash2_config(vocab, layers))
    cfg = json.loads((tmp_path / "d2" / "config.json").read_text())
    assert cfg["architectures"] == ["DFlash2DraftModel"] and cfg["model_type"] == "qwen3"
    assert cfg["is_causal"] is False and "block_size" not in cfg
    assert cfg["dflash_config"] == {
        "mask_token_id": vocab - 1,
        "target_layer_ids": [0, layers - 1],
        "output_multiplier": 0.5,
        "final_logit_softcapping": 20.0,
        "block_size": 5,
        "conv_kernel_size": 2,
        "conv_group_size": 16,
        "selector_rank": 8,
        "selector_top_k": 4,
    }
    shapes = {k: v.shape for k, v in mx.load(str(tmp_path / "d2" / "model.safetensors")).items()}
    # The names and shapes of z-lab's DFlash2 checkpoints (kernel_projection: 2 * K * groups).
    assert shapes["candidate_selector.predecessor_codebook"] == (vocab, 8)
    assert shapes["candidate_selector.successor_codebook"] == (vocab, 8)
    assert shapes["candidate_selector.hidden_projection.weight"] == (8, HIDDEN)
    assert shapes["layers.1.attention_conv.base_kernel"] == (2, 2, HIDDEN)
    assert shapes["layers.0.mlp_conv.kernel_projection.weight"] == (2 * 2 * 4, HIDDEN)
    assert not any("embed" in k or "lm_head" in k for k in shapes)

    pair = engine.load_pair(target, tmp_path / "d2")
    assert pair.dflash.kind == "dflash2" and pair.info()["drafter"] == "dflash2"
    loaded = dict(tree_flatten(pair.dflash.model.parameters()))
    for name, value in tree_flatten(written.parameters()):
        assert mx.array_equal(loaded[name], value), name

    # model_type "dflash2" alone names the layout too, and the fields may sit at the top level.
    cfg["model_type"] = "dflash2"
    del cfg["architectures"]
    cfg.update(cfg.pop("dflash_config"))
    cfg["dflash_config"] = {k: cfg.pop(k) for k in ("mask_token_id", "target_layer_ids")}
    cfg["rope_is_neox_style"] = False  # interleaved pairs: what MLX calls "traditional"
    (tmp_path / "d2" / "config.json").write_text(json.dumps(cfg))
    again = load_dflash(tmp_path / "d2", pair.target, {"hidden_size": HIDDEN, "vocab_size": vocab})
    assert again.kind == "dflash2"
    assert again.config == dataclasses.replace(pair.dflash.config, rope_is_neox_style=False)
    assert again.model._rope.traditional and not pair.dflash.model._rope.traditional


def test_a_published_dflash2_config_reads_as_its_authors_wrote_it():
    """The fields of z-lab's DFlash2 config.json (a 5-layer drafter for a 52-layer target),
    as their checkpoint spells them."""
    published = {
        "architectures": ["DFlash2DraftModel"],
        "attention_bias": False,
        "is_causal": False,
        "dflash_config": {
            "block_size": 16,
            "conv_group_size": 16,
            "conv_kernel_size": 2,
            "final_logit_softcapping": 20.0,
            "mask_token_id": 201818,
            "output_multiplier": 0.19611613513818404,
            "selector_rank": 256,
            "selector_top_k": 16,
            "target_layer_ids": [1, 13, 25, 37, 49],
        },
        "head_dim": 128,
        "hidden_act": "silu",
        "hidden_size": 6656,
        "intermediate_size": 19968,
        "layer_types": ["sliding_attention"] * 5,
        "max_position_embeddings": 131072,
        "model_type": "qwen3",
        "num_attention_heads": 32,
        "num_hidden_layers": 5,
        "num_key_value_heads": 8,
        "num_target_layers": 52,
        "rms_norm_eps": 1e-05,
        "rope_parameters": {"rope_theta": 500000.0, "rope_type": "default"},
        "sliding_window": 2048,
        "tie_word_embeddings": False,
        "use_sliding_window": True,
        "vocab_size": 202048,
    }
    c = DFlashConfig.from_dict(published, drafter_kind(published))
    assert (c.kind, c.block_size, c.mask_token_id, c.num_target_layers) == (
        "dflash2",
        16,
        201818,
        52,
    )
    assert (c.conv_kernel_size, c.conv_group_size, c.selector_rank, c.selector_top_k) == (
        2,
        16,
        256,
        16,
    )
    assert (c.rope_theta, c.sliding_window, c.is_causal) == (500000.0, 2048, False)
    assert (c.final_logit_softcapping, c.output_multiplier) == (20.0, 0.19611613513818404)
    assert not any(c.causal_of(i) for i in range(5)) and c.window_of(4) == 2048


@pytest.mark.parametrize(
    "edit, message",
    [
        (
            lambda c: c["dflash_config"].pop("selector_top_k"),
            "DFlash2 config.json: missing field 'selector_top_k' (top level or in dflash_config)",
        ),
        (
            lambda c: c.update(layer_types=["sliding_attention", "chunked_attention"]),
            "DFlash2 config.json: layer_types[1] is 'chunked_attention', a layer kind specfleet "
            "does not know (known: full_attention, sliding_attention)",
        ),
        (
            lambda c: c.pop("sliding_window"),
            "DFlash2 config.json: missing field 'sliding_window' (layer_types has "
            "sliding_attention layers)",
        ),
        (
            lambda c: c["dflash_config"].update(conv_group_size=24),
            "DFlash2 conv_group_size 24 does not divide hidden_size 64",
        ),
        (
            lambda c: c.update(architectures=["DSparkDraftModel"]),
            "config.json: architectures ['DSparkDraftModel'] is not a drafter layout specfleet "
            "knows (DFlashDraftModel, DFlash2DraftModel)",
        ),
    ],
)
def test_a_layout_we_do_not_know_is_refused_naming_the_field(tmp_path, edit, message):
    target, vocab, layers = family_target(tmp_path, "llama")
    write_drafter(tmp_path / "d2", dflash2_config(vocab, layers))
    cfg = json.loads((tmp_path / "d2" / "config.json").read_text())
    edit(cfg)
    (tmp_path / "d2" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError) as err:
        engine.load_pair(target, tmp_path / "d2")
    assert str(err.value).endswith(message) and "\n" not in str(err.value)


# ----------------------------------------------------------------------------- the forward


def test_the_dynamic_convolution_is_the_published_formula():
    """out[t, c] = sum_o (base[o, c] + dyn[t, o, c // group]) * x[t - o, c], x[<0] = 0."""
    rng = np.random.default_rng(0)
    b, n, h, k, g = 2, 5, 8, 3, 4
    x, dyn, base = (
        rng.normal(size=s).astype(np.float32) for s in ((b, n, h), (b, n, k, h // g), (k, h))
    )
    want = np.zeros_like(x)
    for t in range(n):
        for o in range(min(k, t + 1)):
            want[:, t] += (base[o] + np.repeat(dyn[:, t, o], g, axis=-1)) * x[:, t - o]
    got = grouped_dynamic_convolve(mx.array(x), mx.array(dyn), mx.array(base), g)
    assert np.allclose(np.array(got), want, atol=1e-5)


def test_the_selector_chain_rescores_candidates_given_the_previous_draft(tmp_path):
    target, vocab, layers = family_target(tmp_path, "llama")
    write_drafter(tmp_path / "d2", dflash2_config(vocab, layers, selector_top_k=6))
    pair = engine.load_pair(target, tmp_path / "d2")
    drafter = pair.dflash
    with drafter.capture(pair.target) as cap:
        pair.target(mx.array([[5, 9, 11, 40, 2, 7]]))
    state = drafter.new_state(1)
    state.extend(cap.features, [6])
    tokens, _ = drafter.draft_chain(state, [7], 4, [], [], [], [])
    # The same chain written out from the definition, one position at a time.
    sel = drafter.model.candidate_selector
    hidden = state.block_hidden([7])[0, :4]
    logits = np.array(drafter.logits(hidden))
    proj = np.array(sel.hidden_projection(hidden))
    pred_cb, succ_cb = (
        np.array(sel.predecessor_codebook.weight),
        np.array(sel.successor_codebook.weight),
    )
    prev, want = 7, []
    for j in range(4):
        cands = np.argsort(-logits[j])[:6]
        scores = logits[j, cands] + (succ_cb[cands] * (pred_cb[prev] * proj[j])).sum(-1)
        prev = int(cands[np.argmax(scores)])
        want.append(prev)
    assert tokens.tolist()[0] == want
    # The edges matter: the plain argmax of the LM head differs somewhere.
    assert want != np.argmax(logits, axis=-1).tolist()


# ----------------------------------------------------------------------------- exactness


@pytest.mark.parametrize("family", ["llama", "qwen3_5"])
def test_dflash2_greedy_equals_target_only_single_and_batched(tmp_path, family):
    target, vocab, layers = family_target(tmp_path, family)
    write_drafter(tmp_path / "d2", dflash2_config(vocab, layers, sliding_window=6), seed=3)
    pair = engine.load_pair(target, tmp_path / "d2")
    ids_list = [pair.tokenizer.encode(t) for t in TEXTS]
    for k in (1, 4):
        requests = greedy_requests(ids_list, k, 14, grow=3)
        check_greedy_exact(pair, requests, "dflash2", max_batch=2)  # rows join mid-batch


# -- the sampling law on a 6-token vocabulary ----------------------------------------------
def _v6_pair(tmp, target, name: str, config: DFlashConfig) -> ModelPair:
    def bind(t_model, tcfg):
        write_drafter(tmp / "d", config, seed=21)
        return load_dflash(tmp / "d", t_model, tcfg)

    return bound_pair(target, str(tmp / "d"), name, bind)


def _small(layers: int, **over) -> DFlashConfig:
    base = dict(
        **SMALL,
        conv_group_size=8,
        selector_rank=4,
        output_multiplier=0.3,
        target_layer_ids=tuple(range(layers)),
    )
    base.update(over)
    return dflash2_config(VOCAB, layers, **base)


@pytest.fixture(scope="module")
def v6_dflash2(tmp_path_factory) -> ModelPair:
    tmp = tmp_path_factory.mktemp("v6dflash2")
    target = build_llama(tmp / "t", vocab_size=VOCAB, hidden=16, layers=1, seed=11, scale=6.0)
    return _v6_pair(tmp, target, "v6d2", _small(1, sliding_window=3))


@pytest.fixture(scope="module")
def v6_hybrid_dflash2(tmp_path_factory) -> ModelPair:
    """The same on a hybrid target: qwen3_5 (gated delta-net + full attention), 6 tokens."""
    tmp = tmp_path_factory.mktemp("v6hybrid2")
    target = six_token_target(tmp, "qwen3_5")
    return _v6_pair(tmp, target, "h6d2", _small(2, sliding_window=3))


@pytest.mark.slow
def test_dflash2_sampling_follows_the_target_law(v6_dflash2):
    check_sampling_law(v6_dflash2, 6_000, 12_000_000, 100, 13_000_000)


@pytest.mark.slow
def test_dflash2_sampling_on_a_hybrid_target_follows_its_law(v6_hybrid_dflash2):
    check_sampling_law(v6_hybrid_dflash2, 6_000, 17_000_000, 100, 18_000_000)


def test_a_dflash2_law_that_ignores_the_chain_fails_the_test(v6_dflash2, monkeypatch):
    original = drafters.DFlashProposer._propose_chain

    def wrong_law(self, want, positions, last, depth):
        # Mutation: every position's q is the first position's law, as if the later
        # drafts did not depend on the ones before them.
        found, laws = original(self, want, positions, last, depth)
        return found, {k: mx.broadcast_to(q[:1], q.shape) for k, q in laws.items()}

    monkeypatch.setattr(drafters.DFlashProposer, "_propose_chain", wrong_law)
    law = exact_law(v6_dflash2)
    assert chi_square_p(law, draw(v6_dflash2, 6_000, seed0=14_000_000)) < P_FAIL


def test_greedy_on_the_small_vocabulary_accepts_drafts_and_stays_exact(v6_dflash2):
    dec = SpeculativeDecoder(
        v6_dflash2, PROMPT, SamplingParams(), num_draft_tokens=3, max_tokens=24
    )
    steps = list(dec.steps())
    got = [t for s in steps for t in s.tokens][:24]
    cache = mlx_lm.models.cache.make_prompt_cache(v6_dflash2.target)
    logits = v6_dflash2.target(mx.array([PROMPT]), cache=cache)
    ref = []
    for _ in range(24):
        ref.append(int(mx.argmax(logits[0, -1]).item()))
        logits = v6_dflash2.target(mx.array([[ref[-1]]]), cache=cache)
    assert got == ref
    assert sum(s.accepted for s in steps) > 0


# ----------------------------------------------------------------------------- end to end


def test_spec_run_with_a_dflash2_draft_names_it_in_every_result(tmp_path):
    target, vocab, layers = family_target(tmp_path, "llama")
    write_drafter(tmp_path / "d2", dflash2_config(vocab, layers))
    jobs = write_jobs(
        tmp_path / "jobs.jsonl",
        [
            {"custom_id": "g", "prompt": TEXTS[0], "max_tokens": 8, "temperature": 0},
            {
                "custom_id": "s",
                "prompt": TEXTS[1],
                "max_tokens": 8,
                "temperature": 0.8,
                "seed": 3,
                "speculative": {"num_draft_tokens": 3},
            },
        ],
    )
    out = tmp_path / "out.jsonl"
    args = ["--target", str(target), "--draft", str(tmp_path / "d2")]
    result = subprocess.run(
        [script("spec-run"), jobs, "-o", str(out), *args],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    lines = {x["custom_id"]: x for x in read_jsonl(out)}
    for line in lines.values():
        sd = line["response"]["body"]["metrics"]["speculative_decoding"]
        assert sd["drafter"] == "dflash2"
    assert lines["s"]["response"]["body"]["metrics"]["speculative_decoding"]["num_draft_tokens"]


@pytest.mark.skipif(
    not os.environ.get("SPEC_MLX_VLM"),
    reason="set SPEC_MLX_VLM to a directory holding mlx_vlm/ (an unzipped mlx-vlm wheel)",
)
def test_drafts_equal_mlx_vlm_drafts_step_by_step():
    """Greedy, full blocks, same tiny weights: every verify step's drafts and acceptance
    equal those of mlx-vlm's own DFlash and DFlash2 drafter classes."""
    result = subprocess.run(
        [sys.executable, str(COMPARE), "--mlx-vlm", os.environ["SPEC_MLX_VLM"]],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "dflash2: 153/153 verify steps" in result.stdout


def test_spec_worker_with_a_dflash2_draft_says_so_and_serves_a_batch(
    redis_env, start_worker, tmp_path
):
    target, vocab, layers = family_target(tmp_path, "llama")
    write_drafter(tmp_path / "d2", dflash2_config(vocab, layers))
    lines = [
        {"custom_id": f"l{i}", "prompt": t, "max_tokens": 6, "temperature": 0.5 * i, "seed": i}
        for i, t in enumerate(TEXTS)
    ]
    jobs = write_jobs(tmp_path / "jobs.jsonl", lines)
    batch = redis_env.batch_id("d2")
    submitted = redis_env.run("spec-submit", jobs, "--batch-id", batch, "--model", "tiny")
    assert submitted.returncode == 0, submitted.stderr
    args = ["--target", str(target), "--draft", str(tmp_path / "d2"), "--alias", "tiny"]
    worker = start_worker("--burst", "--batch", "4", *args)
    assert worker.wait(timeout=300) == 0, worker.log
    assert "'drafter': 'dflash2'" in worker.log  # the start-up line names the kind
    out = tmp_path / "r.jsonl"
    assert redis_env.run("spec-collect", batch, "-o", str(out)).returncode == 0
    results = read_jsonl(out)
    assert [r["custom_id"] for r in results] == [x["custom_id"] for x in lines]
    for r in results:
        assert r["response"]["body"]["metrics"]["speculative_decoding"]["drafter"] == "dflash2"


def test_spec_doctor_names_the_dflash2_drafter(tmp_path):
    from worker import doctor

    target, vocab, layers = family_target(tmp_path, "llama")
    write_drafter(tmp_path / "d2", dflash2_config(vocab, layers))
    check, pair = doctor.load(str(target), str(tmp_path / "d2"))
    assert check.status == "OK"
    assert "draft: DFlash2 block drafter (dflash2), block size 5" in check.message
    assert "draft: DFlash2, block size 5" in doctor.check_features(pair).message


def test_sampled_rows_draw_the_same_beside_greedy_rows(v6_dflash2):
    """A batch mixing greedy and sampled rows: each sampled row draws, seed for seed, what
    it draws alone, and each greedy row is the target's greedy text."""
    from engine.batch import BatchDecoder

    greedy_ref = [
        t
        for s in SpeculativeDecoder(
            v6_dflash2, PROMPT, SamplingParams(), num_draft_tokens=3, max_tokens=8
        ).steps()
        for t in s.tokens
    ][:8]
    batch = BatchDecoder(v6_dflash2)
    seeds = range(40)
    for seed in seeds:
        params = SamplingParams() if seed % 2 else PARAMS
        batch.add(
            seed, PROMPT, params, seed=seed, drafter="model", num_draft_tokens=3, max_tokens=8
        )
    got = {s: [] for s in seeds}
    while any(len(v) < 8 for v in got.values()):
        for key, step in batch.step().items():
            got[key].extend(step.tokens)
    for seed in seeds:
        if seed % 2:
            assert got[seed][:8] == greedy_ref, seed
            continue
        alone = SpeculativeDecoder(
            v6_dflash2, PROMPT, PARAMS, seed=seed, num_draft_tokens=3, max_tokens=8
        )
        assert got[seed][:8] == [t for s in alone.steps() for t in s.tokens][:8], seed
