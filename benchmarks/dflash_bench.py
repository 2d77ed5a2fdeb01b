"""DFlash block drafter against the draft model and mlx-lm (issue 13 point 6), one process.

    python benchmarks/dflash_bench.py            # widened ~100M demo target (minutes)
    python benchmarks/dflash_bench.py --quick    # small and short, a smoke run

Rows (greedy unless said; contenders interleaved prompt by prompt; ratios are medians
of per-prompt ratios):
  1. tokens per target pass: DFlash (block - 1 drafts) vs the demo draft model at its
     best fixed K (goal >= 1.5x)
  2. tokens/s: DFlash "auto" vs mlx-lm speculative decoding at its best K (goal >= 1.3x),
     and vs target-only
  3. tokens per target pass at temperature 1 (DFlash, block - 1 drafts)
  4. batched DFlash "auto" vs batched plain at batch 4 and 16 (goal >= 0.97x)
  5. long context: a prompt near the demo pair's trained window, DFlash "auto" vs plain
The DFlash drafter trained on the demo target (engine/demo/dflash) works on the widened
target unchanged: the widening keeps the target's function.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import engine  # first: loads OpenBLAS before anything imports mlx

# isort: split
from engine.loading import DEMO_DIR, DEMO_DRAFT, DEMO_TARGET

sys.path.insert(0, str(Path(__file__).resolve().parent))

import harness  # noqa: E402
import pairs  # noqa: E402
import prompts as prompt_sets  # noqa: E402


def per_pass(runner, prompts, n) -> tuple[float, list[float], list[list[int]]]:
    tokens = steps = 0
    rates, outs = [], []
    for ids in prompts:
        t0 = time.perf_counter()
        r = runner(ids, n)
        dt = time.perf_counter() - t0
        tokens += len(r.tokens)
        steps += r.steps
        rates.append(len(r.tokens) / dt)
        outs.append(r.tokens)
    return tokens / max(steps, 1), rates, outs


def median_ratio(a: list[float], b: list[float]) -> float:
    return statistics.median(x / y for x, y in zip(a, b, strict=True))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--params", type=int, default=100_000_000)
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--cache", type=Path, default=pairs.CACHE)
    args = ap.parse_args(argv)
    if args.quick:
        args.params, args.prompts, args.max_tokens = 6_000_000, 2, 16
    wide = pairs.widen(DEMO_TARGET, args.params, cache=args.cache)
    model_pair = engine.load_pair(wide, DEMO_DRAFT)
    dflash_pair = engine.load_pair(wide, DEMO_DIR / "dflash")
    block = dflash_pair.dflash.block_size
    n = args.max_tokens
    prompts = [ids for _, ids in prompt_sets.code_prompts(model_pair.tokenizer, args.prompts, 64)]
    out = [f"# DFlash benchmark: target {wide.name} ({args.params:,} parameters), {n} new tokens"]
    out.append(f"BLAS: {model_pair.info()['blas']}; DFlash block size {block}")

    # 1. tokens per target pass
    best_k, best_len = 0, 0.0
    for k in (1, 2, 3, 4, 6, 8):
        length, _, _ = per_pass(harness.ours(model_pair, k), prompts, n)
        if length > best_len:
            best_k, best_len = k, length
    d_len, _, d_out = per_pass(harness.ours(dflash_pair, block - 1), prompts, n)
    out.append(
        f"1. tokens per target pass: DFlash {d_len:.2f} vs draft model {best_len:.2f} "
        f"(best K={best_k}): {d_len / best_len:.2f}x (goal >= 1.5x)"
    )

    # 2. tokens/s against mlx-lm's speculative decoding at its best K, and target-only
    mlx_best, mlx_rates = None, None
    for k in (1, 2, 3, 4):
        _, rates, _ = per_pass(harness.mlx_speculative(model_pair, k), prompts, n)
        if mlx_rates is None or statistics.median(rates) > statistics.median(mlx_rates):
            mlx_best, mlx_rates = k, rates
    plain, auto = [], []
    for ids in prompts:  # interleaved: the two runs of a prompt see the same load
        _, r1, _ = per_pass(harness.mlx_target_only(model_pair), [ids], n)
        _, r2, _ = per_pass(harness.ours(dflash_pair, "auto"), [ids], n)
        plain += r1
        auto += r2
    _, mlx_again, _ = per_pass(harness.mlx_speculative(model_pair, mlx_best), prompts, n)
    out.append(
        f"2. tokens/s: DFlash auto {statistics.median(auto):.1f}, mlx-lm speculative (K={mlx_best}) "
        f"{statistics.median(mlx_again):.1f}, target-only {statistics.median(plain):.1f}: "
        f"{median_ratio(auto, mlx_again):.2f}x mlx-lm (goal >= 1.3x), "
        f"{median_ratio(auto, plain):.2f}x target-only"
    )

    # 3. temperature 1
    t_len, _, _ = per_pass(
        harness.ours(dflash_pair, block - 1, temperature=1.0, seed=1), prompts, n
    )
    m_len, _, _ = per_pass(harness.ours(model_pair, best_k, temperature=1.0, seed=1), prompts, n)
    out.append(
        f"3. temperature 1: tokens per target pass DFlash {t_len:.2f}, draft model (K={best_k}) "
        f"{m_len:.2f}"
    )

    # 4. batched
    for b in (4, 16):
        ids_list = (prompts * b)[:b]
        ratios = []
        for p in range(2 if args.quick else 3):
            order = ("none", "model") if p % 2 == 0 else ("model", "none")
            got = {d: harness.batched_rate(dflash_pair, ids_list, b, d, n) for d in order}
            ratios.append(got["model"][0] / got["none"][0])
        out.append(
            f"4. batch {b}: DFlash auto / plain {statistics.median(ratios):.3f} "
            f"({min(ratios):.2f}-{max(ratios):.2f}) (goal >= 0.97)"
        )

    # 5. long context: a prompt filling most of the 256-token window the pair was trained on
    text = "".join(prompt_sets.functions()[i][1] for i in range(4))
    long_ids = model_pair.tokenizer.encode(text)[: 256 - n]
    _, r_plain, _ = per_pass(harness.ours(dflash_pair, 1, drafter="none"), [long_ids], n)
    l_len, r_auto, _ = per_pass(harness.ours(dflash_pair, "auto"), [long_ids], n)
    out.append(
        f"5. long context ({len(long_ids)}-token prompt): DFlash auto / plain "
        f"{r_auto[0] / r_plain[0]:.2f}x, {l_len:.2f} tokens per target pass"
    )
    print("\n".join(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
