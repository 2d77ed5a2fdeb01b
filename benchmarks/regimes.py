"""How often batched "auto" settles plain decoding, process by process (issue 23's "regime
lottery").

    python benchmarks/regimes.py                                   # demo, 4 rows, 8 processes
    python benchmarks/regimes.py --per-run 4 --processes 10 --runs 3

`lockstep.py` gives one process's medians; which regime "auto" ends in (drafting, or K = 0
for good) is set by a process's first steps and varies from one process to the next. Each
process here is a fresh copy of the pair's calibrated controller (as a new worker starts),
decoding the same requests run after run beside a plain-decoding lane and a second one (the
control: the noise floor), the three stepped in lockstep (`lockstep.lockstep`). A row per
process: "auto"'s drafts a row-step in each run, its speed and the control's against the
plain lane's in each run, and whether its last run drafted under SETTLED drafts a row-step
(plain decoding, bar probes). The summary counts those processes.
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


LANES = (("auto", "model", "auto"), ("none", "none", 1), ("control", "none", 1))


def process(pair, ids_list, batch: int, runs: int, max_tokens: int) -> list[tuple]:
    """One process: (auto's drafts a row-step, auto / none, control / none) for each run."""
    own = {name: lockstep.own_pair(pair) for name, _, _ in LANES}
    out = []
    for r in range(runs):
        lanes = {
            name: lockstep.Lane(
                own[name], lockstep.requests_for(ids_list, drafter, k, max_tokens), batch
            )
            for name, drafter, k in LANES
        }
        lockstep.lockstep(lanes, seed=r)
        auto, none = lanes["auto"], lanes["none"]
        if auto.outputs != none.outputs:
            raise SystemExit("regimes: auto's greedy output differs from plain decoding's")
        speed = {name: lane.tokens / lane.seconds for name, lane in lanes.items()}
        out.append(
            (
                auto.drafted / max(auto.row_steps, 1),
                speed["auto"] / speed["none"],
                speed["control"] / speed["none"],
            )
        )
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
    print(
        "| process | auto drafts a row-step, each run | auto / none, each run "
        "| control / none, each run | settled plain |"
    )
    print("|---|---|---|---|---|")
    settled, ratios, controls = 0, [], []
    for p in range(1, args.processes + 1):
        got = process(pair, ids_list, args.batch, args.runs, args.max_tokens)
        plain = got[-1][0] < SETTLED
        settled += plain
        ratios += [ratio for _, ratio, _ in got]
        controls += [control for _, _, control in got]
        print(
            f"| {p} | {', '.join(f'{d:.2f}' for d, _, _ in got)} | "
            f"{', '.join(f'{r:.3f}' for _, r, _ in got)} | "
            f"{', '.join(f'{c:.3f}' for _, _, c in got)} | {'yes' if plain else 'no'} |",
            flush=True,
        )

    def spread(values: list[float]) -> str:
        return f"median {statistics.median(values):.3f} ({min(values):.2f}-{max(values):.2f})"

    print(
        f"\nsettled plain by the last run: {settled} of {args.processes} processes; "
        f"over every run, auto / none {spread(ratios)}, control / none {spread(controls)}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
