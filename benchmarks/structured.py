"""Structured outputs and the request surface: what a constraint, n choices and logprobs
cost, and what forced tokens earn. Every ratio comes from contenders interleaved in one
process (A B A B ...), on the widened demo target (the demo's function at a larger
model's cost) with the demo draft.

    python benchmarks/structured.py overhead     # a constraint that forces nothing vs none, batch 1 and 8
    python benchmarks/structured.py schema       # 64 fixed-key records: forced tokens on/off, vs mlx-lm
    python benchmarks/structured.py job          # 32 chat lines, shared system message, schema, n=2, T=0.7
    python benchmarks/structured.py choices      # n=8 of one 512-token prompt vs 8 lines alone, vs batch_generate
    python benchmarks/structured.py logprobs     # logprobs + top_logprobs 5 vs without
    python benchmarks/structured.py all --params 30e6 --rounds 2

Targets (issues 47 and 48): overhead >= 0.95; schema tokens per target pass >= 1.5x
without forced drafting and tokens/s >= 1.3x mlx-lm generate_step under the same
grammar; job >= 2x an expert mlx-lm BatchGenerator script (hand-built prefix cache,
per-row llguidance mask); choices >= 4x 8 lines alone and >= 1.0x batch_generate;
logprobs >= 0.95.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from pathlib import Path

import engine  # first: loads OpenBLAS before anything imports mlx

# isort: split
import jsonschema
import mlx.core as mx
import numpy as np
from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask
from mlx_lm import batch_generate
from mlx_lm.generate import BatchGenerator, generate_step
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.sample_utils import make_sampler

from engine import GenerationRequest
from engine.batch import BatchDecoder
from engine.loading import DEMO_DRAFT, DEMO_TARGET
from engine.text import grammars

sys.path.insert(0, str(Path(__file__).resolve().parent))

import pairs  # noqa: E402
import prompts as prompt_sets  # noqa: E402

FREE_TEXT = {
    "type": "object",
    "properties": {"text": {"type": "string"}},
    "required": ["text"],
}
# The same field that cannot close within the benchmark's 48 tokens: every row runs to its
# length, as the unconstrained rows do, so the two batches thin alike (with FREE_TEXT the
# weak demo model closes some strings early, and a batch of fewer rows makes fewer tokens
# a step: a cost of the text, not of the pipeline).
FREE_TEXT_LONG = {
    "type": "object",
    "properties": {"text": {"type": "string", "minLength": 1000}},
    "required": ["text"],
}
RECORD = {  # 8 fixed keys, short values: a schema-heavy record
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 999},
        "language": {"enum": ["python", "c", "rust", "go"]},
        "is_test": {"type": "boolean"},
        "name": {"type": "string", "maxLength": 8},
        "lines": {"type": "integer", "minimum": 1, "maximum": 500},
        "complexity": {"enum": ["low", "medium", "high"]},
        "has_docstring": {"type": "boolean"},
        "summary": {"type": "string", "maxLength": 12},
    },
    "required": [
        "id",
        "language",
        "is_test",
        "name",
        "lines",
        "complexity",
        "has_docstring",
        "summary",
    ],
}
FIVE = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 16},
        "kind": {"enum": ["function", "class", "module"]},
        "lines": {"type": "integer", "minimum": 1, "maximum": 999},
        "pure": {"type": "boolean"},
        "tag": {"type": "string", "maxLength": 8},
    },
    "required": ["title", "kind", "lines", "pure", "tag"],
}


def schema(s: dict) -> dict:
    return {"type": "json_schema", "schema": s, "whitespace_flexible": False}


def load(params: float):
    target = pairs.widen(DEMO_TARGET, int(params)) if params else DEMO_TARGET
    return engine.load_pair(target, DEMO_DRAFT)


def texts(pair, n: int, length: int = 24) -> list[str]:
    """n held-out code prompts of `length` tokens, as text."""
    return [pair.tokenizer.decode(p) for p in prompt_sets.prompt_pool(pair.tokenizer, length)[:n]]


def ours(pair, requests, batch: int, force: bool = True):
    BatchDecoder.force_grammar_tokens = force
    try:
        t0 = time.perf_counter()
        results = dict(engine.generate_many(pair, requests, max_batch=batch))
        seconds = time.perf_counter() - t0
    finally:
        BatchDecoder.force_grammar_tokens = True
    tokens = sum(len(r.token_ids) for r in results.values())
    steps = sum(r.stats.num_spec_steps for r in results.values())
    return tokens, seconds, steps, results


def mask_processor(pair, constraint, prompt_len: int):
    """An mlx-lm logits processor applying llguidance's mask (what a user of mlx-lm writes)."""
    matcher = grammars(pair).matcher(constraint)
    vocab = pair.target_vocab
    bits = allocate_token_bitmask(1, vocab)
    fed = {"n": prompt_len}

    def process(tokens, logits):
        new = tokens.tolist()[fed["n"] :] if tokens.ndim == 1 else tokens[0].tolist()[fed["n"] :]
        fed["n"] += len(new)
        if new:
            matcher.consume_tokens(new)
        fill_next_token_bitmask(matcher, bits)
        allowed = np.unpackbits(bits.view(np.uint8), bitorder="little")[:vocab].astype(bool)
        return mx.where(mx.array(allowed)[None], logits, -mx.inf)

    return process


