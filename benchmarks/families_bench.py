"""Speculation on a hybrid target (qwen3_5: gated delta-net + full attention) and a
sliding-window target (gemma3_text) of benchmark size, in one process (issue 12, point 6).

    python benchmarks/families_bench.py                  # both families, ~100M targets
    python benchmarks/families_bench.py --quick          # small and short, a smoke run
    python benchmarks/families_bench.py --families qwen3_5 --params 50000000

No trained pair of these families ships here, so each family gets random weights:
a small random model D (the draft), the target T = D widened to `--params` parameters
(extra MLP units whose down-projection is zero: the same function as D at the cost of
a large model; benchmarks/pairs.py), and a second random model R of D's shape (a
draft that never agrees). So the draft D agrees with T on every greedy token: that
row is the ceiling of what speculation gains with these layer kinds on this machine
(the rollback of recurrent layers and the windowed mask included); the R rows are the
floor that "auto" must hold (>= 0.97x of plain decoding, single and batched).
Contenders run interleaved per prompt; ratios are medians of per-prompt ratios.
"""

from __future__ import annotations

import argparse
import functools
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import engine  # first: loads OpenBLAS before anything imports mlx

# isort: split
import mlx.core as mx
from mlx.utils import tree_flatten, tree_map

sys.path.insert(0, str(Path(__file__).resolve().parent))

import harness  # noqa: E402
import pairs  # noqa: E402

from engine.loading import DEMO_TARGET  # noqa: E402

