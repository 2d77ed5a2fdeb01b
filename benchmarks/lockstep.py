"""Batched "auto" against plain decoding and fixed K, interleaved step by step (issue 23,
issue 19's "benchmark harness noise").

    python benchmarks/lockstep.py                          # demo, random-draft, widened
    python benchmarks/lockstep.py --pairs demo --sizes 4 --runs 7
    python benchmarks/lockstep.py --fresh                  # new prompts every run
    python benchmarks/lockstep.py --quick                  # a smoke run
    python benchmarks/lockstep.py --refill --pairs demo --sizes 4,16,32 --per-run 4

Every contender (drafter "none"; drafter "model" with "auto", K = 1, K = 2; and a second
"none", the control) decodes the same requests in its own batch, and the batches take
turns one decode step at a time, in a new random order every round: a load burst on this
shared machine lands on all of them within milliseconds. Each contender has its own copy
of a fresh draft-length policy, so one's measurements never steer another.
A run is every contender through all its requests; the figure is the median over runs
of tokens/s against the first "none", with the range, and the control's ratio beside it.
By default every run decodes the same prompts (2 x batch of 16 held-out functions, so
1 row decodes 2 texts, 4 rows 8); with `--fresh` each run decodes prompts no other run
of the cell decodes (a shuffled pool of all ~265 held-out functions, used again only
once a cell has used them all), so a contender's median is over text sets and the best
fixed K is the pair's, not a few texts' (stop 44: on the 8 texts at 4 rows, K = 2's
drafts passed 4% more often than one acceptance rate predicts; on 16, 0.5%).
Also prints the median seconds of a step that drafted nothing, auto's against plain's
(the fixed cost "auto" adds to a step it does not speculate on), and whether every
contender's greedy output equals plain decoding's (lossless), per run.

    python benchmarks/lockstep.py --pairs demo --sizes 4 --per-run 4 --ks 1,2,3 --kinds

`--new-policy` starts every contender of every timed run with a fresh policy, as a new
worker starts (its first requests counted; run 0 still warms the process's shapes).

`--refill` is a worker's `--batch` workload: short prompts (12 tokens) and each request its
own length (max_tokens drawn from 1/4 to 3/2 of `--max-tokens`, seeded by the run, the
same for every contender), so rows finish and new ones join every few steps instead of
all together (issue 49: 64 such requests through 16 demo rows read "auto" 0.85x plain
run against run, where the fixed grid read >= 0.97x).

`--ks` sets the fixed K contenders (default 1,2). `--kinds` also prints, per contender, its
steps by kind, median over runs: full (every row in, none joining), join (rows joined:
their prefill is in it) and thin (fewer rows than the batch: the last rows of a run),
each as steps / ms / tokens emitted a ms. That splits a contender's time into what its
draft length buys on full steps and what its rows parting costs in joins of one row and in
the thin tail.
"""

from __future__ import annotations

import argparse
import copy
import random
import statistics
import sys
import time
from pathlib import Path

import engine  # first: loads OpenBLAS before anything imports mlx

# isort: split
from engine.batch import new_decoder
from engine.draft_length import DraftLengthPolicy
from engine.loading import DEMO_DRAFT, DEMO_TARGET
from engine.text import RequestRun

sys.path.insert(0, str(Path(__file__).resolve().parent))

import pairs  # noqa: E402
import prompts as prompt_sets  # noqa: E402

KINDS = ("full", "join", "thin")


def contenders(ks=(1, 2)) -> tuple:
    """(name, drafter, num_draft_tokens): plain, "auto", a fixed K each, the control."""
    fixed = tuple((f"K={k}", "model", k) for k in ks)
    return (("none", "none", 1), ("auto", "model", "auto"), *fixed, ("control", "none", 1))


