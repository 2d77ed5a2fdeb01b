"""What exact rollback of recurrent layers costs per verify step (engine/recurrent.py).

A random qwen3_5 (gated delta-net layers between full attention) in the ragged cache:
a batch of rows is prefilled, then verify passes of K + 1 tokens are timed, once with
every row keeping all positions (no replay) and once with each row keeping a random
prefix (the rows that kept fewer are replayed through their mixers). The ratio is the
rollback's price per step; the same is printed for a full-attention llama of the same
size, where rollback is only a mask.

    python benchmarks/rollback_cost.py [--hidden 512] [--layers 8] [--batch 4] [--k 3]
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import mlx.core as mx  # noqa: E402
from mlx_lm.models import llama, qwen3_5  # noqa: E402

import engine  # noqa: E402,F401  (fast BLAS before mlx)
from engine.families import make_ragged_cache  # noqa: E402

VOCAB = 2048


def build(family: str, hidden: int, layers: int):
    base = {
        "model_type": family,
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "intermediate_size": hidden * 3,
        "num_attention_heads": hidden // 64,
        "num_key_value_heads": max(1, hidden // 256),
        "head_dim": 64,
        "rms_norm_eps": 1e-6,
        "vocab_size": VOCAB,
        "max_position_embeddings": 4096,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
    }
    if family == "qwen3_5":
        base.update(
            full_attention_interval=4,
            linear_num_value_heads=hidden // 64,
            linear_num_key_heads=max(1, hidden // 128),
            linear_key_head_dim=64,
            linear_value_head_dim=64,
            linear_conv_kernel_dim=4,
        )
        module = qwen3_5
    else:
        module = llama
    model = module.Model(module.ModelArgs.from_dict(base))
    mx.eval(model.parameters())
    return model


def time_steps(model, batch: int, k: int, steps: int, partial: bool) -> float:
    rng = random.Random(0)
    rows, cache = make_ragged_cache(model, batch)
    model(mx.array([[rng.randrange(VOCAB) for _ in range(64)] for _ in range(batch)]), cache=cache)
    rows.advance(64, [64] * batch)
    total = 0.0
    for _ in range(steps):
        block = mx.array([[rng.randrange(VOCAB) for _ in range(k + 1)] for _ in range(batch)])
        keep = [rng.randint(1, k + 1) if partial else k + 1 for _ in range(batch)]
        t0 = time.perf_counter()
        logits = model(block, cache=cache)
        mx.eval(logits)
        rows.advance(k + 1, keep)
        mx.eval([c.state for c in cache])
        total += time.perf_counter() - t0
    return total / steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--steps", type=int, default=20)
    args = ap.parse_args()
    for family in ("qwen3_5", "llama"):
        model = build(family, args.hidden, args.layers)
        time_steps(model, args.batch, args.k, 3, True)  # warm-up
        full = time_steps(model, args.batch, args.k, args.steps, False)
        part = time_steps(model, args.batch, args.k, args.steps, True)
        print(
            f"{family}: verify step (batch {args.batch}, K={args.k}) keep-all {full * 1e3:.1f} ms, "
            f"partial keep {part * 1e3:.1f} ms, rollback {100 * (part / full - 1):+.0f}%"
        )


if __name__ == "__main__":
    main()
