"""Lines that share a long prefix (issue 20), in one process, contenders interleaved.

    python benchmarks/prefix_bench.py                  # 24 lines, 640-token prefix, ~100M target
    python benchmarks/prefix_bench.py --rounds 2       # two rounds, orders reversed
    python benchmarks/prefix_bench.py --quick          # small and short, for a smoke run

24 lines share a 640-token prefix of Python source (held-out stdlib files), each with
its own 20-token ending; 32 new tokens, greedy, the default request ("auto" drafting
with the worker's draft), batches of 12, prefill included in the time:
- ours: `engine.generate_many(max_batch=12)`, prefix cache emptied before each run;
- mlx-lm `batch_generate` on the same prompts (12 at a time);
- mlx-lm `batch_generate` with a prefix cache built by hand: the prefix prefilled once
  per run, a deep copy handed to each prompt, which then carries only its ending;
- the control: 24 lines of the same length sharing nothing, ours and `batch_generate`.
Targets: ours / batch_generate >= 2.5, ours / hand-built >= 1.0, control >= 0.97.
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
from pathlib import Path

import engine  # first: loads OpenBLAS before anything imports mlx

# isort: split
import mlx.core as mx
from mlx_lm import batch_generate
from mlx_lm.models.cache import make_prompt_cache

from engine.loading import DEMO_DRAFT, DEMO_TARGET

sys.path.insert(0, str(Path(__file__).resolve().parent))

import pairs  # noqa: E402
import prompts as prompt_sets  # noqa: E402


def corpus_tokens(tokenizer, n: int) -> list[int]:
    """At least n tokens of held-out Python source, files concatenated in order."""
    out: list[int] = []
    for path in prompt_sets.heldout_files():
        out += tokenizer.encode(path.read_text(encoding="utf-8", errors="replace"))
        if len(out) >= n:
            return out
    raise SystemExit(f"prefix_bench: only {len(out)} tokens of held-out source")


def workloads(tokenizer, lines: int, prefix: int, ending: int):
    """(shared, control): prompts sharing `prefix` tokens, and prompts of the same
    lengths sharing nothing."""
    need = prefix + lines * (ending + 30) + lines * (prefix + ending + 40) + 1000
    toks = corpus_tokens(tokenizer, need)
    head = toks[:prefix]
    at = prefix + 500
    shared = []
    for i in range(lines):
        start = at + i * (ending + 30)
        shared.append(head + toks[start : start + ending])
    at += lines * (ending + 30)
    control = []
    for i in range(lines):
        start = at + i * (prefix + ending + 40)
        control.append(toks[start : start + prefix + ending])
    return shared, control


def ours(pair, prompts, max_tokens, batch):
    """engine.generate_many with the default request; the prefix cache starts empty."""
    for cache in (pair.prefix.target, pair.prefix.draft):
        if cache is not None:
            cache.clear()
    requests = [
        engine.GenerationRequest(prompt_ids=p, max_tokens=max_tokens, temperature=0.0)
        for p in prompts
    ]
    out = [None] * len(prompts)
    cached = steps = drafted = 0
    for i, res in engine.generate_many(pair, requests, max_batch=batch):
        out[i] = res.token_ids
        cached += res.usage["prompt_tokens_details"]["cached_tokens"]
        steps += res.stats.num_spec_steps
        drafted += res.stats.num_draft_tokens
    print(f"    ours: {drafted} draft tokens over {steps} row-steps", flush=True)
    return out, cached


def mlx_batch(pair, prompts, max_tokens, batch, cache=None):
    """mlx-lm batch_generate, `batch` prompts at a time; given `cache` (a prefilled
    prefix), each prompt starts from a copy of it and passes only what follows it."""
    skip = cache[0].offset if cache is not None else 0
    out = []
    for i in range(0, len(prompts), batch):
        group = prompts[i : i + batch]
        res = batch_generate(
            pair.target,
            pair.tokenizer,
            [p[skip:] for p in group],
            prompt_caches=[copy.deepcopy(cache) for _ in group] if cache is not None else None,
            max_tokens=max_tokens,
            return_token_ids=True,
            completion_batch_size=batch,
            prefill_batch_size=batch,
        )
        out += res.token_ids
    return out, skip * len(prompts)


def mlx_hand_cache(pair, prompts, max_tokens, batch, prefix_len):
    """batch_generate given a prefix cache made by hand: prefilled once, copied per prompt."""
    cache = make_prompt_cache(pair.target)
    pair.target(mx.array([prompts[0][:prefix_len]]), cache=cache)
    mx.eval([c.state for c in cache])
    return mlx_batch(pair, prompts, max_tokens, batch, cache)


def timed(fn, *args):
    mx.clear_cache()
    mx.reset_peak_memory()
    t0 = time.perf_counter()
    out, cached = fn(*args)
    seconds = time.perf_counter() - t0
    return out, cached, seconds, mx.get_peak_memory() / 2**20


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lines", type=int, default=24)
    ap.add_argument("--prefix", type=int, default=640)
    ap.add_argument("--ending", type=int, default=20)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--batch", type=int, default=12)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--params", type=int, default=100_000_000, help="widened target size")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument(
        "--only", default="", help="comma-separated contenders to run (default: all five)"
    )
    ap.add_argument("--cache", type=Path, default=pairs.CACHE)
    args = ap.parse_args(argv)
    if args.quick:
        args.lines, args.prefix, args.max_tokens, args.batch = 6, 128, 8, 3
        args.params = 6_000_000
    wide = pairs.widen(DEMO_TARGET, args.params, cache=args.cache)
    pair = engine.load_pair(wide, DEMO_DRAFT)
    shared, control = workloads(pair.tokenizer, args.lines, args.prefix, args.ending)
    print(
        f"# {args.lines} lines, {args.prefix}-token shared prefix + {args.ending}-token endings, "
        f"{args.max_tokens} new tokens, greedy, batches of {args.batch}; target "
        f"{pair.info()['target_parameters'] / 1e6:.0f}M parameters; {pair.info()['blas']}"
    )
    print(f"# {engine.prefix_line(pair)}")
    contenders = {
        "ours": lambda: timed(ours, pair, shared, args.max_tokens, args.batch),
        "batch_generate": lambda: timed(mlx_batch, pair, shared, args.max_tokens, args.batch),
        "batch_generate + hand-built prefix cache": lambda: timed(
            mlx_hand_cache, pair, shared, args.max_tokens, args.batch, args.prefix
        ),
        "control: ours": lambda: timed(ours, pair, control, args.max_tokens, args.batch),
        "control: batch_generate": lambda: timed(
            mlx_batch, pair, control, args.max_tokens, args.batch
        ),
    }
    if args.only:
        wanted = [w.strip() for w in args.only.split(",")]
        contenders = {k: v for k, v in contenders.items() if k in wanted}
    timed(ours, pair, shared[:2], 4, 2)  # warm-up
    seconds = {name: [] for name in contenders}
    results = {}
    for r in range(args.rounds):
        names = list(contenders) if r % 2 == 0 else list(contenders)[::-1]
        for name in names:
            before = pair.prefix.info()["target"]
            out, cached, s, peak = contenders[name]()
            after = pair.prefix.info()["target"]
            seconds[name].append(s)
            results[name] = (out, cached, peak, before, after)
            print(f"  round {r + 1}: {name}: {s:.1f} s, peak {peak:.0f} MiB", flush=True)
    print(
        "| contender | seconds (per round) | tok/s | peak MiB | prompt tokens reused | equal to batch_generate |"
    )
    print("|---|---|---|---|---|---|")
    total_prompt = sum(map(len, shared))
    rate = {}
    for name, secs in seconds.items():
        out, cached, peak, _, _ = results[name]
        tokens = sum(map(len, out))
        rate[name] = tokens * len(secs) / sum(secs)
        ref = "control: batch_generate" if name.startswith("control") else "batch_generate"
        base = results.get(ref, results.get("batch_generate + hand-built prefix cache"))
        equal = sum(a == b for a, b in zip(out, base[0], strict=True)) if base else 0
        print(
            f"| {name} | {', '.join(f'{x:.1f}' for x in secs)} | {rate[name]:.1f} | {peak:.0f} | "
            f"{cached} of {total_prompt} ({cached / total_prompt:.0%}) | {equal}/{len(out)} |"
        )
    print()
    for label, a, b, goal in (
        ("ours / batch_generate", "ours", "batch_generate", 2.5),
        ("ours / hand-built prefix cache", "ours", "batch_generate + hand-built prefix cache", 1.0),
        ("control: ours / batch_generate", "control: ours", "control: batch_generate", 0.97),
    ):
        if a not in rate or b not in rate:
            continue
        x = rate[a] / rate[b]
        print(f"{label}: {x:.2f}x (target >= {goal}x) {'met' if x >= goal else 'MISSED'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
