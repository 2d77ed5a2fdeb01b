"""Worker reliability, with real processes: a line run again after its worker was killed
ends cleanly, a request record that cannot be parsed becomes an error line at once, and a
Redis that refuses writes (maxmemory reached) is waited for like an outage.

Every test prints one `figures:` line; docs/reliability.md quotes them
(`pytest tests/test_worker_reliability.py -s`).
"""

from __future__ import annotations

import ast
import importlib.metadata
import inspect
import json
import signal
import time
from pathlib import Path

import pytest
from conftest import PAIR_ARGS, stored, wait_until
from rq.registry import FailedJobRegistry
from test_faults import (  # noqa: F401 (private_redis is a fixture)
    FAST_HEARTBEAT,
    _done,
    _running,
    _tokens_counted_once,
    figures,
    private_redis,
)
from test_queue import _collect, read_jsonl, write_jobs


def _failed_ids(env, batch: str) -> list[str]:
    registry = FailedJobRegistry(env.keys.queue_name("demo"), connection=env.conn)
    return [j for j in registry.get_job_ids() if j.startswith(f"{batch}-")]


# -- a job run again after its worker was killed ------------------------------------------


@pytest.mark.parametrize("rows", ["1", "4"])
def test_a_job_rerun_after_a_kill_ends_cleanly(
    redis_env, start_worker, slow_pair_args, tmp_path, rows
):
    """RQ keeps a dead run's execution id for a minute after it expired; the run after
    the kill must still finish as a plain success: no error, no failed-registry entry."""
    redis_env.env.update(FAST_HEARTBEAT)
    n = 6
    lines = [
        {"custom_id": f"k{i}", "prompt": "def parse(text):", "max_tokens": 8, "temperature": 0}
        for i in range(n)
    ]
    jobs = write_jobs(tmp_path / "jobs.jsonl", lines)
    batch = redis_env.batch_id("rerun")
    assert redis_env.run("spec-submit", jobs, "--batch-id", batch).returncode == 0
    doomed = start_worker("--batch", rows, *slow_pair_args)
    want = min(int(rows), 2)  # a batched worker dies holding several claimed jobs
    victims = wait_until(
        lambda: (found := list(_running(redis_env, batch))) and len(found) >= want and found,
        timeout=60,
        what=f"{want} job(s) to start",
        poll=0.01,
    )
    doomed.signal(signal.SIGKILL)
    assert doomed.wait(timeout=10) == -signal.SIGKILL
    # Re-queued through their heartbeat expiry by the survivor's reaper, a retry used.
    survivor = start_worker("--batch", rows, *slow_pair_args)
    wait_until(lambda: _done(redis_env, batch) >= n, timeout=120, what="the batch")
    survivor.signal(signal.SIGTERM)
    assert survivor.wait(timeout=60) == 0, survivor.log
    assert "enqueued for retry, 1 remaining" in survivor.log  # the killed jobs came back

    results = read_jsonl(_collect(redis_env, batch, tmp_path / "r.jsonl"))
    assert sorted(r["custom_id"] for r in results) == [x["custom_id"] for x in lines]
    assert [r["error"] for r in results] == [None] * n
    assert redis_env.conn.hlen(redis_env.keys.errors(batch)) == 0
    assert _failed_ids(redis_env, batch) == []
    for said in ("not found in Redis", "internal_error", "Traceback", "error"):
        assert said not in survivor.log, survivor.log
    assert list(redis_env.conn.scan_iter(match=f"rq:job:{batch}-*")) == []  # result_ttl 0
    figures(
        "re-run after a kill" + ("" if rows == "1" else f", --batch {rows}"),
        requests=n,
        killed_mid_job=len(victims),
        error_lines=0,
        failed_registry=0,
    )


# -- a request record that cannot be parsed -----------------------------------------------


