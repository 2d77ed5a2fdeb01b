"""A native MTP head on a benchmark-size hybrid target (qwen3_5), single stream, in one process.

    python benchmarks/heads_bench.py                # ~50M target
    python benchmarks/heads_bench.py --quick        # small and short, a smoke run

No trained MTP head ships here, so the target (benchmarks/families_bench.py's qwen3_5,
widened to `--params`) gets a random head in the published `mtp.*` names: it never
agrees, so its rows are the floor "auto" must hold (>= 0.97x of plain decoding), and a
fixed K = 2 shows what drafting with the head costs when nothing is accepted. The head
has the target's layer shape (as in Qwen3.5, one decoder layer of the backbone's size),
so on this 4-layer target it costs far more, relative to a target pass, than one layer of
a 32-layer model would. Contenders run interleaved per prompt; ratios are medians of
per-prompt ratios.
"""

from __future__ import annotations

import argparse
import platform
import shutil
import sys
import time
from pathlib import Path

import engine  # first: loads OpenBLAS before anything imports mlx

# isort: split
import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache, trim_prompt_cache

from engine.families import make_ragged_cache

ROOT = Path(__file__).resolve().parent
sys.path[:0] = [str(ROOT), str(ROOT.parent / "tests")]

import families_bench  # noqa: E402
import harness  # noqa: E402
import pairs  # noqa: E402
from tiny_heads import add_mtp_head  # noqa: E402


def head_pair(args):
    draft = families_bench.build(
        args.cache / f"fam-qwen3_5-h{args.hidden}-s1", "qwen3_5", args.hidden, seed=1
    )
    target = pairs.widen(draft, args.params, cache=args.cache)
    with_head = args.cache / f"{target.name}-mtp"
    if not (with_head / "config.json").exists():
        shutil.copytree(target, with_head, dirs_exist_ok=True)
        add_mtp_head(with_head, scale=2.0)
    return engine.load_pair(with_head, "mtp")


def head_pass_ratio(pair, context: int = 32, reps: int = 3) -> float:
    """One head pass with its logits over one target decode pass, one row each after
    `context` tokens, timed here (the fastest of `reps`, after one warm-up pass)."""
    drafter, target = pair.dflash, pair.target
    cache = make_prompt_cache(target)
    mx.eval(target(mx.array([[1] * context]), cache=cache))
    rows, head_cache = make_ragged_cache(drafter.head, 1)
    features = mx.zeros((1, context, drafter.feature_size))
    out = drafter.step(mx.ones((1, context), dtype=mx.int32), features, head_cache)
    rows.advance(context, [context])
    target_s = head_s = float("inf")
    for rep in range(reps + 1):  # the first of each warms up
        t0 = time.perf_counter()
        mx.eval(target(mx.array([[1]]), cache=cache))
        if rep:
            target_s = min(target_s, time.perf_counter() - t0)
        trim_prompt_cache(cache, 1)
        t0 = time.perf_counter()
        out = drafter.step(mx.ones((1, 1), dtype=mx.int32), out[:, -1:], head_cache)
        mx.eval(drafter.logits(out))
        if rep:
            head_s = min(head_s, time.perf_counter() - t0)
        rows.advance(1, [1])
    return head_s / target_s


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--params", type=int, default=50_000_000, help="target size")
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--prompt-tokens", type=int, default=96)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--cache", type=Path, default=pairs.CACHE)
    args = ap.parse_args(argv)
    if args.quick:
        args.params, args.hidden, args.prompts, args.max_tokens = 8_000_000, 128, 2, 16
    pair = head_pair(args)
    params = pair.info()["target_parameters"]
    ratio = head_pass_ratio(pair)  # one head pass vs one decode pass, 1 row
    ps = families_bench.prompts(pair.tokenizer, args.prompts, args.prompt_tokens)
    contenders = [
        harness.Contender("plain", harness.ours(pair, 1, drafter="none")),
        harness.Contender('random MTP head, "auto"', harness.ours(pair, "auto"), True),
        harness.Contender("random MTP head, K=2", harness.ours(pair, 2), True),
    ]
    harness.warm_up(contenders, ps[0][1])
    tallies = harness.round_robin(contenders, ps, args.max_tokens, pair, log=print)
    base = tallies["plain"]
    command = "python benchmarks/heads_bench.py" + (" " + " ".join(argv) if argv else "")
    lines = [
        f"## MTP head on a hybrid target (`benchmarks/heads_bench.py`, "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())})",
        "",
        f"Command: `{command}`; {platform.machine()}, {mx.default_device()}; target "
        f"{params / 1e6:.0f}M parameters; one head pass (with the LM head) measured at "
        f"{ratio:.2f}x a target decode pass.",
        "",
        *harness.rate_table(tallies, base, "single stream, greedy"),
    ]
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
