"""Where batched "auto" loses to a fixed K: its steps by kind, the parts of a K = 1 step,
and "auto" with its model drafts capped (issue 23, demo pair at 4 rows).

    python benchmarks/auto_parts.py --runs 7                  # all three tables
    python benchmarks/auto_parts.py --runs 9 --only caps
    python benchmarks/auto_parts.py --runs 9 --no-hybrid      # "auto" without lookups

Every table runs its contenders in lockstep (benchmarks/lockstep.py: one decode step
each in turn, a fresh random order every round, each with its own copy of the
calibrated controller, one untimed warm-up run), on `--per-run` x batch requests of 64
new tokens a run.

- kinds: "auto", K = 1 and plain decoding; every timed step sorted by kind (full: every
  row in the batch; join: it admitted rows; thin: fewer rows than the batch, the last
  rows of a run) and by what drafted (nothing, the draft model only, prompt lookups
  too): steps, milliseconds and tokens a run; `--detail` adds a row per widest draft
  and source.
- phases: the steps where every row drafted one token by the draft model, in "auto"
  and in K = 1: milliseconds a step of each part (timers wrapped around the decoder's
  and the policy's methods, the same on both sides).
- caps: "auto" as shipped, and with its model drafts capped at 1, 2 and 3 tokens
  (prompt-lookup drafts not capped), against K = 1 and K = 2, with a second plain lane
  (the control, the noise floor): median tokens/s over the runs against plain decoding.
  "auto" capped at 1 against K = 1 is what "auto" costs
  apart from its choice of K.
"""

from __future__ import annotations

import argparse
import collections
import statistics
import sys
import time
from pathlib import Path

import engine  # first: loads OpenBLAS before anything imports mlx

# isort: split
from engine import batch, policy, ragged
from engine.loading import DEMO_DRAFT, DEMO_TARGET

sys.path.insert(0, str(Path(__file__).resolve().parent))

import lockstep  # noqa: E402
import prompts as prompt_sets  # noqa: E402

# The methods timed in "phases" (the proposer's are added once a decoder has one).
PHASES = [(policy.DraftPolicy, n) for n in ("choose", "observe")]
PHASES += [(batch.BatchDecoder, n) for n in ("_draft", "_verify", "_finish")]
PHASES += [(ragged.RaggedRows, n) for n in ("advance", "waste", "compact")]
PROPOSER_PHASES = ("propose", "commit")
DEFAULT_CAP = policy.MAX_AUTO_DRAFT  # "auto"'s model-draft cap as shipped


class Timers:
    """Seconds spent in wrapped methods since the last `clear()`."""

    def __init__(self):
        self.spent: dict[str, float] = collections.defaultdict(float)
        self.wrapped: set = set()

    def wrap(self, cls, name: str) -> None:
        if (cls, name) in self.wrapped or not hasattr(cls, name):
            return
        self.wrapped.add((cls, name))
        method, label, spent = getattr(cls, name), f"{cls.__name__}.{name}", self.spent

        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                spent[label] += time.perf_counter() - t0

        setattr(cls, name, timed)

    def clear(self) -> None:
        self.spent.clear()


def instrument(lane, name: str, record, cap: int | None = None) -> None:
    """Wrap the lane's decoder step: `record(name, steps, seconds, admitted)` after each
    step (`admitted`: rows it prefilled); `cap` sets the model-draft cap of "auto" rows for this lane's steps."""
    decoder, step, admit = lane.decoder, lane.decoder.step, lane.decoder._admit_joining
    seen = {"admitted": 0}

    def admitting():
        seen["admitted"] = len(decoder._joining)
        return admit()

    def stepped():
        if cap is not None:
            policy.MAX_AUTO_DRAFT = cap
        seen["admitted"] = 0
        t0 = time.perf_counter()
        steps = step()
        record(name, steps, time.perf_counter() - t0, seen["admitted"])
        return steps

    decoder._admit_joining, decoder.step = admitting, stepped