CONFIGS = {
    "qwen3_5": {
        "model_type": "qwen3_5",
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "head_dim": 64,
        "full_attention_interval": 2,
        "linear_num_value_heads": 4,
        "linear_num_key_heads": 2,
        "linear_key_head_dim": 64,
        "linear_value_head_dim": 64,
        "linear_conv_kernel_dim": 4,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
        "rope_parameters": {"type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
    },
    "gemma3_text": {
        "model_type": "gemma3_text",
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "head_dim": 64,
        "rms_norm_eps": 1e-6,
        "query_pre_attn_scalar": 64,
        "sliding_window": 64,
        "sliding_window_pattern": 2,
        "rope_theta": 10000.0,
        "rope_local_base_freq": 10000.0,
    },
}


def build(out: Path, family: str, hidden: int, seed: int) -> Path:
    """A random model of `family` with the demo tokenizer; cached under benchmarks/.cache."""
    if (out / pairs.WEIGHTS).exists():
        return out
    import importlib

    config = dict(CONFIGS[family])
    vocab = json.loads((DEMO_TARGET / "config.json").read_text())["vocab_size"]
    config.update(
        hidden_size=hidden,
        intermediate_size=hidden * 2,
        vocab_size=vocab,
        max_position_embeddings=4096,
        eos_token_id=0,
        torch_dtype="float32",
    )
    module = importlib.import_module(f"mlx_lm.models.{family}")
    mx.random.seed(seed)
    model = module.Model(module.ModelArgs.from_dict(config))
    model.update(tree_map(lambda w: w * 2.0, model.parameters()))  # peaked, varied laws
    weights = dict(tree_flatten(model.parameters()))
    return pairs._save(out, weights, config, DEMO_TARGET)


def load(target: Path, draft: Path):
    return engine.load_pair(target, draft)


def prompts(tokenizer, n: int, length: int) -> list[tuple[str, list[int]]]:
    """n prompts of about `length` tokens cut from the demo pair's README text."""
    text = (DEMO_TARGET.parent / "README.md").read_text() * 4
    ids = tokenizer.encode(text)
    step = max(1, (len(ids) - length) // n)
    return [(f"p{i}", ids[i * step : i * step + length]) for i in range(n)]


def batched(pair, prompts_ids, rows: int, drafter: str, k, max_tokens: int) -> tuple[float, float]:
    """(tokens/s, tokens per target pass) of generate_many over the prompts."""
    requests = [
        engine.GenerationRequest(
            prompt_ids=ids, max_tokens=max_tokens, drafter=drafter, num_draft_tokens=k
        )
        for _, ids in prompts_ids
    ]
    t0 = time.perf_counter()
    tokens = steps = 0
    for _, res in engine.generate_many(pair, requests, max_batch=rows):
        tokens += len(res.token_ids)
        steps += res.stats.num_spec_steps
    return tokens / (time.perf_counter() - t0), tokens / max(steps, 1)


def family_rows(family: str, args, log) -> list[str]:
    cache = args.cache
    draft = build(cache / f"fam-{family}-h{args.hidden}-s1", family, args.hidden, seed=1)
    useless = build(cache / f"fam-{family}-h{args.hidden}-s2", family, args.hidden, seed=2)
    target = pairs.widen(draft, args.params, cache=cache)
    agree = load(target, draft)
    random_pair = load(target, useless)
    params = agree.info()["target_parameters"]
    kinds = agree.features().target_layers
    log(f"{family}: target {params / 1e6:.0f}M parameters, layers {kinds}")
    ps = prompts(agree.tokenizer, args.prompts, args.prompt_tokens)
    ref = harness.mlx_target_only(agree)
    contenders = [
        harness.Contender("plain", harness.ours(agree, 1, drafter="none")),
        harness.Contender("agreeing draft, K=4", harness.ours(agree, 4), True),
        harness.Contender('agreeing draft, "auto"', harness.ours(agree, "auto"), True),
        harness.Contender('random draft, "auto"', harness.ours(random_pair, "auto"), True),
        harness.Contender("mlx-lm target only", ref),
    ]
    harness.warm_up(contenders, ps[0][1])
    tallies = harness.round_robin(contenders, ps, args.max_tokens, agree, log=log)
    base = tallies["plain"]
    same = sum(
        a == b
        for a, b in zip(
            tallies['agreeing draft, "auto"'].outputs,
            tallies["mlx-lm target only"].outputs,
            strict=True,
        )
    )
    lines = [
        f"### {family} ({params / 1e6:.0f}M-parameter target; layers {kinds})",
        "",
        *harness.rate_table(tallies, base, "single stream, greedy"),
        "",
        f'Outputs of "auto" identical to mlx-lm target-only: {same}/{len(ps)} prompts.',
        "",
        "| batched, greedy | rows | plain tokens/s | agreeing auto | random auto |",
        "| --- | --- | --- | --- | --- |",
    ]
    more = prompts(agree.tokenizer, max(args.sizes) * 2, args.prompt_tokens)
    for rows in args.sizes:
        ratios = {"agree": [], "random": []}
        base_rates = []
        work = more[: rows * 2]
        setups = {
            "plain": (agree, "none", 1),
            "agree": (agree, "model", "auto"),
            "random": (random_pair, "model", "auto"),
        }

        def go(name: str, work=work, rows=rows, setups=setups) -> float:
            pair, drafter, k = setups[name]
            return batched(pair, work, rows, drafter, k, args.max_tokens)[0]

        runs = {name: functools.partial(go, name) for name in setups}
        for run in runs.values():  # untimed: every batch shape met once
            run()
        for i in range(args.passes):
            order = list(runs)[i % 3 :] + list(runs)[: i % 3]
            rate = {name: runs[name]() for name in order}
            base_rates.append(rate["plain"])
            ratios["agree"].append(rate["agree"] / rate["plain"])
            ratios["random"].append(rate["random"] / rate["plain"])
        lines.append(
            f"| | {rows} | {statistics.median(base_rates):.1f} | "
            f"{statistics.median(ratios['agree']):.2f}x | "
            f"{statistics.median(ratios['random']):.2f}x |"
        )
        log(f"  batch {rows}: {lines[-1]}")
    return lines + [""]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--families", default="qwen3_5,gemma3_text")
    ap.add_argument("--params", type=int, default=100_000_000, help="target size")
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--prompt-tokens", type=int, default=96)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--sizes", default="4,16")
    ap.add_argument("--passes", type=int, default=3)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--cache", type=Path, default=pairs.CACHE)
    ap.add_argument("--out", type=Path, help="write the report (markdown) here")
    args = ap.parse_args(argv)
    if args.quick:
        args.params, args.hidden, args.prompts = 8_000_000, 128, 2
        args.max_tokens, args.sizes, args.passes = 16, "4", 1
    args.sizes = [int(s) for s in args.sizes.split(",")]
    command = "python benchmarks/families_bench.py" + (" " + " ".join(argv) if argv else "")
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    lines = [
        f"## Model families at benchmark size (`benchmarks/families_bench.py`, {started})",
        "",
        f"Command: `{command}`; {platform.machine()}, {mx.default_device()}. "
        "Random weights (no trained pair of these families here): the agreeing draft is "
        "the target's own function at small cost, so its rows are the ceiling; the random "
        "draft never agrees, so its rows are the floor auto must hold.",
        "",
    ]
    for family in args.families.split(","):
        lines += family_rows(family, args, lambda m: print(m, flush=True))
    report = "\n".join(lines)
    print(report)
    if args.out:
        args.out.write_text(report + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
