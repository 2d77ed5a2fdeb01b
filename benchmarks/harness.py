"""Contenders and the round-robin timer: every ratio comes from runs interleaved in one
process, so drift on a noisy machine (other jobs, thermal state) hits all alike.

A contender is a function `(ids, max_tokens) -> Run`; `round_robin` runs every
contender on every prompt, rotating the order from prompt to prompt, and sums tokens
and seconds per contender.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import engine  # first: loads OpenBLAS before mlx is imported

# isort: split
import mlx.core as mx
from mlx_lm import stream_generate
from mlx_lm.generate import speculative_generate_step
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.sample_utils import make_sampler


@dataclass
class Run:
    """One generation: the tokens (EOS excluded), and our engine's counters if any."""

    tokens: list[int]
    steps: int  # target forward passes after the prefill (verify steps)
    stats: engine.SpecStats | None = None


@dataclass
class Tally:
    """What one contender did on each prompt, and sums over the prompts."""

    tokens: int = 0
    steps: int = 0
    seconds: float = 0.0
    prefill_seconds: float = 0.0  # target (+ draft) prefill of the same prompts, measured apart
    outputs: list[list[int]] = field(default_factory=list)
    rates: list[float] = field(default_factory=list)  # tokens/s on each prompt
    decode_rates: list[float] = field(default_factory=list)  # the same, prefill removed
    stats: engine.SpecStats | None = None

    def add(self, run: Run, seconds: float, prefill: float) -> None:
        n = len(run.tokens)
        self.tokens += n
        self.steps += run.steps
        self.seconds += seconds
        self.prefill_seconds += prefill
        self.outputs.append(run.tokens)
        self.rates.append(n / seconds if seconds else 0.0)
        self.decode_rates.append(n / (seconds - prefill) if seconds > prefill else 0.0)
        if run.stats is not None:
            if self.stats is None:
                self.stats = engine.SpecStats(drafter=run.stats.drafter)
            self.stats.merge(run.stats)

    @property
    def acceptance_length(self) -> float:
        """Tokens per target pass (1.0 for plain decoding)."""
        return self.tokens / self.steps if self.steps else 0.0

    @property
    def rate(self) -> float:
        """Tokens per second, end to end (prefill included), as a user sees it."""
        return self.tokens / self.seconds if self.seconds else 0.0


def ratios(t: Tally, base: Tally, decode: bool = False) -> list[float]:
    """Per-prompt speed ratios of t over base (both ran each prompt back to back)."""
    a, b = (t.decode_rates, base.decode_rates) if decode else (t.rates, base.rates)
    return [x / y for x, y in zip(a, b, strict=True) if y]


def median_ratio(t: Tally, base: Tally, decode: bool = False) -> float:
    """The median of the per-prompt ratios: a load burst that hits one run of one
    contender moves one ratio, not the result."""
    r = ratios(t, base, decode)
    return statistics.median(r) if r else 0.0


@dataclass(frozen=True)
class Contender:
    name: str
    run: Callable[[list[int], int], Run]
    uses_draft: bool = False  # its prefill includes a draft prefill


# -- contenders ------------------------------------------------------------------------


def mlx_target_only(pair) -> Callable[[list[int], int], Run]:
    """mlx-lm stream_generate, target only, greedy: the baseline."""

    def run(ids, n):
        out = [
            r.token
            for r in stream_generate(pair.target, pair.tokenizer, mx.array(ids), max_tokens=n)
            if r.finish_reason != "stop"
        ]
        return Run(out, len(out))

    return run


def mlx_speculative(pair, k: int) -> Callable[[list[int], int], Run]:
    """mlx-lm stream_generate with its draft model at num_draft_tokens=k, greedy."""

    def run(ids, n):
        responses = stream_generate(
            pair.target,
            pair.tokenizer,
            mx.array(ids),
            max_tokens=n,
            draft_model=pair.draft,
            num_draft_tokens=k,
        )
        tokens, steps, mid_step = [], 0, False
        for r in responses:
            steps += not r.from_draft  # a verify step ends with the target's own token
            mid_step = r.from_draft
            if r.finish_reason != "stop":
                tokens.append(r.token)
        return Run(tokens, steps + mid_step)

    return run


def ours(pair, k, drafter: str = "model", temperature: float = 0.0, seed: int = 0):
    """Our engine.generate with num_draft_tokens=k (an int or "auto")."""

    def run(ids, n):
        request = engine.GenerationRequest(
            prompt_ids=ids,
            max_tokens=n,
            temperature=temperature,
            seed=seed,
            num_draft_tokens=k,
            drafter=drafter,
        )
        result = engine.generate(pair, request)
        return Run(result.token_ids, result.stats.num_spec_steps, result.stats)

    return run


