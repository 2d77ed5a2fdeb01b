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