@pytest.mark.parametrize("rows", ["1", "4"])
def test_an_unreadable_request_becomes_an_error_line_at_once(
    redis_env, start_worker, tmp_path, rows
):
    lines = [{"custom_id": c, "prompt": "def f(x):", "max_tokens": 2} for c in "abcd"]
    jobs = write_jobs(tmp_path / "jobs.jsonl", lines)
    batch = redis_env.batch_id("corrupt")
    assert redis_env.run("spec-submit", jobs, "--batch-id", batch).returncode == 0
    requests = redis_env.keys.requests(batch)
    redis_env.conn.hset(requests, "c:b", "{not json")
    redis_env.conn.hset(requests, "c:c", json.dumps({"line": 3}))
    worker = start_worker("--burst", "--batch", rows, *PAIR_ARGS)
    assert worker.wait(timeout=60) == 0, worker.log

    conn, keys = redis_env.conn, redis_env.keys
    assert sorted(conn.hkeys(keys.results(batch))) == [b"c:a", b"c:d"]
    errors = {k.decode(): stored(v)["error"] for k, v in conn.hgetall(keys.errors(batch)).items()}
    where = f"the stored request cannot be read ({requests} field"
    assert errors == {
        "c:b": {
            "code": "internal_error",
            "message": f"{where} 'c:b': JSONDecodeError: Expecting property name enclosed in "
            "double quotes: line 1 column 2 (char 1)); it was not run",
            "line": 2,
        },
        "c:c": {
            "code": "internal_error",
            "message": f"{where} 'c:c': KeyError: 'custom_id'); it was not run",
            "line": 3,
        },
    }
    assert "retry" not in worker.log  # at once: no retry burned, nothing left running
    assert not _running(redis_env, batch) and _failed_ids(redis_env, batch) == []
    state = json.loads(redis_env.run("spec-status", batch, "--json").stdout)
    assert state["status"] == "completed"
    assert state["request_counts"] == {
        "total": 4,
        "queued": 0,
        "running": 0,
        "completed": 2,
        "failed": 2,
    }
    figures(f"unreadable request, --batch {rows}", requests=4, unreadable=2, error_lines=2)


# -- Redis refusing writes (maxmemory reached) ---------------------------------------------


def test_workers_wait_while_redis_is_full_and_lose_nothing(request, slow_pair_args, tmp_path):
    """maxmemory below what Redis holds (noeviction): every write is refused with OOM
    while workers are storing results; then the limit is raised with CONFIG SET."""
    _, env = request.getfixturevalue("private_redis")(
        "--save", "", "--appendonly", "no", "--maxmemory-policy", "noeviction"
    )
    env.env["SPEC_RECONNECT_CAP_S"] = "0.5"
    n = 16
    lines = [
        {"custom_id": f"m{i:02d}", "prompt": "def parse(text):", "max_tokens": 8} for i in range(n)
    ]
    jobs = write_jobs(tmp_path / "jobs.jsonl", lines)
    batch = env.batch_id("full")
    single = env.start_worker(*slow_pair_args)
    batched = env.start_worker("--batch", "8", *slow_pair_args)
    # Submitted once both listen: on a loaded machine the one that loads its pair first
    # could otherwise answer every line before the other asks for one.
    for w in (single, batched):
        w.wait_for_log("Listening on", timeout=120)
    assert env.run("spec-submit", jobs, "--batch-id", batch).returncode == 0
    wait_until(
        lambda: _done(env, batch) >= 2 and len(set(_running(env, batch).values())) == 2,
        timeout=120,
        what="both workers busy",
        poll=0.01,
    )
    env.conn.config_set("maxmemory", 1)  # under what it holds: every write is refused
    full_at = time.monotonic()
    full = "is full"
    for w in (single, batched):
        w.wait_for_log(full, timeout=30)
    done_when_full = _done(env, batch)
    time.sleep(1)
    assert _done(env, batch) == done_when_full  # nothing stored: Redis really refused
    env.conn.config_set("maxmemory", 0)
    full_s = time.monotonic() - full_at
    wait_until(lambda: _done(env, batch) >= n, timeout=180, what="the batch", poll=0.1)
    for w in (single, batched):
        assert w.proc.poll() is None, w.log  # rode it out
        w.signal(signal.SIGTERM)
    for w in (single, batched):
        assert w.wait(timeout=60) == 0, w.log
        assert w.log.count(full) == 1, w.log  # warned once
        assert "accepts writes again" in w.log, w.log
        for said in ("enqueued for retry", "exception raised while executing", "Traceback"):
            assert said not in w.log, w.log  # no job failed: no retry spent

    results = read_jsonl(_collect(env, batch, tmp_path / "r.jsonl"))
    assert sorted(r["custom_id"] for r in results) == [x["custom_id"] for x in lines]
    assert [r["error"] for r in results] == [None] * n
    assert env.conn.hlen(env.keys.errors(batch)) == 0 and _failed_ids(env, batch) == []
    _tokens_counted_once(env, batch, results)
    figures(
        "redis full",
        requests=n,
        workers="2 (one --batch 8)",
        done_before_full=done_when_full,
        full_for_s=f"{full_s:.1f}",
        results_lost=0,
        results_duplicated=0,
    )