def mlx_constrained(pair, prompts, constraint, max_tokens):
    """mlx-lm generate_step, target only, one prompt at a time, under the grammar."""
    t0 = time.perf_counter()
    tokens = 0
    for p in prompts:
        ids = pair.tokenizer.encode(p)
        proc = mask_processor(pair, constraint, len(ids))
        for tok, _ in generate_step(
            mx.array(ids), pair.target, max_tokens=max_tokens, logits_processors=[proc]
        ):
            if int(tok) in pair.tokenizer.eos_token_ids:
                break
            tokens += 1
    return tokens, time.perf_counter() - t0


def report(name: str, values: list[float], target: str) -> None:
    med = statistics.median(values)
    spread = f"{min(values):.3f}-{max(values):.3f}" if len(values) > 1 else ""
    print(f"  {name}: {med:.3f}  (runs {spread})  target {target}", flush=True)


# -- the questions ---------------------------------------------------------------------


def overhead(pair, rounds: int) -> None:
    print("overhead: a free-text string field (the grammar forces only its frame) vs no constraint")
    print("  (auto: the default request, whose text, and so acceptance, changes with the JSON")
    print("  escapes; none: plain decoding, one token a step: the pipeline's own cost)")
    print("  (none, every row to its length: the string cannot close within 48 tokens, so")
    print("  both batches keep all their rows to the end: the pipeline's cost per step)")
    prompts = texts(pair, 8)
    cases = [(b, d, FREE_TEXT) for b, d in ((1, "model"), (8, "model"), (1, "none"), (8, "none"))]
    cases += [(1, "none", FREE_TEXT_LONG), (8, "none", FREE_TEXT_LONG)]
    for batch, drafter, field in cases:
        plain = [GenerationRequest(prompt=p, max_tokens=48, drafter=drafter) for p in prompts]
        constrained = [
            GenerationRequest(prompt=p, max_tokens=48, drafter=drafter, constraint=schema(field))
            for p in prompts
        ]
        ratios = []
        for r in range(rounds):
            order = [(plain, "plain"), (constrained, "constrained")]
            got = {}
            for reqs, name in order if r % 2 == 0 else order[::-1]:
                tokens, seconds, _, _ = ours(pair, reqs, batch)
                got[name] = tokens / seconds
            ratios.append(got["constrained"] / got["plain"])
        label = "auto" if drafter == "model" else "none"
        if field is FREE_TEXT_LONG:
            label += ", every row to its length"
        report(f"batch {batch}, {label}: constrained / unconstrained tokens/s", ratios, ">= 0.95")


