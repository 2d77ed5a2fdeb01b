"""How often batched "auto" settles plain decoding, process by process (issue 23's "regime
lottery").

    python benchmarks/regimes.py                                   # demo, 4 rows, 8 processes
    python benchmarks/regimes.py --per-run 4 --processes 10 --runs 3

`lockstep.py` gives one process's medians; which regime "auto" ends in (drafting, or K = 0
for good) is set by a process's first steps and varies from one process to the next. Each
process here is a fresh copy of the pair's calibrated controller (as a new worker starts),
decoding the same requests run after run beside a plain-decoding lane, the two stepped in
lockstep (`lockstep.lockstep`). A row per process: "auto"'s drafts a row-step in each run,
its speed against the plain lane's in each run, and whether its last run drafted under
SETTLED drafts a row-step (plain decoding, bar probes). The summary counts those processes.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import engine  # first: loads OpenBLAS before anything imports mlx

# isort: split
from engine.loading import DEMO_DRAFT, DEMO_TARGET

sys.path.insert(0, str(Path(__file__).resolve().parent))

import lockstep  # noqa: E402
import pairs  # noqa: E402
import prompts as prompt_sets  # noqa: E402

SETTLED = 0.2  # drafts a row-step under which a run counts as plain decoding


def process(pair, ids_list, batch: int, runs: int, max_tokens: int) -> list[tuple[float, float]]:
    """One process: (auto's drafts a row-step, auto / none) for each run."""
    mine, plain = lockstep.own_pair(pair), lockstep.own_pair(pair)
    out = []
    for r in range(runs):
        lanes = {
            "auto": lockstep.Lane(
                mine, lockstep.requests_for(ids_list, "model", "auto", max_tokens), batch
            ),
            "none": lockstep.Lane(
                plain, lockstep.requests_for(ids_list, "none", 1, max_tokens), batch
            ),
        }
        lockstep.lockstep(lanes, seed=r)
        auto, none = lanes["auto"], lanes["none"]
        if auto.outputs != none.outputs:
            raise SystemExit("regimes: auto's greedy output differs from plain decoding's")
        ratio = (auto.tokens / auto.seconds) / (none.tokens / none.seconds)
        out.append((auto.drafted / max(auto.row_steps, 1), ratio))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pair", default="demo", choices=("demo", "random"))
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--per-run", type=int, default=2, help="requests per run, times batch")
    ap.add_argument("--processes", type=int, default=8)
    ap.add_argument("--runs", type=int, default=3, help="runs per process")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--cache", type=Path, default=pairs.CACHE)
    args = ap.parse_args(argv)
    demo = engine.load_pair(DEMO_TARGET, DEMO_DRAFT)
    pair = lockstep.named_pair(args.pair, demo, args.cache, 0)
    prompts = [ids for _, ids in prompt_sets.code_prompts(pair.tokenizer, 16, 48)]
    n = args.batch * args.per_run
    ids_list = (prompts * n)[:n]
    print(
        f"# regimes: {args.pair} pair, {args.processes} processes of {args.runs} runs, batch "
        f"{args.batch}, {n} requests of {args.max_tokens} new tokens a run, greedy"
    )
    print("| process | auto drafts a row-step, each run | auto / none, each run | settled plain |")
    print("|---|---|---|---|")
    settled, ratios = 0, []
    for p in range(1, args.processes + 1):
        got = process(pair, ids_list, args.batch, args.runs, args.max_tokens)
        plain = got[-1][0] < SETTLED
        settled += plain
        ratios += [ratio for _, ratio in got]
        print(
            f"| {p} | {', '.join(f'{d:.2f}' for d, _ in got)} | "
            f"{', '.join(f'{r:.3f}' for _, r in got)} | {'yes' if plain else 'no'} |",
            flush=True,
        )
    print(
        f"\nsettled plain by the last run: {settled} of {args.processes} processes; "
        f"auto / none over every run: median {statistics.median(ratios):.3f} "
        f"({min(ratios):.2f}-{max(ratios):.2f})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
