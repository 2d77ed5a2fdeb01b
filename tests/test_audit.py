"""Audit mode: greedy lines re-run target-only on the demo pair; matches and mismatches
are counted in the batch hash and shown by spec-status (human and --json)."""

from __future__ import annotations

import json
import logging
import random

import pytest
from click.testing import CliRunner

import engine
import engine.core
from jobstore import store
from jobstore.jobfile import parse_line
from jobstore.lines import dumps
from producer import cli
from worker import audit
from worker.execute import execute as run_line

PROMPTS = ["def fibonacci(n):", "import os\nimport sys\n", "class Stack:\n    def __init__(self):"]


@pytest.fixture(scope="module")
def demo():
    return engine.load_pair()


def job(i: int, **fields):
    body = {"custom_id": f"r{i}", "prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": 12}
    body["speculative"] = {"num_draft_tokens": 3}  # a fixed k: every step drafts
    body.update(fields)
    (line,) = parse_line(i + 1, json.dumps(body).encode())
    return line


@pytest.fixture
def batch(redis_env):
    """An existing batch hash (audit counts only into batches that exist)."""
    batch_id = redis_env.batch_id()
    redis_env.conn.hset(redis_env.keys.batch(batch_id), "created_at", "0")
    redis_env.conn.zadd(redis_env.keys.order(batch_id), {"c:r0": 1})
    return batch_id


@pytest.fixture
def execute(redis_env):
    """Run a line as a worker with --audit 1.0 does: generate (and maybe audit), then
    store it once."""
    auditor = audit.Auditor(1.0, random.Random(0))

    def run(pair, alias, batch_id, line):
        outcome = run_line(pair, alias, batch_id, line, auditor=auditor)
        store.store_line(
            redis_env.conn,
            redis_env.keys,
            batch_id,
            f"c:{line.custom_id}",
            dumps(outcome.line),
            ok=outcome.ok,
            counters=outcome.counters,
            worker="w1",
        )
        return outcome

    return run


def counts(env, batch_id: str) -> dict:
    status = CliRunner().invoke(cli.status, [batch_id, "--json"], catch_exceptions=False)
    assert status.exit_code == 0, status.output
    return json.loads(status.output)["audit"]


def test_at_rate_1_every_greedy_line_is_audited_and_matches(demo, redis_env, batch, execute):
    greedy = [job(i, temperature=0) for i in range(3)]
    assert [execute(demo, "demo", batch, j).audited for j in greedy] == [True, True, True]
    # Not audited: sampled lines (no single right answer) and target-only lines.
    assert execute(demo, "demo", batch, job(3, temperature=0.8, seed=1)).audited is None
    assert execute(demo, "demo", batch, job(4, speculative={"drafter": "none"})).audited is None
    assert counts(redis_env, batch) == {"checked": 3, "mismatches": 0}
    human = CliRunner().invoke(cli.status, [batch], catch_exceptions=False).output
    assert "  audit: 3 checked against target-only, 0 mismatches\n" in human


def test_a_broken_speculative_path_is_reported_as_a_mismatch(
    demo, redis_env, batch, execute, monkeypatch, caplog
):
    right = engine.core.accept_greedy

    def broken(best, drafts):
        # After drafting, emit a token one off the target's: target-only (no drafts) is
        # untouched, so only the speculative path is wrong.
        n, nxt = right(best, drafts)
        return n, (nxt ^ 1) if drafts else nxt

    monkeypatch.setattr(engine.core, "accept_greedy", broken)
    with caplog.at_level(logging.ERROR, logger="specfleet.audit"):
        outcomes = [execute(demo, "demo", batch, job(i, temperature=0)) for i in range(2)]
    assert [o.audited for o in outcomes] == [False, False]
    assert all(o.ok for o in outcomes)  # the result line is still written
    assert counts(redis_env, batch) == {"checked": 2, "mismatches": 2}
    assert f"audit {batch} line 1 (r0): MISMATCH" in caplog.text
    human = CliRunner().invoke(cli.status, [batch], catch_exceptions=False).output
    assert "audit: 2 checked against target-only, 2 mismatches (speculative output differed" in (
        human
    )


def test_the_rate_samples_greedy_lines(demo):
    request = engine.GenerationRequest(prompt="x", max_tokens=2, temperature=0.0)
    result = engine.generate(demo, request)
    rng = random.Random(7)
    draws = [audit.maybe_audit(demo, request, result, 0.25, rng) for _ in range(40)]
    same = random.Random(7)
    expected = [same.random() < 0.25 for _ in range(40)]
    assert [d is not None for d in draws] == expected and any(expected)
    assert {d for d in draws if d is not None} == {True}
    assert audit.maybe_audit(demo, request, result, 0.0, rng) is None


def test_a_line_that_runs_twice_is_counted_once(demo, redis_env, batch, execute):
    # A job delivered twice (its worker froze past its heartbeat) is audited by both
    # runs, but only the run that stores the line counts its audit.
    line = job(0, temperature=0)
    assert [execute(demo, "demo", batch, line).audited for _ in range(2)] == [True, True]
    assert counts(redis_env, batch) == {"checked": 1, "mismatches": 0}


def test_status_without_audits_says_zero_and_prints_no_audit_line(redis_env, batch):
    assert counts(redis_env, batch) == {"checked": 0, "mismatches": 0}
    human = CliRunner().invoke(cli.status, [batch], catch_exceptions=False).output
    assert "audit" not in human


@pytest.mark.parametrize("rate", [-0.1, 1.5])
def test_a_rate_outside_0_1_is_refused(redis_env, rate):
    with pytest.raises(ValueError, match=f"audit rate must be in \\[0, 1\\], got {rate}"):
        audit.Auditor(rate)


def _worker_has_audit_option() -> bool:
    from worker.cli import worker

    return any("--audit" in getattr(p, "opts", ()) for p in worker.params)


@pytest.mark.skipif(not _worker_has_audit_option(), reason="spec-worker --audit not wired yet")
def test_a_worker_with_audit_1_checks_every_greedy_line(redis_env, start_worker, tmp_path):
    from conftest import PAIR_ARGS

    path = tmp_path / "jobs.jsonl"
    rows = [
        {"custom_id": f"g{i}", "prompt": PROMPTS[i], "max_tokens": 6, "temperature": 0}
        for i in range(3)
    ]
    rows.append({"custom_id": "s", "prompt": "x", "max_tokens": 6, "temperature": 0.9})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    batch_id = redis_env.batch_id()
    assert redis_env.run("spec-submit", str(path), "--batch-id", batch_id).returncode == 0
    worker = start_worker("--burst", "--audit", "1.0", *PAIR_ARGS)
    assert worker.wait(timeout=180) == 0, worker.log
    state = json.loads(redis_env.run("spec-status", batch_id, "--json").stdout)
    assert state["request_counts"]["completed"] == 4
    assert state["audit"] == {"checked": 3, "mismatches": 0}, worker.log
