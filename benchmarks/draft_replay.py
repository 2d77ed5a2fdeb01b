"""Replay drafting policies offline against the target's greedy output (greedy only).

For each held-out code prompt the target's greedy continuation is computed once. Then at
every position of it: the draft model's greedy chain of up to 8 tokens with the draft's
top probability for each, and the prompt-lookup proposal (2-gram match or longer). A
draft token is accepted iff it equals the target's token there, so every policy can be
replayed exactly, without timing noise, and priced with a verify-cost curve v(K) (a
target pass over K + 1 tokens, in decode steps) and a draft step cost c:

    speedup = tokens emitted / sum over steps of (v(K) + drafted tokens * c)

Policies: fixed K (what mlx-lm does), a confidence threshold (stop drafting where the
draft's top probability falls below tau, as llama.cpp does), lookup-where-text-repeats
with model drafts elsewhere (what the engine's greedy "auto" does), and two oracles that
know which drafts pass: the ceiling of any early-stopping rule with this draft.

    python benchmarks/draft_replay.py [--prompts 16] [--v 1.30,1.63,...] [--c 0.025]

The default v and c are the values bench.py's table (i) measured on 2026-11-30 at 14:05
(BENCHMARKS.md at that commit; later runs are in docs/benchmark-history.md).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import mlx.core as mx  # noqa: E402
import prompts as prompt_sets  # noqa: E402
from mlx_lm.models.cache import make_prompt_cache  # noqa: E402

import engine  # noqa: E402  (loads OpenBLAS first)
from engine.drafters import LookupIndex  # noqa: E402

CHAIN = 8
# v(K) for K = 0..8 and c, measured by bench.py's table (i) on 2026-11-30 14:05;
# v(5) and v(7) interpolated.
DEFAULT_V = "1.0,1.30,1.63,1.94,2.03,2.09,2.15,2.33,2.52"
DEFAULT_C = 0.025


def greedy_continuation(model, ids: list[int], n: int) -> list[int]:
    cache = make_prompt_cache(model)
    logits = model(mx.array([ids]), cache=cache)[0, -1]
    out = []
    for _ in range(n):
        tok = mx.argmax(logits).item()
        out.append(tok)
        logits = model(mx.array([[tok]]), cache=cache)[0, -1]
    return out


def positions(pair, ids: list[int], cont: list[int]) -> list[dict]:
    """Per position t of cont: the draft chain's accepted length and confidences, and
    the lookup proposal's length and accepted length."""
    rows = []
    for t in range(len(cont)):
        prefix = ids + cont[:t]
        x, confs, chain = list(prefix), [], []
        for _ in range(CHAIN):
            p = mx.softmax(pair.draft(mx.array([x]))[0, -1].astype(mx.float32))
            tok = mx.argmax(p).item()
            chain.append(tok)
            confs.append(p[tok].item())
            x.append(tok)
        proposal = LookupIndex(prefix, max_ngram=4, min_ngram=2).propose(CHAIN)
        rows.append(
            {
                "confs": confs,
                "model_acc": _accepted(chain, cont[t:]),
                "lookup_len": len(proposal),
                "lookup_acc": _accepted(proposal, cont[t:]),
            }
        )
    return rows


def _accepted(drafts: list[int], truth: list[int]) -> int:
    n = 0
    while n < len(drafts) and n < len(truth) and drafts[n] == truth[n]:
        n += 1
    return n


def replay(runs: list[list[dict]], policy, v: list[float], c: float) -> float:
    """Tokens per decode-step cost of a policy(row) -> (K, drafted, accepted)."""
    tokens = cost = 0.0
    for rows in runs:
        t = 0
        while t < len(rows):
            k, drafted, acc = policy(rows[t])
            n = min(acc, k)
            tokens += min(n + 1, len(rows) - t)
            cost += v[k] + drafted * c
            t += n + 1
    return tokens / cost


def fixed(k: int):
    return lambda r: (k, k, r["model_acc"])


def threshold(tau: float, k_max: int):
    def policy(r):
        k = 0
        while k < k_max and r["confs"][k] >= tau:
            k += 1
        return k, min(k + 1, k_max), r["model_acc"]

    return policy


def hybrid(k_model: int, k_lookup: int):
    def policy(r):
        if r["lookup_len"]:
            return min(r["lookup_len"], k_lookup), 0, r["lookup_acc"]
        return k_model, k_model, r["model_acc"]

    return policy


def oracle(lookup: bool):
    """The ceiling of any stopping rule: the draft model drafts exactly the tokens that
    will pass (none where the first fails), and with `lookup` the lookup proposal is taken
    where it passes more. No rule that decides from the drafts alone can do better."""

    def policy(r):
        if lookup and r["lookup_acc"] > r["model_acc"]:
            return r["lookup_acc"], 0, r["lookup_acc"]
        return r["model_acc"], r["model_acc"], r["model_acc"]

    return policy


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--v", default=DEFAULT_V, help="v(0..8), comma-separated")
    ap.add_argument("--c", type=float, default=DEFAULT_C)
    args = ap.parse_args(argv)
    v = [float(x) for x in args.v.split(",")]
    if len(v) != CHAIN + 1 or v[0] != 1.0:
        ap.error(f"--v needs {CHAIN + 1} values starting with 1.0")

    pair = engine.load_pair()
    runs = []
    for name, ids in prompt_sets.code_prompts(pair.tokenizer, args.prompts, args.prompt_tokens):
        cont = greedy_continuation(pair.target, ids, args.max_tokens)
        runs.append(positions(pair, ids, cont))
        print(f"replayed {name}", file=sys.stderr, flush=True)

    rows = [(f"fixed K={k}", replay(runs, fixed(k), v, args.c)) for k in range(1, CHAIN + 1)]
    best_fixed = max(r for _, r in rows)
    rows += [
        (f"threshold tau={tau}, K<={k}", replay(runs, threshold(tau, k), v, args.c))
        for tau in (0.1, 0.2, 0.3, 0.5)
        for k in (4, 6, 8)
    ]
    rows += [
        (
            f"lookup (<= {kl}) where a 2-gram repeats, else model K={km}",
            replay(runs, hybrid(km, kl), v, args.c),
        )
        for km in (2, 4, 6)
        for kl in (4, 8)
    ]
    rows += [
        (
            "oracle: the draft model drafts exactly what passes",
            replay(runs, oracle(False), v, args.c),
        ),
        ("oracle: the same, or lookup where it passes more", replay(runs, oracle(True), v, args.c)),
    ]
    print(f"{args.prompts} prompts x {args.max_tokens} tokens; v = {v}; c = {args.c}\n")
    print("| policy | speedup over plain decoding | vs best fixed K |")
    print("|---|---|---|")
    for name, r in rows:
        print(f"| {name} | {r:.3f}x | {r / best_fixed:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