# -- what the worker takes from RQ ---------------------------------------------------------


def test_the_worker_command_channel_stops_at_once(redis_env):
    # redis-py 8.2 waits for the pubsub thread when it is stopped, and RQ's thread sleeps
    # 60 s at a time: a --burst worker took up to a minute to exit after its last job.
    # (Mutation: rqcompat.PUBSUB_WAKE_S = 60 -> about a minute here with redis-py 8.2.)
    from rq import SimpleWorker

    from worker import rqcompat

    worker = SimpleWorker([], connection=redis_env.conn)
    rqcompat.subscribe(worker)
    time.sleep(0.2)
    worker.pubsub.unsubscribe()
    time.sleep(0.3)  # the thread has read the reply and waits for a subscription
    start = time.monotonic()
    worker.unsubscribe()  # RQ's: stops the thread, then closes the connection
    assert time.monotonic() - start < 5
    assert not worker.pubsub_thread.is_alive()


def test_every_rq_private_name_the_worker_uses_still_exists(redis_env):
    """worker.rqcompat lists them; an RQ release that renames one fails here, not in a
    worker in the middle of a batch."""
    from rq import SimpleWorker
    from rq.job import Job
    from rq.queue import Queue

    from worker import rqcompat

    instances = {
        Job: Job(connection=redis_env.conn),
        Queue: Queue("x", connection=redis_env.conn),
        rqcompat.BaseWorker: SimpleWorker([], connection=redis_env.conn),
    }
    for owner, name, params in rqcompat.PRIVATE_NAMES:
        if params is None:
            assert hasattr(instances[owner], name), f"{owner.__name__}.{name} is gone"
            continue
        found = getattr(owner, name, None)
        assert callable(found), f"{owner.__name__}.{name} is gone"
        got = tuple(inspect.signature(found).parameters)
        assert got[: len(params)] == params, (owner.__name__, name, got)
    # rqcompat's helpers run against this RQ.
    job = instances[Job]
    assert rqcompat.callback_names(job) == (None, None, None)
    worker = instances[rqcompat.BaseWorker]
    assert rqcompat.stop_requested(worker) is False
    rqcompat.stop_after_this(worker)
    assert rqcompat.stop_requested(worker) is True
    assert importlib.metadata.version("rq").startswith("3.0.")  # the range pyproject pins


def test_worker_modules_import_no_cycle():
    """Module-level and function-level imports between worker modules form no cycle."""
    root = Path(__file__).resolve().parent.parent / "worker"
    graph: dict[str, set[str]] = {}
    for path in root.glob("*.py"):
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            found |= {n.split(".")[1] for n in names if n.startswith("worker.")}
        graph[path.stem] = found & {p.stem for p in root.glob("*.py")}

    def visit(module: str, stack: tuple[str, ...]) -> None:
        assert module not in stack, " -> ".join((*stack, module))
        for imported in sorted(graph[module]):
            visit(imported, (*stack, module))

    for module in sorted(graph):
        visit(module, ())
    assert "rqworker" in graph["cli"] and "guard" in graph["runner"]


# -- two deliveries finishing in the same instant -------------------------------------------


def _deliveries(env, names):
    """A job of ours taken from its queue and run by workers `names` (in-process, no
    pair loaded): {name: (worker, its copy of the job, its execution)}, and the queue."""
    from rq import Queue
    from rq.serializers import JSONSerializer

    from worker.guard import job_class
    from worker.rqworker import SpecWorker

    conn, keys = env.conn, env.keys
    queue = Queue(keys.queue_name("demo"), connection=conn, serializer=JSONSerializer)
    job = queue.enqueue("worker.jobs.run_lines", "b", ["k"], result_ttl=0, retry=None)
    assert conn.lpop(queue.key).decode() == job.id  # taken, as RQ's dequeue does
    runs = {}
    for name in names:
        w = SpecWorker(
            [queue],
            name=f"{env.prefix}-{name}",
            connection=conn,
            serializer=JSONSerializer,
            job_class=job_class(None),
            context=None,
            refused_key=keys.refused,
            stats_key=keys.worker(name),
        )
        mine = w.job_class.fetch(job.id, connection=conn, serializer=JSONSerializer)
        execution = w.prepare_execution(mine)  # as worker.runner claims a job
        w.prepare_job_execution(mine)
        mine.ended_at = mine.started_at
        runs[name] = (w, mine, execution)
    return runs, queue


