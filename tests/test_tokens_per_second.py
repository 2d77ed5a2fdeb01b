"""Tokens/s has one meaning: a `--batch 4` worker's figure is the same in spec-status
and in spec-report (completion tokens over its busy wall time), and a per-request
figure is shown under its own name."""

from __future__ import annotations

import json
import time

from click.testing import CliRunner

import engine
from contract.stats import tokens_per_second
from jobstore import store
from jobstore.jobfile import validate_file
from jobstore.keys import line_key
from jobstore.lines import dumps
from producer import cli
from producer.status import status
from reporting.report import Aggregate, parse_line, render
from worker.batching import decode_together


def test_a_batched_workers_tokens_per_second_is_one_figure_everywhere(redis_env, tmp_path):
    path = tmp_path / "jobs.jsonl"
    rows = [{"custom_id": f"r{i}", "prompt": f"{i} + {i} =", "max_tokens": 12} for i in range(8)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    batch = redis_env.batch_id()
    result = CliRunner().invoke(cli.submit, [str(path), "--batch-id", batch])
    assert result.exit_code == 0, result.stderr
    jobs = list(validate_file(str(path)))
    pair = engine.load_pair()

    began = time.perf_counter()
    outcomes = list(decode_together(pair, "demo", [(batch, j) for j in jobs], 4, worker="w1"))
    wall_ms = (time.perf_counter() - began) * 1000
    lines = [o.line for _, o in outcomes]
    for job, outcome in outcomes:
        stored = store.store_line(
            redis_env.conn,
            redis_env.keys,
            batch,
            line_key(job.custom_id, job.line),
            dumps(outcome.line),
            ok=True,
            counters=outcome.counters,
            worker="w1",
        )
        assert stored
    metrics = [ln["response"]["body"]["metrics"] for ln in lines]
    busy = sum(m["busy_ms"] for m in metrics)
    assert busy == sum(o.counters["busy_ms"] for _, o in outcomes)
    # Rows decoded together share the wall time: their busy times add up to it, not to
    # four times it, while their per-request generation times overlap.
    assert busy <= wall_ms + 1
    assert sum(m["generation_time_ms"] for m in metrics) > 2 * busy

    tokens = sum(ln["response"]["body"]["usage"]["completion_tokens"] for ln in lines)
    (worker,) = status(redis_env.conn, redis_env.keys, batch)["workers"]
    assert worker["tokens_per_second"] == tokens_per_second(tokens, busy) > 0
    agg = Aggregate()
    for ln in lines:
        agg.add(parse_line(json.loads(dumps(ln))))
    assert agg.workers["w1"].tokens_per_second == worker["tokens_per_second"]
    per_request = agg.workers["w1"].per_request_tokens_per_second
    assert per_request < worker["tokens_per_second"] / 2
    page = render(agg)
    assert f"<td class=n>{worker['tokens_per_second']:.1f}</td>" in page
    assert "per-request tokens/s</th>" in page and f"{per_request:.1f}</td></tr>" in page


def test_lines_that_do_not_say_their_busy_time_get_no_worker_tokens_per_second():
    agg = Aggregate()
    for i, busy in enumerate((100, None)):
        metrics = {"generation_time_ms": 400.0, **({"busy_ms": busy} if busy else {})}
        body = {"model": "m", "usage": {"completion_tokens": 20}, "metrics": metrics}
        line = {"custom_id": f"r{i}", "response": {"body": body}, "error": None}
        agg.add(parse_line(line))
    (worker,) = agg.workers.values()
    assert worker.tokens_per_second is None  # not a figure over half the time
    assert worker.per_request_tokens_per_second == 50.0
    assert "<td class=n>-</td>" in render(agg)
