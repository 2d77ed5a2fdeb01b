"""Tiny random models of each family, built with mlx-lm's own model classes.

Every family the engine claims is built here in the standard layout (config.json,
model.safetensors, tokenizer files) and loaded through engine.load_pair, so the
tests exercise the same path a user's model takes. Sizes are tiny on purpose: a
test of one family runs in seconds on a 2-core CPU.
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_map
from tiny_models import build_tokenizer

import engine  # noqa: F401  (loads the fast BLAS before mlx)

#: Sliding window of the tiny gemma3_text: test texts run well past it.
WINDOW = 8

_ATTN = {"num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32}

CONFIGS: dict[str, dict] = {
    "llama": {
        "model_type": "llama",
        "num_hidden_layers": 2,
        "intermediate_size": 128,
        "num_attention_heads": 2,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
    },
    "qwen3": {
        "model_type": "qwen3",
        "num_hidden_layers": 2,
        "intermediate_size": 128,
        **_ATTN,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
    },
    "qwen3_moe": {
        "model_type": "qwen3_moe",
        "num_hidden_layers": 2,
        "intermediate_size": 128,
        **_ATTN,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "norm_topk_prob": True,
    },
    "gemma3_text": {
        "model_type": "gemma3_text",
        "num_hidden_layers": 4,
        "intermediate_size": 128,
        **_ATTN,
        "rms_norm_eps": 1e-6,
        "query_pre_attn_scalar": 32,
        "sliding_window": WINDOW,
        "sliding_window_pattern": 2,
        "rope_theta": 10000.0,
        "rope_local_base_freq": 10000.0,
    },
    "qwen3_5": {
        "model_type": "qwen3_5",
        "num_hidden_layers": 4,
        "intermediate_size": 128,
        **_ATTN,
        "rms_norm_eps": 1e-6,
        "full_attention_interval": 2,
        "linear_num_value_heads": 2,
        "linear_num_key_heads": 1,
        "linear_key_head_dim": 16,
        "linear_value_head_dim": 16,
        "linear_conv_kernel_dim": 4,
        "tie_word_embeddings": False,
        "rope_parameters": {
            "type": "default",
            "rope_theta": 10000.0,
            "partial_rotary_factor": 0.5,
        },
    },
    # Mamba-2 and attention in every layer, kept in a CacheList: no exact ragged form,
    # so it runs with plain decoding only (engine.plain).
    "falcon_h1": {
        "model_type": "falcon_h1",
        "num_hidden_layers": 2,
        "head_dim": 16,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "intermediate_size": 128,
        "mamba_d_ssm": 64,
        "mamba_n_heads": 4,
        "mamba_d_head": 16,
        "mamba_d_state": 16,
        "mamba_chunk_size": 16,
        "mamba_expand": 1,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
    },
    "lfm2": {
        "model_type": "lfm2",
        "num_hidden_layers": 4,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "norm_eps": 1e-5,
        "conv_bias": False,
        "conv_L_cache": 3,
        "block_dim": 64,
        "block_ff_dim": 128,
        "block_multiple_of": 16,
        "block_ffn_dim_multiplier": 1.0,
        "block_auto_adjust_ff_dim": False,
        "layer_types": ["conv", "full_attention", "conv", "full_attention"],
        "rope_theta": 10000.0,
    },
}


def build_model(
    out: Path,
    family: str,
    *,
    vocab_size: int,
    tokenizer_from: Path,
    hidden: int = 64,
    seed: int = 1,
    scale: float = 3.0,
    bits: int | None = None,
    layers: int | None = None,
    overrides: dict | None = None,
) -> Path:
    """Save a random fp32 model of `family` (a key of CONFIGS); `bits` quantizes it
    with mlx.nn.quantize (group size 32), as mlx_lm.convert would."""
    out.mkdir(parents=True, exist_ok=True)
    config = dict(CONFIGS[family])
    config.update(
        hidden_size=hidden,
        vocab_size=vocab_size,
        max_position_embeddings=512,
        eos_token_id=0,
        torch_dtype="float32",
    )
    config.update(overrides or {})
    if layers is not None:
        config["num_hidden_layers"] = layers
        if "layer_types" in config:
            config["layer_types"] = (config["layer_types"] * layers)[:layers]
    module = importlib.import_module(f"mlx_lm.models.{family}")
    mx.random.seed(seed)
    model = module.Model(module.ModelArgs.from_dict(config))
    model.update(tree_map(lambda w: w * scale, model.parameters()))
    if bits is not None:
        nn.quantize(model, group_size=32, bits=bits)
        config["quantization"] = {"group_size": 32, "bits": bits}
    mx.save_safetensors(str(out / "model.safetensors"), dict(tree_flatten(model.parameters())))
    (out / "config.json").write_text(json.dumps(config))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (out / name).write_bytes((tokenizer_from / name).read_bytes())
    return out


def tokenizer_dir(tmp: Path) -> tuple[Path, int]:
    """A shared tiny BPE tokenizer, and its vocabulary size."""
    tok = tmp / "tok"
    if not (tok / "tokenizer.json").exists():
        build_tokenizer(tok)
    vocab = len(json.loads((tok / "tokenizer.json").read_text())["model"]["vocab"])
    return tok, vocab


def family_pair(
    tmp: Path,
    target: str,
    draft: str | None = "llama",
    *,
    bits: int | None = None,
    target_scale: float = 3.0,
    draft_scale: float = 3.0,
):
    """Load a tiny `target` family model with a tiny `draft` family model (or none)."""
    tok, vocab = tokenizer_dir(tmp)
    name = f"{target}{bits or ''}"
    t = build_model(
        tmp / name, target, vocab_size=vocab, tokenizer_from=tok, bits=bits, scale=target_scale
    )
    d = None
    if draft is not None:
        d = build_model(
            tmp / f"draft_{draft}",
            draft,
            vocab_size=vocab,
            tokenizer_from=tok,
            hidden=32,
            seed=2,
            scale=draft_scale,
            layers=2,
        )
    return engine.load_pair(t, d)


def six_token_model(path: Path, family: str, tok: Path, seed: int, scale: float = 2.0, **kw):
    """A 2-layer, 16-wide `family` model over a 6-token vocabulary, weights scaled by
    `scale`: the size of the models whose sampling law the chi-square tests enumerate."""
    return build_model(
        path,
        family,
        vocab_size=6,
        tokenizer_from=tok,
        hidden=16,
        seed=seed,
        scale=scale,
        layers=2,
        **kw,
    )


def six_token_pair(tmp: Path, family: str, scale: float = 2.0):
    """A target (seed 11) and a draft (seed 12) `six_token_model` of `family` (gemma3_text
    with a window of 2), named `family`, paths "t" and "d"."""
    from mlx_lm.utils import load_model

    from engine.loading import ModelPair

    tok, _ = tokenizer_dir(tmp)
    over = {"sliding_window": 2} if family == "gemma3_text" else {}
    models = [
        load_model(six_token_model(tmp / role, family, tok, seed, scale, overrides=over))[0]
        for role, seed in (("t", 11), ("d", 12))
    ]
    return ModelPair(models[0], models[1], None, "t", "d", 512, 6, 6, family)