def schema_job(pair, rounds: int) -> None:
    print("schema: 64 records of 8 fixed keys, greedy")
    prompts = [f"Record {i} of a code inventory as JSON:\n" for i in range(64)]
    c = schema(RECORD)
    reqs = [GenerationRequest(prompt=p, max_tokens=96, constraint=c) for p in prompts]
    per_pass, vs_mlx, vs_mlx8 = [], [], []
    for r in range(rounds):
        on = ours(pair, reqs[:16], 1)
        off = ours(pair, reqs[:16], 1, force=False)
        mlx = mlx_constrained(pair, prompts[:16], c, 96)
        on8 = ours(pair, reqs, 8)
        per_pass.append((on[0] / on[2]) / (off[0] / off[2]))
        vs_mlx.append((on[0] / on[1]) / (mlx[0] / mlx[1]))
        vs_mlx8.append((on8[0] / on8[1]) / (mlx[0] / mlx[1]))
        for res in list(on[3].values()) + list(on8[3].values()):
            if res.finish_reason == "stop":
                jsonschema.validate(json.loads(res.text), RECORD)
        print(
            f"    run {r}: tokens/pass {on[0] / on[2]:.2f} (forced on) vs {off[0] / off[2]:.2f} (off); "
            f"tok/s ours {on[0] / on[1]:.1f}, batch 8 {on8[0] / on8[1]:.1f}, mlx-lm {mlx[0] / mlx[1]:.1f}",
            flush=True,
        )
    report("tokens per target pass, forced on / off (batch 1)", per_pass, ">= 1.5")
    report("tokens/s ours (batch 1) / mlx-lm generate_step", vs_mlx, ">= 1.3")
    report("tokens/s ours (batch 8) / mlx-lm generate_step", vs_mlx8, "(batched)")


def system_message(pair, tokens: int = 500) -> str:
    """About `tokens` tokens of held-out code under a one-line instruction."""
    ids = [t for p in prompt_sets.prompt_pool(pair.tokenizer, 200) for t in p][:tokens]
    return "You describe code as JSON records. Context:\n" + pair.tokenizer.decode(ids)


def the_job(pair, rounds: int, batch: int = 16) -> None:
    print("job: 32 chat lines, a shared ~500-token system message, a 5-field schema, n=2, T=0.7")
    system = system_message(pair)
    c = schema(FIVE)
    lines = [
        GenerationRequest(
            messages=[
                {"role": "system", "content": system},
                {"role": "user", "content": f"Item {i}."},
            ],
            max_tokens=64,
            temperature=0.7,
            seed=100 + i,
            n=2,
            constraint=c,
        )
        for i in range(32)
    ]
    rows = [r for line in lines for r in engine.choice_requests(line)]
    tok = pair.tokenizer
    full = [
        list(tok.apply_chat_template(list(r.messages), add_generation_prompt=True)) for r in rows
    ]
    shared = 0
    while all(f[shared] == full[0][shared] for f in full) and shared < len(full[0]) - 1:
        shared += 1

    def expert():
        t0 = time.perf_counter()
        prefix = make_prompt_cache(pair.target)
        pair.target(mx.array([full[0][:shared]]), cache=prefix)
        mx.eval([cc.state for cc in prefix])
        gen = BatchGenerator(
            pair.target, stop_tokens=[[t] for t in tok.eos_token_ids], completion_batch_size=batch
        )
        procs = [[mask_processor(pair, c, len(f))] for f in full]
        uids = gen.insert(
            [f[shared:] for f in full],
            max_tokens=[64] * len(full),
            caches=[copy.deepcopy(prefix) for _ in full],
            all_tokens=[f[:shared] for f in full],
            samplers=[make_sampler(0.7)] * len(full),
            logits_processors=procs,
        )
        out = {u: [] for u in uids}
        while responses := gen.next_generated():
            for resp in responses:
                if resp.finish_reason != "stop":
                    out[resp.uid].append(resp.token)
        gen.close()
        return sum(len(v) for v in out.values()), time.perf_counter() - t0

    ratios = []
    for r in range(rounds):
        for cache in (pair.prefix.target, pair.prefix.draft) if pair.prefix is not None else ():
            if cache is not None:
                cache.clear()  # each run prefills the system message once, as the expert's
        first = r % 2 == 0
        if first:
            e = expert()
        t0 = time.perf_counter()
        results = dict(engine.generate_many(pair, rows, max_batch=batch))
        o = (sum(len(x.token_ids) for x in results.values()), time.perf_counter() - t0)
        if not first:
            e = expert()
        valid = sum(
            1
            for x in results.values()
            if x.finish_reason == "stop"
            and jsonschema.Draft202012Validator(FIVE).is_valid(json.loads(x.text))
        )
        print(
            f"    run {r}: ours {o[0] / o[1]:.1f} tok/s ({valid}/{len(rows)} finished valid), expert mlx-lm {e[0] / e[1]:.1f} tok/s",
            flush=True,
        )
        ratios.append((o[0] / o[1]) / (e[0] / e[1]))
    report("tokens/s ours / expert mlx-lm BatchGenerator", ratios, ">= 2.0")


