"""spec-submit when things go wrong on the submit side, against real redis-servers:
Redis full mid-file, a re-submitted file whose lines moved, two submits of one batch
at once, and a prompt of megabytes. Each test failed before its fix."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from click.testing import CliRunner
from conftest import PAIR_ARGS, script
from test_faults import private_redis  # noqa: F401 - a fixture

from jobstore import config
from producer import cli
from producer.tokencount import WINDOW_CHARS

FULL_REDIS = ("--save", "", "--appendonly", "no", "--maxmemory", "4mb")
FULL_REDIS += ("--maxmemory-policy", "noeviction")

#: Peak RSS allowed to spec-submit refusing one prompt just under the 8 MiB line cap
#: (it took 2.2 GB before counting stopped at the context).
LONG_PROMPT_RSS_MB = 300


def _peak_rss_mb(env, *args: str) -> tuple[subprocess.CompletedProcess, float]:
    """Run a console script in a child of a fresh interpreter; its peak RSS in MB."""
    code = (
        "import resource, subprocess, sys\n"
        "r = subprocess.run(sys.argv[1:], capture_output=True, text=True)\n"
        "sys.stdout.write(r.stdout); sys.stderr.write(r.stderr)\n"
        "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, file=sys.stderr)\n"
        "sys.exit(r.returncode)\n"
    )
    run = subprocess.run(
        [sys.executable, "-c", code, script(args[0]), *args[1:]],
        env=env.env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    *lines, rss_kb = run.stderr.splitlines()
    run.stderr = "".join(line + "\n" for line in lines)
    return run, int(rss_kb) / 1024


def test_a_prompt_of_megabytes_is_refused_in_bounded_memory(redis_env, tmp_path):
    prompt = "def f(x): return x\n" * 400_000  # 7.6 MB (8.0 MB as JSON), under the line cap
    path = tmp_path / "jobs.jsonl"
    path.write_text(
        json.dumps({"custom_id": "ok", "prompt": "def f(x):", "max_tokens": 4})
        + "\n"
        + json.dumps({"custom_id": "long", "prompt": prompt, "max_tokens": 8})
        + "\n"
    )
    assert path.stat().st_size < 8 * 1024 * 1024
    run, rss_mb = _peak_rss_mb(redis_env, "spec-submit", str(path))
    print(f"figures: long prompt: prompt_bytes={len(prompt)}, peak_rss_mb={rss_mb:.0f}")
    assert run.returncode == 1
    first = run.stderr.splitlines()[0]
    assert first.startswith(f"{path}:2: prompt: too long for model demo: at least ")
    assert first.endswith(" prompt tokens + max_tokens 8 > context 1024 tokens")
    counted = int(first.split("at least ")[1].split(" ")[0])
    assert 1016 < counted <= WINDOW_CHARS  # one window counted, not the 2.8M tokens
    assert rss_mb < LONG_PROMPT_RSS_MB


def _jobs(path, ids: list[str], pad: int = 0) -> str:
    """One short greedy request per custom_id; `pad` bytes of metadata make lines big."""
    meta = {"metadata": {"pad": "x" * pad}} if pad else {}
    path.write_text(
        "".join(
            json.dumps({"custom_id": cid, "prompt": "def f(x):", "max_tokens": 1, **meta}) + "\n"
            for cid in ids
        )
    )
    return str(path)


def _queued_jobs(env, batch: str) -> list[str]:
    """Ids of the batch's jobs waiting in the demo queue (duplicates kept)."""
    queue = f"rq:queue:{env.keys.queue_name('demo')}"
    return [j.decode() for j in env.conn.lrange(queue, 0, -1) if j.decode().startswith(batch)]


def _queued_lines(env, batch: str) -> list[str]:
    """Line keys of the batch's jobs waiting in the demo queue (duplicates kept)."""
    from rq.job import Job
    from rq.serializers import JSONSerializer

    # One by one: fetch_many's MULTI is refused while Redis is over its maxmemory.
    jobs = [
        Job.fetch(i, connection=env.conn, serializer=JSONSerializer)
        for i in _queued_jobs(env, batch)
    ]
    return [key for job in jobs for key in job.args[1]]


