"""What one DFlash2 proposal costs next to a DFlash one of the same size, in one process.

    python benchmarks/dflash2_cost.py [--reps 20]

Both drafters read the bundled demo target (width 256, vocabulary 2048) and have the same
layers; DFlash2 adds its dynamic convolutions and the candidate selector's chain (one small
step per block position, sequential by construction). Timed: a greedy proposal of a whole
block (`greedy_block`), the two kinds interleaved, the median of `--reps` runs, for batches
of 1 and 8 rows with a 64-token context. The ratio is what "auto" sees as the draft cost.
Random weights: this measures cost only, never acceptance.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import engine  # noqa: F401  (first: loads OpenBLAS before anything imports mlx)

# isort: split
import mlx.core as mx
import mlx_lm

from engine.blas import blas_info
from engine.dflash import DFlashConfig, DFlashModel, load_dflash, save_dflash
from engine.loading import DEMO_TARGET


def drafters(tmp: Path, target, tcfg, block: int):
    common = dict(
        hidden_size=256,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        intermediate_size=768,
        vocab_size=tcfg["vocab_size"],
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        max_position_embeddings=4096,
        block_size=block,
        mask_token_id=1,
        target_layer_ids=(1, 2, 3),
        num_target_layers=tcfg["num_hidden_layers"],
    )
    kinds = {
        "dflash": DFlashConfig(**common),
        "dflash2": DFlashConfig(
            **common,
            kind="dflash2",
            conv_kernel_size=2,
            conv_group_size=16,
            selector_rank=64,
            selector_top_k=16,
            is_causal=False,
        ),
    }
    out = {}
    for kind, config in kinds.items():
        mx.random.seed(0)
        save_dflash(DFlashModel(config), tmp / kind)
        out[kind] = load_dflash(tmp / kind, target, tcfg)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--block", type=int, default=8)
    args = parser.parse_args()
    target, tcfg = mlx_lm.utils.load_model(DEMO_TARGET)
    pair = drafters(Path(tempfile.mkdtemp()), target, tcfg, args.block)
    with pair["dflash"].capture(target) as cap:
        target(mx.array([list(range(2, 66))]))
        feats = cap.features
    print(f"# DFlash2 vs DFlash proposal cost, block {args.block}, BLAS: {blas_info()}")
    for rows in (1, 8):
        states = {}
        for kind, drafter in pair.items():
            states[kind] = drafter.new_state(rows)
            states[kind].extend(mx.broadcast_to(feats, (rows, *feats.shape[1:])), [64] * rows)
        times: dict[str, list[float]] = {k: [] for k in pair}
        for _ in range(args.reps + 1):  # the first round warms up
            for kind, drafter in pair.items():
                t0 = time.perf_counter()
                mx.eval(drafter.greedy_block(states[kind], [5] * rows))
                times[kind].append(time.perf_counter() - t0)
        med = {k: statistics.median(v[1:]) for k, v in times.items()}
        print(
            f"{rows} row(s): dflash {med['dflash'] * 1e3:.2f} ms, dflash2 "
            f"{med['dflash2'] * 1e3:.2f} ms per proposal: {med['dflash2'] / med['dflash']:.2f}x"
        )


if __name__ == "__main__":
    main()