class Lane:
    """One contender's `generate_many` loop, one decoder step per `step()` call."""

    def __init__(self, pair, requests, max_batch: int):
        self.pair, self.max_batch = pair, max_batch
        self.decoder = new_decoder(pair)
        self.waiting = iter(enumerate(requests))
        self.runs: dict[int, RequestRun] = {}
        self.tokens = self.row_steps = self.drafted = 0
        self.plain_steps: list[float] = []  # seconds of steps where no row drafted
        self.outputs: dict[int, list[int]] = {}  # request index -> its tokens
        self.kinds = {kind: [0, 0.0, 0] for kind in KINDS}  # kind -> [steps, seconds, tokens]
        self.done = False

    @property
    def seconds(self) -> float:
        return sum(seconds for _, seconds, _ in self.kinds.values())

    @property
    def drafts(self) -> float:
        """Tokens drafted a row-step."""
        return self.drafted / max(self.row_steps, 1)

    def step(self) -> None:
        t0 = time.perf_counter()
        before = len(self.runs)
        while len(self.runs) < self.max_batch:
            item = next(self.waiting, None)
            if item is None:
                break
            i, request = item
            run = self.runs[i] = RequestRun(self.pair, request)
            self.decoder.add(
                i,
                run.ids,
                run.params,
                seed=run.seed,
                drafter=run.drafter,
                num_draft_tokens=request.num_draft_tokens,
                max_tokens=request.max_tokens,
            )
        if not self.runs:
            self.done = True
            return
        joining = bool(self.decoder._joining)
        kind = "join" if joining else "full" if before == self.max_batch else "thin"
        t1 = time.perf_counter()
        steps = self.decoder.step()
        t2 = time.perf_counter()
        proposed = 0
        for i, step in steps.items():
            run = self.runs[i]
            run.feed(step)
            proposed += step.proposed
            self.kinds[kind][2] += len(step.tokens)
            if run.finished:
                self.decoder.remove(i)
                self.outputs[i] = self.runs.pop(i).out
                self.tokens += len(self.outputs[i])
        self.kinds[kind][0] += 1
        self.kinds[kind][1] += time.perf_counter() - t0
        self.row_steps += len(steps)
        self.drafted += proposed
        if not proposed and not joining:
            self.plain_steps.append(t2 - t1)


def lockstep(lanes: dict[str, Lane], seed: int = 0) -> None:
    """Step every lane in turn, in a fresh random order each round, until all are done.

    Random, not rotated: a rotation keeps every lane behind the same neighbour, and a lane
    that runs after one which just swept a large cache (a drafting contender at 32 rows)
    starts cold every time (a plain-against-plain control read 0.90 that way)."""
    names, order = list(lanes), random.Random(seed)
    while not all(lane.done for lane in lanes.values()):
        order.shuffle(names)
        for name in names:
            if not lanes[name].done:
                lanes[name].step()


def named_pair(name: str, demo, cache: Path, params: int):
    """The pair a benchmark names: "demo" (as shipped), "random" (the demo target with a
    draft model of random weights) or "widened" (the demo target widened to `params`)."""
    if name == "demo":
        return demo
    if name == "widened":
        return engine.load_pair(pairs.widen(DEMO_TARGET, params, cache=cache), DEMO_DRAFT)
    if name == "random":
        useless = pairs.useless_draft(DEMO_DRAFT, cache=cache)
        return pairs.with_draft(demo, useless, "demo+random-draft")
    raise SystemExit(f"lockstep: unknown pair {name!r} (demo, random, widened)")


def own_pair(pair):
    """The pair with a draft-length policy of its own, fresh (as a new worker starts)."""
    mine = copy.copy(pair)
    mine.policy = DraftLengthPolicy()
    return mine


def requests_for(ids_list, drafter, k, max_tokens):
    """One request per prompt; `max_tokens` an int for all, or a list, one per prompt."""
    lengths = max_tokens if isinstance(max_tokens, list) else [max_tokens] * len(ids_list)
    return [
        engine.GenerationRequest(prompt_ids=ids, max_tokens=m, drafter=drafter, num_draft_tokens=k)
        for ids, m in zip(ids_list, lengths, strict=True)
    ]


REFILL_PROMPT = 12  # tokens of each `--refill` prompt


