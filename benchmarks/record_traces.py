"""Record step traces of real pairs for the draft-length policy's replay tests.

    python benchmarks/record_traces.py                    # demo and random-draft pairs
    python benchmarks/record_traces.py --pairs demo,widened --rows 1,4,16

For each pair and batch size it decodes held-out code prompts greedily at every fixed K
from 0 to `--max-k`, step by step, and writes tests/data/traces/<pair>.json: per batch
size, the seconds of every step at each K (`seconds[k]`), and how many drafts of a row
passed at the deepest K (`passed`; a greedy draft of k tokens is the first k of a deeper
one, so min(passed, k) is what k drafts would have passed). tests/test_draft_length.py
replays them: what "auto" would have done on that machine with those texts.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import engine  # first: loads OpenBLAS before anything imports mlx
from engine.batch import new_decoder
from engine.sampling import SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parent))

import lockstep  # noqa: E402
import pairs  # noqa: E402
import prompts as prompt_sets  # noqa: E402

OUT = Path(__file__).resolve().parent.parent / "tests" / "data" / "traces"


def record(pair, ids_list: list[list[int]], k: int, max_tokens: int) -> tuple[list, list]:
    """Decode the prompts together at fixed K (0: plain): step seconds and accepted counts
    of the steps where every row was in (not the first: its prefill)."""
    decoder = new_decoder(pair)
    for i, ids in enumerate(ids_list):
        drafter = "model" if k else "none"
        decoder.add(
            i,
            ids,
            SamplingParams(0.0),
            seed=0,
            drafter=drafter,
            num_draft_tokens=k or 1,
            max_tokens=max_tokens,
        )
    seconds, passed, left = [], [], {i: max_tokens for i in range(len(ids_list))}
    first = True
    while left:
        t0 = time.perf_counter()
        steps = decoder.step()
        dt = time.perf_counter() - t0
        full = len(steps) == len(ids_list)
        for key, step in steps.items():
            if k and full and not first:
                passed.append(step.accepted)
            left[key] -= len(step.tokens)
            if left[key] <= 0:
                decoder.remove(key)
                del left[key]
        if full and not first:
            seconds.append(round(dt, 6))
        first = False
    return seconds, passed


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pairs", default="demo,random")
    ap.add_argument("--rows", default="1,4")
    ap.add_argument("--max-k", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--cache", type=Path, default=pairs.CACHE)
    ap.add_argument("--params", type=int, default=100_000_000)
    args = ap.parse_args()
    demo = engine.load_pair()
    pool = prompt_sets.prompt_pool(demo.tokenizer, 48, seed=7)
    OUT.mkdir(parents=True, exist_ok=True)
    for name in args.pairs.split(","):
        pair = lockstep.named_pair(name, demo, args.cache, args.params)
        cells = []
        for rows in (int(r) for r in args.rows.split(",")):
            ids_list = pool[:rows]
            record(pair, ids_list, 1, 8)  # warm the shapes
            table, passed = [], []
            for k in range(args.max_k + 1):
                seconds, got = record(pair, ids_list, k, args.max_tokens)
                table.append(seconds)
                if k == args.max_k:
                    passed = got
            cells.append({"rows": rows, "seconds": table, "passed": passed})
            print(
                f"{name} rows {rows}: median step ms by K",
                [round(sorted(t)[len(t) // 2] * 1e3, 2) for t in table],
                "mean passed at K",
                args.max_k,
                round(sum(passed) / len(passed), 2),
            )
        trace = {
            "pair": name,
            "max_k": args.max_k,
            "cells": cells,
            "recorded": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "machine": engine.loading.blas_info(),
        }
        (OUT / f"{name}.json").write_text(json.dumps(trace) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
