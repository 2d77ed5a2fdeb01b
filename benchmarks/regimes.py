"""How often batched "auto" settles plain decoding, process by process (issue 23's "regime
lottery").

    python benchmarks/regimes.py                                   # demo, 4 rows, 8 processes
    python benchmarks/regimes.py --per-run 4 --processes 10 --runs 3
    python benchmarks/regimes.py --fresh                           # new prompts every run

`lockstep.py` gives one process's medians; which regime "auto" ends in (drafting, or K = 0
for good) is set by a process's first steps and varies from one process to the next. Each
process here is a fresh copy of the pair's calibrated controller (as a new worker starts),
decoding the same requests run after run beside a plain-decoding lane and a second one (the
control: the noise floor), the three stepped in lockstep (`lockstep.lockstep`). A row per
process: "auto"'s drafts a row-step in each run, its speed and the control's against the
plain lane's in each run, and whether its last run drafted under SETTLED drafts a row-step
(plain decoding, bar probes). The summary counts those processes.

With fixed K lanes beside them (`--ks`, default 1,2; "" for none), each process also shows
"auto" against its best contender, plain decoding (K = 0) included: each lane's median speed
over the process's runs against the plain lane's, "auto"'s over the best's, and which that
was. The summary counts the processes where "auto" is within 3% of it (issue 23's target,
met process by process, not only in one process's medians).

    python benchmarks/regimes.py --ks 1,2,3 --processes 8 --runs 4

`--ab FIELD=VALUE,...` adds a second "auto" lane ("auto B") whose copy of the controller has
those fields set (say `depth_margin=0`: the engine without stop 42's shorter K in a batch;
numbers, or true / false), stepped in lockstep with the others: a same-process A/B. Each row then
shows its drafts and speed per run, and the summary gives "auto B" over "auto" paired run
by run (geometric mean and its standard error) and how many of its processes settled plain.

    python benchmarks/regimes.py --ab depth_margin=0.0 --processes 12 --runs 4
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import statistics
import sys
from pathlib import Path
from typing import NamedTuple

import engine  # first: loads OpenBLAS before anything imports mlx

# isort: split
from engine.adaptive import DraftController
from engine.loading import DEMO_DRAFT, DEMO_TARGET

sys.path.insert(0, str(Path(__file__).resolve().parent))

import lockstep  # noqa: E402
import pairs  # noqa: E402
import prompts as prompt_sets  # noqa: E402

SETTLED = 0.2  # drafts a row-step under which a run counts as plain decoding
WITHIN = 0.97  # "auto" over the best contender at or above this: within 3% of it


class Run(NamedTuple):
    """One run of a process: "auto"'s drafts a row-step, and speeds over the plain lane's."""

    drafts: float
    auto: float
    control: float
    fixed: dict  # fixed K lane name -> its speed over the plain lane's
    ab_drafts: float | None = None  # "auto B"'s drafts a row-step (None: no "auto B" lane)
    ab: float | None = None  # "auto B"'s speed over the plain lane's


def process(
    pair, ids_list, batch: int, runs: int, max_tokens: int, ks=(), ab: dict | None = None
) -> list[Run]:
    """One process's runs: "auto", plain ("none"), the control and a lane per fixed K
    (`lockstep.contenders`), and with `ab` (controller fields) an "auto B" lane whose
    controller has them set, stepped in lockstep. `ids_list`: every run's prompts, or a
    function of the run giving that run's (`--fresh`)."""
    specs = lockstep.contenders(ks) + ((("auto B", "model", "auto"),) if ab else ())
    own = {name: lockstep.own_pair(pair) for name, _, _ in specs}
    for name, value in (ab or {}).items():
        setattr(own["auto B"].controller, name, value)
    out = []
    for r in range(runs):
        run_ids = ids_list(r) if callable(ids_list) else ids_list
        lanes = {
            name: lockstep.Lane(
                own[name], lockstep.requests_for(run_ids, drafter, k, max_tokens), batch
            )
            for name, drafter, k in specs
        }
        lockstep.lockstep(lanes, seed=r)
        auto, none = lanes["auto"], lanes["none"]
        if any(lane.outputs != none.outputs for lane in lanes.values()):
            raise SystemExit("regimes: a drafting lane's greedy output differs from plain's")
        speed = {name: lane.tokens / lane.seconds for name, lane in lanes.items()}
        out.append(
            Run(
                auto.drafts,
                speed["auto"] / speed["none"],
                speed["control"] / speed["none"],
                {f"K={k}": speed[f"K={k}"] / speed["none"] for k in ks},
                lanes["auto B"].drafts if ab else None,
                speed["auto B"] / speed["none"] if ab else None,
            )
        )
    return out


def against_best(got: list[Run]) -> tuple[float, str]:
    """(auto's median speed over the best contender's, that contender: "K=0" for plain
    decoding or a fixed K lane), each lane's speed the median over the process's runs."""
    medians = {"K=0": 1.0}
    for name in got[0].fixed:
        medians[name] = statistics.median(run.fixed[name] for run in got)
    best = max(medians, key=medians.get)
    return statistics.median(run.auto for run in got) / medians[best], best


def draft_lengths(text: str) -> list[int]:
    """`--ks`: comma-separated draft lengths of at least 1 ("" for none)."""
    try:
        ks = [int(k) for k in text.split(",") if k.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"not a comma-separated list of integers: {text!r}"
        ) from None
    if any(k < 1 for k in ks):
        raise argparse.ArgumentTypeError(f"a fixed K is at least 1: {text!r}")
    return ks