def _half_written(env, batch: str) -> list[str]:
    """Job records of the batch that lack what a worker needs (a status alone)."""
    out = []
    for key in env.conn.scan_iter(match=f"rq:job:{batch}-*", count=1000):
        if not env.conn.hexists(key, "data"):
            out.append(key.decode())
    return out


def _collected(env, batch: str, tmp_path) -> list[dict]:
    out = tmp_path / f"{batch}.jsonl"
    run = env.run("spec-collect", batch, "-o", str(out))
    assert run.returncode == 0, run.stderr
    return [json.loads(line) for line in out.read_text().splitlines()]


def _submit_in(env, monkeypatch, *args: str):
    """spec-submit in this process (so CHUNK_LINES can be made small), against env."""
    monkeypatch.setenv("SPEC_REDIS_URL", env.url)
    monkeypatch.setenv("SPEC_KEY_PREFIX", env.prefix)
    return CliRunner().invoke(cli.submit, list(args), catch_exceptions=False)


@pytest.mark.parametrize("job_lines", ["1", "4"])
def test_redis_full_mid_submit_is_one_line_and_a_resubmit_completes_the_batch_once(
    private_redis,  # noqa: F811
    tmp_path,
    monkeypatch,
    job_lines,
):
    """One line per job, or jobs of four lines (two a transaction): whole jobs or none."""
    server, env = private_redis(*FULL_REDIS)
    monkeypatch.setattr(config, "CHUNK_LINES", 8)
    monkeypatch.setenv("SPEC_JOB_LINES", job_lines)
    ids = [f"r{i}" for i in range(60)]
    jobs = _jobs(tmp_path / "jobs.jsonl", ids, pad=60_000)  # 3.6 MB: full mid-file
    batch = env.batch_id()

    full = _submit_in(env, monkeypatch, jobs, "--batch-id", batch)
    assert full.exit_code == 1, full.stderr
    assert "Traceback" not in full.stderr
    (line,) = full.stderr.splitlines()
    prefix = "spec-submit: error: Redis is full (maxmemory reached): "
    assert line.startswith(prefix), line
    enqueued = int(line[len(prefix) :].split(" ")[0])
    assert 0 < enqueued < len(ids)
    assert line == (
        f"{prefix}{enqueued} of {len(ids)} lines enqueued; raise maxmemory or free memory, "
        f"then run the same command with --batch-id {batch} to enqueue the rest"
    )
    # What is there is whole: complete jobs of as many lines as the message says.
    assert _half_written(env, batch) == []
    assert len(set(_queued_jobs(env, batch))) == len(_queued_jobs(env, batch))
    assert len(_queued_jobs(env, batch)) == enqueued // int(job_lines)
    assert len(set(_queued_lines(env, batch))) == len(_queued_lines(env, batch)) == enqueued
    assert env.conn.hlen(env.keys.requests(batch)) == enqueued
    assert env.run("spec-status", batch).stdout.splitlines()[0] == f"batch {batch}: queued"

    env.conn.config_set("maxmemory", "64mb")
    again = _submit_in(env, monkeypatch, jobs, "--batch-id", batch)
    assert again.exit_code == 0, again.stderr
    assert (
        f"batch {batch}: {len(ids)} lines: {len(ids) - enqueued} enqueued, "
        f"{enqueued} already queued or running"
    ) in again.stderr
    assert sorted(_queued_lines(env, batch)) == sorted(f"c:{c}" for c in ids)  # once each

    worker = env.start_worker("--burst", *PAIR_ARGS)
    assert worker.wait(timeout=240) == 0, worker.log
    results = _collected(env, batch, tmp_path)
    assert sorted(r["custom_id"] for r in results) == sorted(ids)
    assert all(r["error"] is None for r in results)
    status = json.loads(env.run("spec-status", batch, "--json").stdout)
    assert (status["status"], status["request_counts"]["completed"]) == ("completed", len(ids))
    print(
        f"figures: redis full: lines={len(ids)}, lines_per_job={job_lines}, maxmemory_mb=4, "
        f"enqueued_before_full={enqueued}, "
        f"half_written_jobs=0, results={len(results)}, results_lost=0, results_duplicated=0"
    )


