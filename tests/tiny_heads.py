"""Tiny random drafting heads in the layouts published checkpoints use.

`add_mtp_head` writes a Qwen3.5 multi-token-prediction head into a tiny qwen3_5 target's
own checkpoint, under the names the Hugging Face checkpoints give it (`mtp.fc.weight`,
`mtp.layers.0.self_attn.q_proj.weight`, ...), and sets `mtp_num_hidden_layers`, as a
downloaded Qwen3.5 model has them (mlx-lm's loader drops them; engine.mtp reads them).
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten, tree_map

from engine.mtp import MTPHead


def add_mtp_head(target_dir: Path, *, layers: int = 1, seed: int = 5, scale: float = 3.0) -> dict:
    """Add random `mtp.*` tensors to `target_dir`'s model.safetensors; returns them."""
    config = json.loads((target_dir / "config.json").read_text())
    mx.random.seed(seed)
    head = MTPHead(config.get("text_config") or config, layers)
    head.update(tree_map(lambda w: w * scale, head.parameters()))
    mtp = {f"mtp.{k}": v for k, v in tree_flatten(head.parameters())}
    weights = dict(mx.load(str(target_dir / "model.safetensors")))
    mx.save_safetensors(str(target_dir / "model.safetensors"), {**weights, **mtp})
    config["mtp_num_hidden_layers"] = layers
    (target_dir / "config.json").write_text(json.dumps(config))
    return mtp


_HF_SHIFTED = (
    ".input_layernorm.weight",
    ".post_attention_layernorm.weight",
    ".q_norm.weight",
    ".k_norm.weight",
    "model.norm.weight",
    "mtp.norm.weight",
    "mtp.pre_fc_norm_embedding.weight",
    "mtp.pre_fc_norm_hidden.weight",
)


def to_hf_layout(src: Path, dst: Path) -> Path:
    """Rewrite a tiny qwen3_5 checkpoint (with its MTP head) as Hugging Face stores Qwen3.5:
    `model.language_model.*` names, conv1d kernels last, RMSNorm weights as offsets from 1."""
    dst.mkdir(parents=True, exist_ok=True)
    out = {}
    for key, value in mx.load(str(src / "model.safetensors")).items():
        if key.startswith("language_model.model."):
            key = "model.language_model." + key[len("language_model.model.") :]
        elif key.startswith("language_model."):
            key = key[len("language_model.") :]
        if "conv1d.weight" in key:
            value = value.moveaxis(2, 1)
        if key.endswith(_HF_SHIFTED) and value.ndim == 1:
            value = value - 1.0
        out[key] = value
    mx.save_safetensors(str(dst / "model.safetensors"), out)
    for f in src.iterdir():
        if f.name != "model.safetensors":
            (dst / f.name).write_bytes(f.read_bytes())
    return dst


def to_shards(src: Path, dst: Path, shard_of) -> Path:
    """Rewrite a one-file checkpoint as published sharded ones are: shard_of(tensor name)
    -> shard number (0, 1, ...), written as model-0000i-of-0000n.safetensors with a
    model.safetensors.index.json weight map."""
    dst.mkdir(parents=True, exist_ok=True)
    weights = mx.load(str(src / "model.safetensors"))
    groups: dict[int, dict] = {}
    for key, value in weights.items():
        groups.setdefault(shard_of(key), {})[key] = value
    n = max(groups) + 1
    weight_map = {}
    for i, group in groups.items():
        name = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
        mx.save_safetensors(str(dst / name), group)
        weight_map.update(dict.fromkeys(group, name))
    index = {"metadata": {}, "weight_map": weight_map}
    (dst / "model.safetensors.index.json").write_text(json.dumps(index))
    for f in src.iterdir():
        if f.name != "model.safetensors":
            (dst / f.name).write_bytes(f.read_bytes())
    return dst


def build_eagle3(
    out: Path,
    target_dir: Path,
    *,
    aux_ids: list[int],
    draft_vocab: list[int],
    seed: int = 7,
    scale: float = 3.0,
    heads: int = 2,
) -> Path:
    """A random EAGLE-3 head for the target at `target_dir`, written as EAGLE-3 checkpoints
    are published: config.json (`LlamaForCausalLMEagle3`, `draft_vocab_size`,
    `eagle_config.eagle_aux_hidden_state_layer_ids`) and safetensors with `fc`, `midlayer.*`,
    `norm`, `lm_head`, `d2t` (target id minus draft id) and `t2d` (which target ids the draft
    vocabulary holds). `draft_vocab` lists the target ids of draft ids 0, 1, ..."""
    from engine.eagle3 import Eagle3Config, Eagle3Head

    out.mkdir(parents=True, exist_ok=True)
    target = json.loads((target_dir / "config.json").read_text())
    hidden, vocab = target["hidden_size"], target["vocab_size"]
    config = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_size": hidden,
        "num_attention_heads": heads,
        "num_key_value_heads": 1,
        "head_dim": hidden // heads,
        "intermediate_size": 2 * hidden,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "max_position_embeddings": 512,
        "vocab_size": vocab,
        "draft_vocab_size": len(draft_vocab),
        "num_hidden_layers": 1,
        "tie_word_embeddings": False,
        "hidden_act": "silu",
        "torch_dtype": "float32",
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": aux_ids, "use_aux_hidden_state": True},
    }
    mx.random.seed(seed)
    head = Eagle3Head(Eagle3Config.from_dict(config), len(aux_ids))
    head.update(tree_map(lambda w: w * scale, head.parameters()))
    weights = {k.replace("layers.0.", "midlayer."): v for k, v in tree_flatten(head.parameters())}
    ids = mx.array(draft_vocab, dtype=mx.int64)
    weights["d2t"] = ids - mx.arange(len(draft_vocab), dtype=mx.int64)
    weights["t2d"] = mx.zeros((vocab,), dtype=mx.bool_).at[ids].add(True)
    mx.save_safetensors(str(out / "model.safetensors"), weights)
    (out / "config.json").write_text(json.dumps(config))
    return out