def mlx_acceptance_length(pair, ids: list[int], n: int, k: int, temperature: float, seed: int):
    """(tokens, verify steps) of mlx-lm's speculative decoding at a temperature.

    mlx-lm yields each token with a from_draft flag; a verify step ends with the one
    token that is not from the draft (or with max_tokens, mid-block).
    """
    mx.random.seed(seed)
    sampler = make_sampler(temp=temperature)
    tokens = steps = 0
    mid_step = False  # the last token seen came from the draft: its step is not closed
    eos = set(pair.tokenizer.eos_token_ids)
    for tok, _, from_draft in speculative_generate_step(
        mx.array(ids), pair.target, pair.draft, num_draft_tokens=k, max_tokens=n, sampler=sampler
    ):
        steps += not from_draft
        mid_step = from_draft
        if int(tok) in eos:
            break
        tokens += 1
    return tokens, steps + mid_step


def prefill_seconds(model, ids: list[int]) -> float:
    """Seconds for `model` to take prompt[:-1] into a fresh KV cache (what every
    contender does before its first decode step)."""
    cache = make_prompt_cache(model)
    t0 = time.perf_counter()
    if len(ids) > 1:
        model(mx.array([ids[:-1]]), cache=cache)
        mx.eval([c.state for c in cache])
    return time.perf_counter() - t0


# -- the timer ---------------------------------------------------------------------------


def rate_table(tallies: dict[str, Tally], base: Tally, what: str) -> list[str]:
    """Markdown lines: a row per contender (tokens/s, tokens per target pass, its median
    per-prompt ratio to `base`; the contender named "plain" reads 1.00x)."""
    lines = [
        f"| {what} | tokens/s | tokens per target pass | vs plain (median) |",
        "| --- | --- | --- | --- |",
    ]
    for name, t in tallies.items():
        ratio = median_ratio(t, base) if name != "plain" else 1.0
        lines.append(f"| {name} | {t.rate:.1f} | {t.acceptance_length:.2f} | {ratio:.2f}x |")
    return lines


def round_robin(
    contenders: list[Contender],
    prompts: list[tuple[str, list[int]]],
    max_tokens: int,
    pair,
    log: Callable[[str], None] = print,
    probe: Callable[[list[int]], None] | None = None,
) -> dict[str, Tally]:
    """Run every contender on every prompt, the order rotated per prompt; `probe`
    (cost measurements) runs once per prompt too, so it sees the same conditions."""
    tallies = {c.name: Tally() for c in contenders}
    for i, (name, ids) in enumerate(prompts):
        if probe is not None:
            probe(ids)
        pre_t = prefill_seconds(pair.target, ids)
        pre_d = prefill_seconds(pair.draft, ids) if pair.draft is not None else 0.0
        shift = i % len(contenders)
        order = contenders[shift:] + contenders[:shift]
        t_prompt = time.perf_counter()
        for c in order:
            t0 = time.perf_counter()
            run = c.run(ids, max_tokens)
            seconds = time.perf_counter() - t0
            tallies[c.name].add(run, seconds, pre_t + (pre_d if c.uses_draft else 0.0))
        log(
            f"  prompt {i + 1}/{len(prompts)} ({len(ids)} tokens, {name}): "
            f"{time.perf_counter() - t_prompt:.1f} s"
        )
    return tallies


def warm_up(contenders: list[Contender], ids: list[int], max_tokens: int = 8) -> None:
    """One short untimed run each: kernels compiled, caches allocated."""
    for c in contenders:
        c.run(ids, max_tokens)


def batched_rate(pair, ids_list, batch: int, drafter: str, max_tokens: int) -> tuple[float, float]:
    """(tokens/s, draft tokens per row-step) of one `generate_many` over the prompts in
    `ids_list`, `batch` rows at a time, greedy, "auto"."""
    requests = [
        engine.GenerationRequest(
            prompt_ids=ids, max_tokens=max_tokens, drafter=drafter, num_draft_tokens="auto"
        )
        for ids in ids_list
    ]
    t0 = time.perf_counter()
    tokens = steps = drafted = 0
    for _, res in engine.generate_many(pair, requests, max_batch=batch):
        tokens += len(res.token_ids)
        steps += res.stats.num_spec_steps
        drafted += res.stats.num_draft_tokens
    return tokens / (time.perf_counter() - t0), drafted / max(steps, 1)