def choices(pair, rounds: int) -> None:
    print("choices: n=8 of one 512-token prompt, 64 new tokens, T=0.8")
    system = system_message(pair, 512)
    req = GenerationRequest(prompt=system, max_tokens=64, temperature=0.8, seed=3, n=8)
    alone = engine.choice_requests(req)
    ids = pair.tokenizer.encode(system)
    vs_alone, vs_batch = [], []
    for _ in range(rounds):
        t0 = time.perf_counter()
        res = engine.generate_choices(pair, req, max_batch=8)
        o = (sum(len(x.token_ids) for x in res), time.perf_counter() - t0)
        t0 = time.perf_counter()
        a = sum(len(engine.generate(pair, x).token_ids) for x in alone)
        a = (a, time.perf_counter() - t0)
        t0 = time.perf_counter()
        b = batch_generate(
            pair.target,
            pair.tokenizer,
            [ids] * 8,
            max_tokens=64,
            sampler=make_sampler(0.8),
            return_token_ids=True,
        )
        b = (sum(len(x) for x in b.token_ids), time.perf_counter() - t0)
        print(
            f"    ours {o[0] / o[1]:.1f} tok/s, 8 alone {a[0] / a[1]:.1f}, batch_generate {b[0] / b[1]:.1f}",
            flush=True,
        )
        vs_alone.append((o[0] / o[1]) / (a[0] / a[1]))
        vs_batch.append((o[0] / o[1]) / (b[0] / b[1]))
    report("n=8 / 8 lines alone", vs_alone, ">= 4.0")
    report("n=8 / mlx-lm batch_generate of the 8 prompts", vs_batch, ">= 1.0")


def logprobs(pair, rounds: int) -> None:
    print("logprobs: logprobs + top_logprobs 5 vs none, 8 lines, batch 8")
    prompts = texts(pair, 8)
    base = [GenerationRequest(prompt=p, max_tokens=48) for p in prompts]
    lp = [
        GenerationRequest(prompt=p, max_tokens=48, logprobs=True, top_logprobs=5) for p in prompts
    ]
    ratios = []
    for r in range(rounds):
        got = {}
        for reqs, name in (
            ((base, "base"), (lp, "lp")) if r % 2 == 0 else ((lp, "lp"), (base, "base"))
        ):
            tokens, seconds, _, _ = ours(pair, reqs, 8)
            got[name] = tokens / seconds
        ratios.append(got["lp"] / got["base"])
    report("tokens/s with logprobs / without", ratios, ">= 0.95")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("what", choices=["overhead", "schema", "job", "choices", "logprobs", "all"])
    ap.add_argument("--params", type=float, default=30e6, help="widened target size (0: the demo)")
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args(argv)
    pair = load(args.params)
    print(f"target {pair.name} ({args.params:.0e} params), draft demo; {time.strftime('%Y-%m-%d')}")
    engine.generate(
        pair, GenerationRequest(prompt="def f", max_tokens=8, constraint=schema(FIVE))
    )  # warm
    todo = (
        ["overhead", "schema", "job", "choices", "logprobs"] if args.what == "all" else [args.what]
    )
    for what in todo:
        {
            "overhead": overhead,
            "schema": schema_job,
            "job": the_job,
            "choices": choices,
            "logprobs": logprobs,
        }[what](pair, args.rounds)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
