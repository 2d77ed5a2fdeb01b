"""`spec-worker` with a stub engine: every line is answered at once with one fixed token.

    python benchmarks/stub_worker.py [spec-worker options]   # e.g. --burst --batch 8

Everything but the model is the real worker: RQ claiming and vetting, heartbeats and
the reaper, the job runner (`worker.runner`, one job or `--batch N`), result lines built
by `worker.execute`, and storing through `jobstore.store`. So what it costs Redis per
line is what a real worker costs it, with the engine's time taken out: the queue
benchmark (`benchmarks/queue_scale.py`) and the Redis-cost tests use it. The answer is
a 1-token completion (" x") with the statistics of one verify step of the draft.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import engine  # noqa: E402
from jobstore import config  # noqa: E402
from worker import cli  # noqa: E402


class StubPair:
    """What the worker reads of a pair, without a model."""

    name = "demo"
    context_length = 1024
    target_path = str(config.DEMO_PAIR_DIR / "target")  # its tokenizer.json is registered
    draft_path = None
    tokenizer = None

    def info(self) -> dict:
        return {"name": self.name, "stub": "one fixed token per line, no model"}


def stub_result(request: engine.GenerationRequest) -> engine.GenerationResult:
    """A 1-token answer, shaped as the engine's."""
    started = time.perf_counter()
    stats = engine.SpecStats(
        drafter="model", num_spec_steps=1, num_emitted_tokens=1, acceptance_histogram=[1]
    )
    text = request.prompt or "".join(m["content"] for m in request.messages or [])
    prompt_tokens = max(1, len(text) // 4)
    ms = (time.perf_counter() - started) * 1000
    return engine.GenerationResult(
        text=" x",
        token_ids=[87],
        finish_reason="length",
        usage={
            "prompt_tokens": prompt_tokens,
            "completion_tokens": 1,
            "total_tokens": prompt_tokens + 1,
        },
        metrics={
            "time_to_first_token_ms": round(ms, 3),
            "generation_time_ms": round(ms, 3),
            "tokens_per_second": 0.0,
            "speculative_decoding": stats.to_dict(),
        },
        stats=stats,
    )


def stub_generate(pair, request):
    return stub_result(request)


def stub_generate_many(pair, requests, max_batch=16, expired=None):
    """Take up to max_batch requests (lazily, as the engine does), answer them, repeat."""
    waiting = iter(enumerate(requests))
    while True:
        rows = []
        for item in waiting:
            rows.append(item)
            if len(rows) >= max_batch:
                break
        if not rows:
            return
        for i, request in rows:
            yield i, stub_result(request)


def stub_generate_choices(pair, request, max_batch=16):
    """A line's n choices, each its own stub row (engine.choice_requests' seeds)."""
    return [stub_result(r) for r in engine.choice_requests(request)]


def main(argv: list[str] | None = None) -> None:
    engine.generate = stub_generate
    engine.generate_many = stub_generate_many
    engine.generate_choices = stub_generate_choices
    cli._load_pair = lambda name, target, draft: StubPair()
    cli.worker.main(args=argv, prog_name="spec-worker (stub engine)")


if __name__ == "__main__":
    main()