def without_hybrid(pair):
    """The pair, its greedy "auto" requests drafted by the model without the free
    prompt-lookup drafts they take where their text repeats (`--no-hybrid`)."""
    controller = pair.controller
    plan = controller.plan

    def model_only(*args, **kwargs):
        p = plan(*args, **kwargs)
        p.lookup = None
        return p

    controller.plan = model_only
    return pair


def run_cells(pair, ids_list, contenders, runs: int, b: int, record, hybrid: bool) -> dict:
    """Lockstep runs of `contenders` [(name, drafter, k, cap)] at batch size `b`: tokens/s
    over plain's per run; `record` hears every timed step; `hybrid` False: the "auto"
    lanes without their prompt-lookup drafts."""
    pairs_by = {name: lockstep.own_pair(pair) for name, *_ in contenders}
    if not hybrid:
        for name, _, k, _ in contenders:
            if k == "auto":
                without_hybrid(pairs_by[name])
    ratios: dict[str, list[float]] = {name: [] for name, *_ in contenders}
    for r in range(runs + 1):
        lanes = {}
        for name, drafter, k, cap in contenders:
            requests = lockstep.requests_for(ids_list, drafter, k, 64)
            lane = lanes[name] = lockstep.Lane(pairs_by[name], requests, b)
            instrument(lane, name, record if r else (lambda *a: None), cap)
        lockstep.lockstep(lanes, seed=r)
        if r:
            base = lanes["none"].tokens / lanes["none"].seconds
            for name, lane in lanes.items():
                ratios[name].append(lane.tokens / lane.seconds / base)
    policy.MAX_AUTO_DRAFT = DEFAULT_CAP
    return ratios