def refill_lengths(n: int, max_tokens: int, run: int) -> list[int]:
    """`--refill`: run `run`'s n request lengths, from 1/4 to 3/2 of max_tokens (at least
    1), the same for every contender of the run."""
    rng = random.Random(1000 + run)
    return [rng.randint(max(1, max_tokens // 4), max(1, max_tokens * 3 // 2)) for _ in range(n)]


def fresh_prompts(pool: list, n: int, first: int = 0):
    """Run r's n prompts (`--fresh`): the pool's (first + r)-th n, no prompt in two runs
    until the pool is used up, then round again from its start."""

    def run_prompts(r: int) -> list:
        return [pool[((first + r) * n + i) % len(pool)] for i in range(n)]

    return run_prompts


def prompts_label(fresh: bool) -> str:
    """What a benchmark's header says of its prompts."""
    return "new prompts every run" if fresh else "the same prompts every run"


def cell(
    pair,
    ids_list,
    batch: int,
    runs: int,
    max_tokens: int,
    ks=(1, 2),
    refill: bool = False,
    new_policy: bool = False,
) -> dict:
    """Ratios against "none" per run, drafts per row-step, plain-step seconds, steps by
    kind. `ids_list`: every run's prompts, or a function of the run (0: the warm-up) giving
    that run's (`--fresh`). `refill`: each request its own length (`refill_lengths`).
    `new_policy`: every run starts each contender with a fresh policy (as a new worker
    starts: its first requests are counted); else a contender's policy learns through the
    untimed run 0 and keeps learning."""
    field = ("ratio", "tps", "drafts", "plain_s", "kinds")
    lanes_of = contenders(ks)
    pairs_by = {name: own_pair(pair) for name, _, _ in lanes_of}
    out = {name: {f: [] for f in field} for name, _, _ in lanes_of}
    out["lossless"] = [0, 0]  # contender runs whose outputs all equal plain's, of all
    for r in range(runs + 1):  # run 0 warms every contender up, untimed
        if new_policy:
            pairs_by = {name: own_pair(pair) for name, _, _ in lanes_of}
        run_ids = ids_list(r) if callable(ids_list) else ids_list
        lengths = refill_lengths(len(run_ids), max_tokens, r) if refill else max_tokens
        lanes = {
            name: Lane(pairs_by[name], requests_for(run_ids, d, k, lengths), batch)
            for name, d, k in lanes_of
        }
        lockstep(lanes, seed=r)
        for lane in lanes.values():  # greedy: every contender gives plain's tokens
            out["lossless"][0] += lane.outputs == lanes["none"].outputs
            out["lossless"][1] += 1
        if r == 0:
            continue
        base = lanes["none"].tokens / lanes["none"].seconds
        for name, lane in lanes.items():
            tps = lane.tokens / lane.seconds
            out[name]["tps"].append(tps)
            out[name]["ratio"].append(tps / base)
            out[name]["drafts"].append(lane.drafts)
            out[name]["plain_s"] += lane.plain_steps
            out[name]["kinds"].append(lane.kinds)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pairs", default="demo,random,widened")
    ap.add_argument("--sizes", default="1,4,16,32")
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--per-run", type=int, default=2, help="requests per run, times batch")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--params", type=int, default=100_000_000, help="widened target size")
    ap.add_argument("--ks", default="1,2", help="fixed K contenders")
    ap.add_argument("--kinds", action="store_true", help="also print steps by kind")
    ap.add_argument(
        "--fresh",
        action="store_true",
        help="new prompts every run (a shuffled pool of every held-out function)",
    )
    ap.add_argument(
        "--refill",
        action="store_true",
        help="short prompts, each request its own length: rows join and leave as in a worker",
    )
    ap.add_argument(
        "--new-policy",
        action="store_true",
        help="every timed run starts each contender with a fresh policy (its first run counted)",
    )
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--cache", type=Path, default=pairs.CACHE)
    args = ap.parse_args(argv)
    if args.quick:
        args.sizes, args.runs, args.max_tokens, args.params = "1,4", 1, 12, 6_000_000
    sizes = [int(s) for s in args.sizes.split(",")]
    ks = [int(k) for k in args.ks.split(",")]
    fixed = [f"K={k}" for k in ks]
    demo = engine.load_pair(DEMO_TARGET, DEMO_DRAFT)
    length = REFILL_PROMPT if args.refill else 48
    prompts = [ids for _, ids in prompt_sets.code_prompts(demo.tokenizer, 16, length)]
    pool = prompt_sets.prompt_pool(demo.tokenizer, length) if args.fresh else []
    news = (
        f"{args.max_tokens // 4}-{args.max_tokens * 3 // 2} new tokens each (refilling), "
        f"{REFILL_PROMPT}-token prompts"
        if args.refill
        else f"{args.max_tokens} new tokens"
    )
    print(
        f"# lockstep: {args.runs} runs, {args.per_run} x batch requests of {news}, "
        f"greedy, {prompts_label(args.fresh)}"
        f"{', a fresh policy every run' if args.new_policy else ''}; {demo.info()['blas']}"
    )
    print(
        "| pair | batch | none tok/s | control / none | auto / none | "
        + "".join(f"{c} / none | " for c in fixed)
        + "auto / best, paired | auto drafts per row-step | auto / plain step, nothing drafted "
        "| outputs equal to plain |"
    )
    print("|---" * (9 + len(fixed)) + "|")
    kinds_rows = []
    for name in args.pairs.split(","):
        pair = named_pair(name, demo, args.cache, args.params)
        for b in sizes:
            n = b * args.per_run
            ids_list = (prompts * n)[:n]
            if args.fresh:
                ids_list = fresh_prompts(pool, n)
            got = cell(
                pair, ids_list, b, args.runs, args.max_tokens, ks, args.refill, args.new_policy
            )

            def show(c, got=got):
                r = got[c]["ratio"]
                return f"{statistics.median(r):.3f} ({min(r):.2f}-{max(r):.2f})"

            auto_s, plain_s = got["auto"]["plain_s"], got["none"]["plain_s"]
            step = (
                f"{statistics.median(auto_s) / statistics.median(plain_s):.3f} "
                f"({statistics.median(auto_s) * 1e3:.2f} / {statistics.median(plain_s) * 1e3:.2f} ms"
                f", {len(auto_s)} steps)"
                if auto_s and plain_s
                else "-"
            )
            print(
                f"| {name} | {b} | {statistics.median(got['none']['tps']):.0f} | "
                f"{show('control')} | {show('auto')} | "
                + "".join(f"{show(c)} | " for c in fixed)
                + f"{against_best(got, fixed)} | "
                + f"{statistics.median(got['auto']['drafts']):.2f} | {step} | "
                f"{got['lossless'][0]}/{got['lossless'][1]} |",
                flush=True,
            )
            kinds_rows.append((name, b, got))
    if args.kinds:
        print_kinds(kinds_rows, ["none", "auto", *fixed])
    return 0


def against_best(got: dict, fixed: list[str]) -> str:
    """ "auto" over the best fixed contender (K = 0, plain, included: the highest median
    ratio to "none"), run by run, median (range), and which contender that is: with new
    prompts every run (`--fresh`) runs differ by their texts, and the paired ratio holds
    the text set fixed."""
    best = max(["none", *fixed], key=lambda c: statistics.median(got[c]["ratio"]))
    paired = [a / b for a, b in zip(got["auto"]["tps"], got[best]["tps"], strict=True)]
    name = "K=0" if best == "none" else best
    return f"{statistics.median(paired):.3f} ({min(paired):.2f}-{max(paired):.2f}) of {name}"


def print_kinds(rows, names) -> None:
    """Each contender's steps by kind (KINDS), median over runs: steps / ms / tokens a ms."""
    heads = " | ".join(f"{kind}: steps / ms / tok a ms" for kind in KINDS)
    print(f"\n| pair | batch | contender | {heads} | all ms |")
    print("|---" * (4 + len(KINDS)) + "|")
    for pair_name, b, got in rows:
        for name in names:
            runs = got[name]["kinds"]
            cells = []
            for kind in KINDS:
                steps = statistics.median(r[kind][0] for r in runs)
                ms = statistics.median(r[kind][1] for r in runs) * 1e3
                rate = statistics.median(
                    r[kind][2] / r[kind][1] / 1e3 if r[kind][1] else 0 for r in runs
                )
                cells.append(f"{steps:.0f} / {ms:.0f} / {rate:.2f}")
            total = statistics.median(sum(s for _, s, _ in r.values()) for r in runs) * 1e3
            print(f"| {pair_name} | {b} | {name} | " + " | ".join(cells) + f" | {total:.0f} |")


if __name__ == "__main__":
    raise SystemExit(main())