def controller_fields(text: str) -> dict:
    """`--ab`: comma-separated FIELD=VALUE of adaptive.DraftController (numbers, or true /
    false)."""
    known = {f.name for f in dataclasses.fields(DraftController)}
    out = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, sep, value = item.partition("=")
        if not sep or name not in known:
            raise argparse.ArgumentTypeError(
                f"not a controller field=value: {item!r} (fields: {', '.join(sorted(known))})"
            )
        if value.lower() in ("true", "false"):
            out[name] = value.lower() == "true"
            continue
        try:
            out[name] = float(value) if any(c in value for c in ".e") else int(value)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{name}: not a number or true/false: {value!r}"
            ) from None
    return out


def paired(runs: list[Run]) -> tuple[float, float]:
    """ "auto B" over "auto" paired run by run: (geometric mean, its standard error as a
    share), over every run given."""
    logs = [math.log(run.ab / run.auto) for run in runs]
    error = statistics.stdev(logs) / math.sqrt(len(logs)) if len(logs) > 1 else float("nan")
    return math.exp(statistics.mean(logs)), error


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pair", default="demo", choices=("demo", "random"))
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--per-run", type=int, default=2, help="requests per run, times batch")
    ap.add_argument("--processes", type=int, default=8)
    ap.add_argument("--runs", type=int, default=3, help="runs per process")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--ks", type=draft_lengths, default=[1, 2], help='fixed K lanes ("" for none)')
    ap.add_argument(
        "--ab", type=controller_fields, default={}, help="FIELD=VALUE,... of an auto B lane"
    )
    ap.add_argument(
        "--fresh",
        action="store_true",
        help="new prompts every run of every process (lockstep.py --fresh)",
    )
    ap.add_argument("--cache", type=Path, default=pairs.CACHE)
    args = ap.parse_args(argv)
    ks, ab = args.ks, args.ab
    demo = engine.load_pair(DEMO_TARGET, DEMO_DRAFT)
    pair = lockstep.named_pair(args.pair, demo, args.cache, 0)
    prompts = [ids for _, ids in prompt_sets.code_prompts(pair.tokenizer, 16, 48)]
    n = args.batch * args.per_run
    ids_list = (prompts * n)[:n]
    pool = prompt_sets.prompt_pool(pair.tokenizer, 48) if args.fresh else []
    print(
        f"# regimes: {args.pair} pair, {args.processes} processes of {args.runs} runs, batch "
        f"{args.batch}, {n} requests of {args.max_tokens} new tokens a run, greedy, "
        f"{lockstep.prompts_label(args.fresh)}"
    )
    fixed = [f"K={k}" for k in ks]
    print(
        "| process | auto drafts a row-step, each run | auto / none, each run "
        "| control / none, each run | settled plain |"
        + "".join(f" {name} / none, each run |" for name in fixed)
        + (" auto / best (which) |" if ks else "")
        + (" auto B drafts a row-step, each run | auto B / none, each run |" if ab else "")
    )
    print("|---" * (5 + len(fixed) + bool(ks) + 2 * bool(ab)) + "|")
    if ab:
        print(f"# auto B: {', '.join(f'{k}={v}' for k, v in ab.items())}")
    settled, ratios, controls, bests, every, settled_b = 0, [], [], [], [], 0
    for p in range(1, args.processes + 1):
        if args.fresh:  # (each process's runs after the runs of the processes before it)
            ids_list = lockstep.fresh_prompts(pool, n, first=(p - 1) * args.runs)
        got = process(pair, ids_list, args.batch, args.runs, args.max_tokens, ks, ab)
        every += got
        plain = got[-1].drafts < SETTLED
        settled += plain
        ratios += [run.auto for run in got]
        controls += [run.control for run in got]
        row = (
            f"| {p} | {', '.join(f'{run.drafts:.2f}' for run in got)} | "
            f"{', '.join(f'{run.auto:.3f}' for run in got)} | "
            f"{', '.join(f'{run.control:.3f}' for run in got)} | {'yes' if plain else 'no'} |"
        )
        for name in fixed:
            row += f" {', '.join(f'{run.fixed[name]:.3f}' for run in got)} |"
        if ks:
            share, best = against_best(got)
            bests.append(share)
            row += f" {share:.3f} ({best}) |"
        if ab:
            settled_b += got[-1].ab_drafts < SETTLED
            row += f" {', '.join(f'{run.ab_drafts:.2f}' for run in got)} |"
            row += f" {', '.join(f'{run.ab:.3f}' for run in got)} |"
        print(row, flush=True)

    def spread(values: list[float]) -> str:
        return f"median {statistics.median(values):.3f} ({min(values):.2f}-{max(values):.2f})"

    print(
        f"\nsettled plain by the last run: {settled} of {args.processes} processes; "
        f"over every run, auto / none {spread(ratios)}, control / none {spread(controls)}"
    )
    if ks:
        within = sum(share >= WITHIN for share in bests)
        print(
            f"auto within 3% of its process's best contender (K = 0 included) in {within} of "
            f"{args.processes} processes; auto / best {spread(bests)}"
        )
    if ab:
        mean, error = paired(every)
        print(
            f"auto B / auto, paired by run: geometric mean {mean:.3f} +- {error:.3f} over "
            f"{len(every)} runs; auto B settled plain by the last run in {settled_b} of "
            f"{args.processes} processes"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
