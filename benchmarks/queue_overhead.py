"""Queue overhead benchmark: what Redis + RQ + our job code add around the engine.

    python benchmarks/queue_overhead.py [--jobs 200] [--lines 100000]

Starts a private redis-server on a free port (no persistence), then:

1. Per-line overhead: submits --jobs 1-token lines with `spec-submit`, runs one
   `spec-worker --burst` on the demo pair, and takes the batch's span from its first
   line starting to its last line stored (`started_at`, `last_done_at` of the batch
   hash; the worker is never idle in between: the queue is full); a line's overhead
   is the span per line minus the engine's own `metrics.generation_time_ms`. (Lines
   that finish together are stored together, so the gaps between single stores that
   this used to time no longer exist.)
2. `spec-submit` of a --lines-line job file (no worker running), wall time.
3. `spec-collect` of the same batch after --lines fake results were stored with
   `jobstore.store.store_line`, exactly as the worker stores them, wall time.

Prints its table (and writes it to the `queue` section of --out FILE).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import report  # noqa: E402
from private_redis import private_redis, script  # noqa: E402

from jobstore import store  # noqa: E402
from jobstore.jobfile import JobLine  # noqa: E402
from jobstore.keys import Keys  # noqa: E402
from jobstore.lines import Choice, dumps, result_line, unpack  # noqa: E402

PROMPTS = ["def fibonacci(n):", "class Stack:\n    def push(self, item):", "import os\n\ndef walk("]


def log(message: str) -> None:
    print(f"[{time.monotonic() - START:7.1f}s] {message}", file=sys.stderr, flush=True)


START = time.monotonic()


def write_jobs(path: Path, n: int, max_tokens: int) -> None:
    with path.open("w") as f:
        for i in range(n):
            line = {"custom_id": f"r{i:06d}", "prompt": PROMPTS[i % len(PROMPTS)]}
            line.update(max_tokens=max_tokens, temperature=0)
            f.write(json.dumps(line) + "\n")


def run(env: dict, *args: str, timeout: float = 900) -> tuple[subprocess.CompletedProcess, float]:
    t0 = time.perf_counter()
    proc = subprocess.run(
        [script(args[0]), *args[1:]], env=env, capture_output=True, text=True, timeout=timeout
    )
    seconds = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(args)} failed ({proc.returncode}):\n{proc.stderr}")
    return proc, seconds


def per_job_overhead(conn, env, keys: Keys, tmp: Path, n: int, worker_args: list[str]) -> dict:
    jobs = tmp / "jobs-1token.jsonl"
    write_jobs(jobs, n, max_tokens=1)
    batch = f"overhead_{uuid.uuid4().hex[:8]}"
    run(env, "spec-submit", str(jobs), "--batch-id", batch)
    log(f"submitted {n} 1-token jobs; starting spec-worker --burst")
    t0 = time.perf_counter()
    with (tmp / "worker.log").open("w") as worker_log:
        subprocess.run(
            [script("spec-worker"), "--burst", *worker_args],
            env=env,
            stdout=worker_log,
            stderr=subprocess.STDOUT,
            timeout=1800,
            check=True,
        )
    worker_s = time.perf_counter() - t0
    order = [k.decode() for k in conn.lrange(keys.done(batch), 0, -1)]
    lines = conn.hmget(keys.results(batch), order)
    engine_ms = [
        json.loads(unpack(line, 1 << 26))["response"]["body"]["metrics"]["generation_time_ms"]
        for line in lines
    ]
    if len(engine_ms) != n:
        raise SystemExit(f"saw {len(engine_ms)} results of {n}")
    started, last = conn.hmget(keys.batch(batch), "started_at", "last_done_at")
    span_ms = (float(last) - float(started)) * 1000  # first line started -> last stored
    return {
        "jobs": n,
        "mean_ms": (span_ms - sum(engine_ms)) / n,
        "mean_line_ms": span_ms / n,
        "median_engine_ms": statistics.median(engine_ms),
        "worker_s": worker_s,
    }


def fake_results(conn, keys: Keys, batch: str, chunk: int = 1000) -> int:
    """Store a result line for every request of the batch, as worker.jobs does."""
    records = conn.hgetall(keys.requests(batch))
    metrics = {
        "time_to_first_token_ms": 8.1,
        "generation_time_ms": 310.5,
        "tokens_per_second": 51.5,
        "speculative_decoding": {"drafter": "model", "num_spec_steps": 6},
    }
    usage = {"prompt_tokens": 5, "completion_tokens": 16, "total_tokens": 21}
    stats = {"drafter": "model", "num_spec_steps": 6, "num_draft_tokens": 12}
    counters = store.result_counters(usage, stats, busy_ms=311)
    items = list(records.items())
    for i in range(0, len(items), chunk):
        with conn.pipeline(transaction=False) as pipe:
            for key, record in items[i : i + chunk]:
                job = JobLine.from_record(json.loads(record))
                line = result_line(
                    batch, job, "demo", [Choice(" return n", "length")], usage, metrics, None
                )
                store.store_line(
                    pipe, keys, batch, key.decode(), dumps(line), ok=True, counters=counters
                )
            pipe.execute()
    return len(items)


def submit_and_collect(conn, env, keys: Keys, tmp: Path, n: int) -> dict:
    jobs = tmp / "jobs-100k.jsonl"
    write_jobs(jobs, n, max_tokens=16)
    batch = f"big_{uuid.uuid4().hex[:8]}"
    log(f"spec-submit of {n:,} lines")
    _, submit_s = run(env, "spec-submit", str(jobs), "--batch-id", batch)
    queued = conn.llen(f"rq:queue:{keys.queue_name('demo')}")
    log(f"  {submit_s:.1f} s; {queued:,} jobs queued; storing {n:,} fake results")
    stored = fake_results(conn, keys, batch)
    out = tmp / "results.jsonl"
    log("spec-collect")
    _, collect_s = run(env, "spec-collect", batch, "-o", str(out))
    with out.open("rb") as f:
        written = sum(1 for _ in f)
    return {
        "lines": n,
        "submit_s": submit_s,
        "queued": queued,
        "stored": stored,
        "collect_s": collect_s,
        "written": written,
    }


def render(over: dict, big: dict, facts: dict) -> str:
    targets = [
        report.Target("mean per-line overhead (1-token jobs)", over["mean_ms"], 5, " ms", True),
        report.Target(f"spec-submit, {big['lines']:,} lines", big["submit_s"], 15, " s", True),
        report.Target(f"spec-collect, {big['lines']:,} lines", big["collect_s"], 15, " s", True),
    ]
    rows = [
        ["jobs (1 token each, greedy)", str(over["jobs"])],
        [
            "mean time per line (first line started to last line stored)",
            f"{over['mean_line_ms']:.2f} ms",
        ],
        ["median engine time (generation_time_ms)", f"{over['median_engine_ms']:.2f} ms"],
        ["mean overhead (time per line - engine time)", f"{over['mean_ms']:.2f} ms"],
        ["worker process wall time (incl. start-up and pair load)", f"{over['worker_s']:.1f} s"],
        [f"spec-submit wall time ({big['lines']:,} lines, no worker)", f"{big['submit_s']:.1f} s"],
        ["jobs in the RQ queue after submit", f"{big['queued']:,}"],
        [
            f"spec-collect wall time ({big['stored']:,} stored results)",
            f"{big['collect_s']:.1f} s",
        ],
        ["lines written by spec-collect", f"{big['written']:,}"],
    ]
    return "\n\n".join(
        [
            "## Queue overhead (`benchmarks/queue_overhead.py`)",
            f"Command: `{report.command_line()}`",
            report.machine_facts(facts, mlx=False),
            "### Targets",
            report.targets_table(targets),
            "### Measurements",
            report.table(["measure", "value"], rows),
            "A line's time in the system is the batch's span (its first line started to "
            "its last line stored, from the batch hash; the queue is never empty, so the "
            "worker never waits in between) divided by its lines; overhead is that minus the "
            "engine's `generation_time_ms`: dequeue, vetting, heartbeat thread, reading the "
            "requests, building and storing the result lines, RQ's bookkeeping. Wall times "
            "of spec-submit and spec-collect include interpreter start-up.",
        ]
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=200)
    parser.add_argument("--lines", type=int, default=100_000)
    parser.add_argument("--out", type=Path, help="also write the report's section here")
    parser.add_argument("--target", help="worker target (default: the demo pair)")
    parser.add_argument("--draft")
    args = parser.parse_args(argv)
    worker_args = ["--alias", "demo"]
    if args.target:
        worker_args += ["--target", args.target] + (["--draft", args.draft] if args.draft else [])

    with tempfile.TemporaryDirectory(prefix="queue-overhead-") as tmp_name:
        tmp = Path(tmp_name)
        with private_redis(tmp, "qo", stop_s=10) as redis:
            conn, env, keys = redis.conn, redis.env, redis.keys
            over = per_job_overhead(conn, env, keys, tmp, args.jobs, worker_args)
            log(f"mean overhead {over['mean_ms']:.2f} ms/line")
            big = submit_and_collect(conn, env, keys, tmp, args.lines)
            version = conn.info("server")["redis_version"]
    import rq

    facts = {"redis-server": version, "rq": rq.__version__}
    md = render(over, big, facts)
    report.publish(md, args.out, "queue")
    return 0


if __name__ == "__main__":
    sys.exit(main())