def test_a_resubmitted_file_whose_lines_moved_answers_every_custom_id_once(
    redis_env, start_worker, tmp_path, monkeypatch
):
    batch = redis_env.batch_id()
    steps = [
        (["a", "b", "c"], "3 lines: 3 enqueued"),
        (["d", "a", "b", "c"], "4 lines: 1 enqueued, 3 already queued or running"),
        (["c", "e", "a"], "3 lines: 1 enqueued, 2 already queued or running"),
    ]
    for i, (ids, said) in enumerate(steps):
        jobs = _jobs(tmp_path / f"jobs{i}.jsonl", ids)
        run = _submit_in(redis_env, monkeypatch, jobs, "--batch-id", batch)
        assert run.exit_code == 0, run.stderr
        assert f"batch {batch}: {said}" in run.stderr
    queued = _queued_jobs(redis_env, batch)
    assert len(queued) == len(set(queued)) == 5

    assert start_worker("--burst", *PAIR_ARGS).wait(timeout=120) == 0
    results = _collected(redis_env, batch, tmp_path)
    # Each line keeps the line number of the file that enqueued it.
    got = sorted((r["custom_id"], r["id"], r["error"]) for r in results)
    assert got == [
        ("a", f"{batch}-1", None),
        ("b", f"{batch}-2", None),
        ("c", f"{batch}-3", None),
        ("d", f"{batch}-1", None),
        ("e", f"{batch}-2", None),
    ]
    status = json.loads(redis_env.run("spec-status", batch, "--json").stdout)
    assert status["status"] == "completed"
    assert status["request_counts"] == {
        "total": 5,
        "queued": 0,
        "running": 0,
        "completed": 5,
        "failed": 0,
    }
    print("figures: moved lines: submissions=3, custom_ids=5, jobs=5, results=5")


def test_two_submits_of_one_batch_at_once_enqueue_each_line_once(redis_env, tmp_path):
    ids = [f"r{i}" for i in range(3000)]
    jobs = _jobs(tmp_path / "jobs.jsonl", ids)
    batch = redis_env.batch_id()
    command = [script("spec-submit"), jobs, "--batch-id", batch]
    env = dict(redis_env.env, SPEC_SUBMIT_LOCK_WAIT_S="120")
    both = [
        subprocess.Popen(
            command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for _ in range(2)
    ]
    said = sorted(p.communicate(timeout=180)[1].splitlines()[0] for p in both)
    assert [p.returncode for p in both] == [0, 0]
    assert said == [
        f"batch {batch}: 3000 lines: 0 enqueued, 3000 already queued or running",
        f"batch {batch}: 3000 lines: 3000 enqueued; models: demo (3000)",
    ]
    queued = _queued_jobs(redis_env, batch)
    per_job = 3000 // config.JOB_SPREAD  # lines per job for a file this size
    assert len(queued) == len(set(queued)) == -(-3000 // per_job)
    lines = _queued_lines(redis_env, batch)
    assert sorted(lines) == sorted(f"c:{c}" for c in ids)  # each line in one job, once
    assert not redis_env.conn.exists(redis_env.keys.submit_lock(batch))  # released
    print(
        f"figures: two submits at once: lines=3000, queued_lines={len(lines)}, jobs={len(queued)}"
    )


def test_a_submit_that_finds_its_batch_locked_waits_then_says_so(redis_env, tmp_path):
    jobs = _jobs(tmp_path / "jobs.jsonl", ["a", "b"])
    batch = redis_env.batch_id()
    lock = redis_env.keys.submit_lock(batch)
    redis_env.conn.set(lock, "another-submit", px=60_000)
    env = dict(redis_env.env, SPEC_SUBMIT_LOCK_WAIT_S="1")
    run = subprocess.run(
        [script("spec-submit"), jobs, "--batch-id", batch],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 1
    assert run.stderr == (
        f"spec-submit: error: another spec-submit of batch {batch} is running (waited 1 s); "
        "run this one again once it has finished\n"
    )
    assert _queued_jobs(redis_env, batch) == []
    assert redis_env.conn.get(lock) == b"another-submit"  # not ours to release

    redis_env.conn.delete(lock)
    again = redis_env.run("spec-submit", jobs, "--batch-id", batch)
    assert again.returncode == 0, again.stderr
    assert len(_queued_jobs(redis_env, batch)) == 2