def _finished_cleanly(conn, runs, queue):
    _, job, _ = next(iter(runs.values()))
    assert not conn.exists(job.key)
    assert not any(conn.exists(e.key) for _, _, e in runs.values())
    assert not conn.exists(job.execution_registry.key)
    assert queue.count == 0, "retried"
    assert not FailedJobRegistry(queue.name, connection=conn).get_job_ids()
    assert not list(conn.scan_iter(match=f"{job.key}:*"))


def test_two_deliveries_finishing_at_once_both_end_as_success(redis_env, monkeypatch):
    """The slower of two deliveries stops as soon as it sees the line stored, so both
    often finish in the same millisecond (a CI run caught it). Here the other delivery
    finishes in the middle of this one's RQ bookkeeping: both must end as successes, the
    job and both run records gone, nothing retried and nothing failed."""
    import threading

    from worker import rqcompat

    runs, queue = _deliveries(redis_env, ["a", "b"])
    assert len(runs["a"][1].execution_registry.get_execution_ids()) == 2
    outcomes, other = {}, []
    real_forget = rqcompat.forget_dead_executions

    def b_finishes_meanwhile(job_):
        if not other:  # a's bookkeeping: b finishes now, or waits its turn
            w, mine, execution = runs["b"]
            t = threading.Thread(
                target=lambda: outcomes.update(
                    b=rqcompat.finish_job(w, mine, queue, execution, {"lines": 1})
                )
            )
            other.append(t)
            t.start()
            t.join(timeout=0.5)
        return real_forget(job_)

    monkeypatch.setattr(rqcompat, "forget_dead_executions", b_finishes_meanwhile)
    w, mine, execution = runs["a"]
    outcomes["a"] = rqcompat.finish_job(w, mine, queue, execution, {"lines": 1})
    other[0].join(timeout=30)
    assert outcomes == {"a": True, "b": True}
    _finished_cleanly(redis_env.conn, runs, queue)


def test_a_run_record_expiring_while_a_job_finishes_is_forgotten(redis_env, monkeypatch):
    """A dead run's record expires after the worker looked for dead runs and before RQ
    reads them: the job still ends as a success, not as a retry."""
    from worker import rqcompat

    runs, queue = _deliveries(redis_env, ["a", "dead"])
    _, _, dead = runs.pop("dead")
    calls = []
    real_forget = rqcompat.forget_dead_executions

    def expires_after_the_look(job_):
        calls.append(real_forget(job_))
        if len(calls) == 1:
            redis_env.conn.delete(dead.key)  # its TTL ran out just now
        return calls[-1]

    monkeypatch.setattr(rqcompat, "forget_dead_executions", expires_after_the_look)
    w, mine, execution = runs["a"]
    assert rqcompat.finish_job(w, mine, queue, execution, {"lines": 1})
    assert calls == [0, 1]
    _finished_cleanly(redis_env.conn, runs, queue)


def test_a_finish_that_outlasts_its_lock_still_ends_as_a_success(redis_env, monkeypatch):
    """A delivery waiting for Redis (full, or restarting) while it finishes may hold its
    finishing lock past FINISH_LOCK_S: the lock expires, and the success stands (not a
    failure and a retry of a stored line)."""
    from worker import rqcompat, rqworker

    monkeypatch.setattr(rqworker, "FINISH_LOCK_S", 0.2)
    runs, queue = _deliveries(redis_env, ["a"])
    real_forget = rqcompat.forget_dead_executions

    def slow_redis(job_):
        time.sleep(0.4)  # past the lock's 0.2 s
        return real_forget(job_)

    monkeypatch.setattr(rqcompat, "forget_dead_executions", slow_redis)
    w, mine, execution = runs["a"]
    assert rqcompat.finish_job(w, mine, queue, execution, {"lines": 1})
    _finished_cleanly(redis_env.conn, runs, queue)