def kinds(pair, ids_list, runs: int, b: int, hybrid: bool, detail: bool = False) -> None:
    table = collections.defaultdict(lambda: [0, 0.0, 0])
    totals = collections.defaultdict(float)

    def record(name, steps, seconds, admitted):
        if not steps:
            return
        k = max(s.proposed for s in steps.values())
        sources = "+".join(sorted({s.source for s in steps.values()}))
        kind = "join" if admitted else ("thin" if len(steps) < b else "full")
        row = table[(name, kind, k, sources)]
        row[0] += 1
        row[1] += seconds
        row[2] += sum(len(s.tokens) for s in steps.values())
        totals[name] += seconds

    contenders = [("none", "none", 1, None), ("auto", "model", "auto", None)]
    contenders += [("K=1", "model", 1, None)]
    run_cells(pair, ids_list, contenders, runs, b, record, hybrid)
    # Summed by kind and by what drafted: nothing, the draft model only, or lookups too.
    summed = collections.defaultdict(lambda: [0, 0.0, 0])
    for (name, kind, k, sources), row in table.items():
        drafted = "nothing" if k == 0 else ("lookup" if "lookup" in sources else "model")
        for i, v in enumerate(row):
            summed[(name, kind, drafted)][i] += v
    print(f"\n### Steps by kind ({runs} runs, {len(ids_list)} requests a run, batch {b})\n")
    print("| contender | kind | drafted | steps a run | ms a run | tokens a run | tokens/s |")
    print("|---|---|---|---|---|---|---|")
    for name, *_ in contenders:
        print(f"| {name} | all | | | {totals[name] * 1e3 / runs:.0f} | | |")
        for key in sorted(k for k in summed if k[0] == name):
            steps, seconds, tokens = summed[key]
            print(
                f"| {name} | {key[1]} | {key[2]} | {steps / runs:.1f} "
                f"| {seconds * 1e3 / runs:.1f} | {tokens / runs:.1f} | {tokens / seconds:.0f} |"
            )
    if not detail:
        return
    print(
        "\n| contender | kind | widest draft | drafts from | steps a run | ms a step "
        "| tokens a step | ms a run |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for name, *_ in contenders:
        for key in sorted(k for k in table if k[0] == name):
            steps, seconds, tokens = table[key]
            print(
                f"| {name} | {key[1]} | {key[2]} | {key[3]} | {steps / runs:.1f} "
                f"| {seconds / steps * 1e3:.2f} | {tokens / steps:.2f} "
                f"| {seconds * 1e3 / runs:.1f} |"
            )


def phases(pair, ids_list, runs: int, b: int, hybrid: bool) -> None:
    timers = Timers()
    for cls, name in PHASES:
        timers.wrap(cls, name)
    per: dict[str, dict[str, list[float]]] = collections.defaultdict(
        lambda: collections.defaultdict(list)
    )

    def record(name, steps, seconds, admitted):
        if steps and len(steps) == b and not admitted:
            if {(s.proposed, s.source) for s in steps.values()} == {(1, "model")}:
                per[name]["step"].append(seconds)
                for label, spent in timers.spent.items():
                    per[name][label].append(spent)
        timers.clear()

    # The proposer's class is known once a pair's decoder exists.
    probe = batch.new_decoder(pair)
    if probe.proposer is not None:
        for name in PROPOSER_PHASES:
            timers.wrap(type(probe.proposer), name)
    contenders = [("none", "none", 1, None), ("auto", "model", "auto", None)]
    contenders += [("K=1", "model", 1, None)]
    run_cells(pair, ids_list, contenders, runs, b, record, hybrid)
    labels = sorted({label for name in ("auto", "K=1") for label in per[name]} - {"step"})
    print(
        f"\n### A step where every row drafted one model token: ms a step, by part "
        f"({runs} runs, batch {b})\n"
    )
    print("| part | auto | K=1 | auto - K=1 |")
    print("|---|---|---|---|")
    for label in ["step", *labels]:
        got = []
        for name in ("auto", "K=1"):
            steps = len(per[name]["step"]) or 1
            got.append(sum(per[name][label]) / steps * 1e3)
        print(f"| {label} | {got[0]:.3f} | {got[1]:.3f} | {got[0] - got[1]:+.3f} |")
    print(f"\n(steps: auto {len(per['auto']['step'])}, K=1 {len(per['K=1']['step'])})")


def caps(pair, ids_list, runs: int, b: int, hybrid: bool) -> None:
    contenders = [("none", "none", 1, None), ("auto", "model", "auto", DEFAULT_CAP)]
    contenders += [(f"auto, cap {c}", "model", "auto", c) for c in (1, 2, 3)]
    contenders += [("K=1", "model", 1, DEFAULT_CAP), ("K=2", "model", 2, DEFAULT_CAP)]
    contenders += [("control", "none", 1, DEFAULT_CAP)]  # plain against plain: the noise
    ratios = run_cells(pair, ids_list, contenders, runs, b, lambda *a: None, hybrid)
    print(
        f'\n### "auto" with its model drafts capped ({runs} runs, batch {b}): '
        "tokens/s over plain decoding's, median (range)\n"
    )
    print("| " + " | ".join(name for name, *_ in contenders[1:]) + " |")
    print("|" + "---|" * (len(contenders) - 1))
    cells = [
        f"{statistics.median(ratios[n]):.3f} ({min(ratios[n]):.2f}-{max(ratios[n]):.2f})"
        for n, *_ in contenders[1:]
    ]
    print("| " + " | ".join(cells) + " |")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--per-run", type=int, default=2, help="requests per run, times batch")
    ap.add_argument("--only", choices=("kinds", "phases", "caps"))
    ap.add_argument("--no-hybrid", action="store_true", help="auto without lookup drafts")
    ap.add_argument("--detail", action="store_true", help="kinds: by widest draft and source")
    args = ap.parse_args(argv)
    hybrid = not args.no_hybrid
    pair = engine.load_pair(DEMO_TARGET, DEMO_DRAFT)
    prompts = [ids for _, ids in prompt_sets.code_prompts(pair.tokenizer, 16, 48)]
    n = args.batch * args.per_run
    ids_list = (prompts * n)[:n]
    without = "" if hybrid else ', "auto" without prompt-lookup drafts'
    print(f"# auto_parts: demo pair{without}, {pair.info()['blas']}")
    # "phases" last: its timers stay wrapped around the methods.
    if args.only in (None, "kinds"):
        kinds(pair, ids_list, args.runs, args.batch, hybrid, args.detail)
    for name, table in (("caps", caps), ("phases", phases)):
        if args.only in (None, name):
            table(pair, ids_list, args.runs, args.batch, hybrid)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
