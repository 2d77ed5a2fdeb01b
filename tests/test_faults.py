"""Faults, with real processes: workers killed mid-job, Redis restarted mid-batch (with
and without persistence), a large job file full of bad lines, a job delivered twice,
and the memory a batch holds in Redis (TTL, delete, eviction warnings).

Every test prints one `figures:` line (requests, faults, results lost and duplicated);
docs/reliability.md quotes them. Run with `pytest tests/test_faults.py -s` to see them.
Set SPEC_FAULTS_FULL=1 to run every valid line of the 10k-line file through workers
(a few minutes on a 2-core machine) instead of a sample.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from conftest import PAIR_ARGS, RedisEnv, WorkerProcess, scaled, script, stored, wait_until
from redis import Redis
from rq.exceptions import NoSuchJobError
from rq.job import Job
from rq.registry import FailedJobRegistry, StartedJobRegistry
from rq.serializers import JSONSerializer
from test_queue import _collect, read_jsonl, write_jobs

from jobstore.keys import Keys

#: A dead worker's job is noticed within about the TTL (scores are whole seconds).
FAST_HEARTBEAT = {"SPEC_HEARTBEAT_INTERVAL_S": "0.2", "SPEC_HEARTBEAT_TTL_S": "1"}


def figures(name: str, **numbers) -> None:
    print(f"\nfigures: {name}: " + ", ".join(f"{k}={v}" for k, v in numbers.items()))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    """A private redis-server on a fixed port and data directory, so it can be stopped
    and started again as the same server."""

    def __init__(
        self,
        workdir: Path,
        *args: str,
        password: str | None = None,
        tls: tuple[Path, Path] | None = None,
    ):
        self.port = free_port()
        self.dir = workdir
        self.dir.mkdir(parents=True, exist_ok=True)
        self.args = [*args]
        self.password = password
        self.tls = tls  # (certificate, key); the certificate is its own CA
        self.proc: subprocess.Popen | None = None
        self.log = self.dir / "redis.log"

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        if self.tls:
            return f"rediss://{auth}127.0.0.1:{self.port}/0?ssl_ca_certs={self.tls[0]}"
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    def client(self) -> Redis:
        return Redis.from_url(self.url)

    def start(self, timeout: float = 20) -> None:
        command = [shutil.which("redis-server") or "redis-server"]
        if self.tls:
            cert, key = self.tls
            command += ["--port", "0", "--tls-port", str(self.port), "--tls-cert-file", str(cert)]
            command += ["--tls-key-file", str(key), "--tls-ca-cert-file", str(cert)]
            command += ["--tls-auth-clients", "no"]
        else:
            command += ["--port", str(self.port)]
        command += ["--bind", "127.0.0.1", "--dir", str(self.dir)]
        command += ["--logfile", str(self.log), *self.args]
        if self.password:
            command += ["--requirepass", self.password]
        with open(self.dir / "stderr.log", "wb") as stderr:
            self.proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=stderr)
        conn = self.client()
        deadline = time.monotonic() + scaled(timeout)
        while True:
            try:
                if conn.ping():
                    break
            except Exception:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.kill()
                said = (self.dir / "stderr.log").read_text(errors="replace")
                if self.log.exists():
                    said += self.log.read_text(errors="replace")[-2000:]
                raise AssertionError(f"redis-server {command} did not start: {said}")
            time.sleep(0.05)
        conn.close()

    def stop(self) -> None:
        """SIGTERM: Redis flushes its append-only file and exits, as `docker compose stop`."""
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=30)

    def kill(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)


#: compose.yaml's Redis settings (without the password, which test_security covers).
COMPOSE_ARGS = (
    "--appendonly",
    "yes",
    "--appendfsync",
    "everysec",
    "--save",
    "",
    "--maxmemory",
    "512mb",
    "--maxmemory-policy",
    "noeviction",
)
NO_PERSISTENCE_ARGS = ("--save", "", "--appendonly", "no")


@pytest.fixture
def private_redis(tmp_path):
    """private_redis(*args) -> (RedisServer, RedisEnv); servers and workers are stopped at
    teardown."""
    servers: list[RedisServer] = []
    workers: list[WorkerProcess] = []

    def make(
        *args: str, password: str | None = None, tls: tuple[Path, Path] | None = None
    ) -> tuple[RedisServer, RedisEnv]:
        server = RedisServer(tmp_path / f"redis{len(servers)}", *args, password=password, tls=tls)
        server.start()
        servers.append(server)
        prefix = f"t{uuid.uuid4().hex[:10]}"
        env = dict(os.environ, SPEC_KEY_PREFIX=prefix, SPEC_REDIS_URL=server.url)
        env["PATH"] = f"{Path(script('spec-worker')).parent}{os.pathsep}{env.get('PATH', '')}"
        renv = RedisEnv(server.url, prefix, server.client(), Keys(prefix), env)
        renv.start_worker = lambda *a: _start(renv, *a)
        return server, renv

    def _start(renv: RedisEnv, *args: str) -> WorkerProcess:
        w = WorkerProcess(renv, tmp_path / f"pworker{len(workers)}.log", *args)
        workers.append(w)
        return w

    yield make
    for w in workers:
        w.stop()
    for s in servers:
        s.kill()


# -- helpers --------------------------------------------------------------------------------


def _job_of(redis_env, batch: str, job: str) -> dict[str, str]:
    raw = redis_env.conn.hgetall(f"rq:job:{job}")
    return {k.decode(): v.decode(errors="replace") for k, v in raw.items()}


def _running(redis_env, batch: str) -> dict[str, str]:
    """job id -> worker name, for the batch's jobs a worker has started."""
    registry = StartedJobRegistry(redis_env.keys.queue_name("demo"), connection=redis_env.conn)
    out = {}
    for job_id in registry.get_job_ids(cleanup=False):
        if job_id.startswith(f"{batch}-"):
            fields = redis_env.conn.hmget(f"rq:job:{job_id}", "status", "worker_name")
            if fields[0] == b"started" and fields[1]:
                out[job_id] = fields[1].decode()
    return out


def _done(redis_env, batch: str) -> int:
    keys = redis_env.keys
    return redis_env.conn.hlen(keys.results(batch)) + redis_env.conn.hlen(keys.errors(batch))


def _check_once_each(results: list[dict], custom_ids: list[str]) -> tuple[int, int]:
    """(lost, duplicated) custom_ids, comparing collected lines with the submitted ones."""
    got = [r["custom_id"] for r in results]
    lost = len(set(custom_ids) - set(got))
    duplicated = len(got) - len(set(got))
    return lost, duplicated


def _tokens_counted_once(redis_env, batch: str, results: list[dict]) -> None:
    meta = redis_env.conn.hgetall(redis_env.keys.batch(batch))
    usage = [r["response"]["body"]["usage"] for r in results]
    assert int(meta[b"completed"]) == len(results)
    assert int(meta[b"completion_tokens"]) == sum(u["completion_tokens"] for u in usage)
    assert int(meta[b"prompt_tokens"]) == sum(u["prompt_tokens"] for u in usage)


# -- 1. workers killed mid-job ----------------------------------------------------------------


def _job_lines(redis_env, job_id: str) -> list[str]:
    """The line keys a job of this project carries."""
    job_id = job_id.decode() if isinstance(job_id, bytes) else job_id
    return Job.fetch(job_id, connection=redis_env.conn, serializer=JSONSerializer).args[1]


def test_workers_killed_mid_job_lose_nothing_and_their_jobs_come_back_in_bounded_time(
    redis_env, start_worker, slow_pair_args, tmp_path
):
    """Jobs of four lines; a worker is killed once part of its job is stored: the job
    comes back through its heartbeat, and its lines are answered once each."""
    redis_env.env.update(FAST_HEARTBEAT)
    ttl = float(FAST_HEARTBEAT["SPEC_HEARTBEAT_TTL_S"])
    interval = float(FAST_HEARTBEAT["SPEC_HEARTBEAT_INTERVAL_S"])
    # Registry scores are whole seconds and the reaper runs once per interval; the rest
    # is slack for a loaded 2-core machine, where the reaping thread waits for the CPU
    # (7 s seen in CI, more with other test suites running). Still far below the job
    # timeout (minutes) and RQ's 420 s.
    bound = ttl + 1 + 2 * interval + scaled(20.0)
    n, kills, per_job = 200, 3, 4
    prompts = ["def parse(text):", "import os\n", "class Stack:", "for i in range(10):"]
    lines = [
        {"custom_id": f"k{i:03d}", "prompt": prompts[i % 4], "max_tokens": 8, "temperature": 0.0}
        for i in range(n)
    ]
    jobs = write_jobs(tmp_path / "jobs.jsonl", lines)
    batch = redis_env.batch_id("kill")
    env = dict(redis_env.env, SPEC_JOB_LINES=str(per_job))
    assert redis_env.run("spec-submit", jobs, "--batch-id", batch, env=env).returncode == 0
    queue_key = f"rq:queue:{redis_env.keys.queue_name('demo')}"
    assert redis_env.conn.llen(queue_key) == n // per_job

    names = iter(f"{redis_env.prefix}-w{i}" for i in range(10))
    live: dict[str, WorkerProcess] = {}

    def start() -> None:
        name = next(names)
        live[name] = start_worker("--name", name, *slow_pair_args)

    def stored(keys: list[str]) -> list[bool]:
        with redis_env.conn.pipeline(transaction=False) as pipe:
            for key in keys:
                pipe.hexists(redis_env.keys.results(batch), key)
            return pipe.execute()

    def half_done(seen: set[str]):
        """A job a live worker runs that has some of its lines stored, not all."""
        for job, worker in _running(redis_env, batch).items():
            if job in seen or worker not in live:
                continue
            try:
                keys = _job_lines(redis_env, job)
            except NoSuchJobError:  # it finished (and was deleted) since it was listed
                continue
            if 0 < sum(stored(keys)) < len(keys):
                return job, worker, keys
        return None

    start()
    start()
    requeue_s, killed_lines, done_before = [], [], 0
    seen: set[str] = set()
    for _ in range(kills):
        victim_job, victim, keys = wait_until(
            lambda: half_done(seen),
            timeout=120,
            what="a worker half way through a job",
            poll=0.01,
        )
        seen.add(victim_job)
        live[victim].signal(signal.SIGKILL)
        killed_at = time.monotonic()
        assert live.pop(victim).wait(timeout=10) == -signal.SIGKILL
        left = [k for k, done in zip(keys, stored(keys), strict=True) if not done]
        assert 0 < len(left) < per_job, "not mid-job"
        done_before += per_job - len(left)
        # Re-queued (a retry used) by the reaper of a worker that is itself busy: no
        # replacement is started until then, and the queue never ran dry.
        wait_until(
            lambda job=victim_job: _job_of(redis_env, batch, job).get("retries_left") == "1",
            timeout=bound + 5,
            what=f"job {victim_job} to be re-queued",
            poll=0.01,
        )
        requeue_s.append(time.monotonic() - killed_at)
        assert redis_env.conn.llen(queue_key) > 0, "a worker may have been idle"
        killed_lines += left
        start()

    wait_until(lambda: _done(redis_env, batch) >= n, timeout=180, what="the batch", poll=0.2)
    for w in live.values():
        w.signal(signal.SIGTERM)
    for w in live.values():
        assert w.wait(timeout=60) == 0, w.log

    results = read_jsonl(_collect(redis_env, batch, tmp_path / "r.jsonl"))
    assert [r["error"] for r in results] == [None] * n
    lost, duplicated = _check_once_each(results, [x["custom_id"] for x in lines])
    assert (lost, duplicated) == (0, 0)
    assert [r["custom_id"] for r in results] == [x["custom_id"] for x in lines]
    _tokens_counted_once(redis_env, batch, results)  # no line of a re-run job counted twice
    state = json.loads(redis_env.run("spec-status", batch, "--json").stdout)
    assert state["status"] == "completed" and state["request_counts"]["completed"] == n
    assert all(stored(killed_lines))
    assert max(requeue_s) < bound, requeue_s
    figures(
        "worker killed",
        requests=n,
        lines_per_job=per_job,
        workers=2,
        kills=kills,
        lines_stored_before_kills=done_before,
        requeued_within_s=f"{max(requeue_s):.2f}",
        bound_s=f"{bound:.1f}",
        results_lost=lost,
        results_duplicated=duplicated,
    )


# -- 3. Redis restarted mid-batch -------------------------------------------------------------


@pytest.mark.parametrize("rows", ["1", "4"])  # one line per job, or lines decoded together
def test_a_redis_restart_mid_batch_loses_nothing(private_redis, slow_pair_args, tmp_path, rows):
    server, env = private_redis(*COMPOSE_ARGS)
    n = 40
    lines = [
        {"custom_id": f"r{i:02d}", "prompt": "def parse(text):", "max_tokens": 8} for i in range(n)
    ]
    jobs = write_jobs(tmp_path / "jobs.jsonl", lines)
    batch = env.batch_id("restart")
    workers = [env.start_worker("--batch", rows, *slow_pair_args) for _ in range(2)]
    out, err = tmp_path / "out.jsonl", tmp_path / "err.jsonl"
    submit_log = tmp_path / "submit.log"
    where = f"Redis at redis://127.0.0.1:{server.port}/0: "
    with open(submit_log, "wb") as log:
        submit = subprocess.Popen(
            [script("spec-submit"), jobs, "--batch-id", batch, "--wait"]
            + ["-o", str(out), "--errors", str(err)],
            env=env.env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    try:
        wait_until(lambda: _done(env, batch) >= 6, timeout=120, what="some lines done")
        done_before = _done(env, batch)
        server.stop()
        # Down until the submitter and both workers have met the outage and backed off.
        logs = [lambda: submit_log.read_text(errors="replace")] + [
            lambda w=w: w.log for w in workers
        ]
        wait_until(lambda: all(where in log() for log in logs), 60, "everyone to notice")
        server.start()
        assert submit.wait(timeout=scaled(180)) == 0, submit_log.read_text()
    finally:
        if submit.poll() is None:
            submit.kill()
    results, errors = read_jsonl(out), read_jsonl(err)
    assert errors == []
    lost, duplicated = _check_once_each(results, [x["custom_id"] for x in lines])
    assert (lost, duplicated) == (0, 0) and len(results) == n
    _tokens_counted_once(env, batch, results)

    text = submit_log.read_text()
    assert where in text and "(attempt 1); retrying in" in text, text
    assert "reconnected after" in text
    assert text.rstrip().endswith(f"batch {batch} completed: {n} completed, 0 failed")
    for w in workers:
        assert w.proc.poll() is None, w.log  # rode it out
        assert where in w.log and "reconnected after" in w.log, w.log
        w.signal(signal.SIGTERM)
    for w in workers:
        assert w.wait(timeout=60) == 0, w.log
    attempts = sum(w.log.count(where) for w in workers)
    figures(
        "redis restart" if rows == "1" else f"redis restart, --batch {rows}",
        requests=n,
        workers=2,
        restarts=1,
        done_before_restart=done_before,
        reconnect_lines=attempts,
        results_lost=lost,
        results_duplicated=duplicated,
    )


def test_a_redis_restart_without_persistence_is_an_unknown_batch_not_a_traceback(
    private_redis, tmp_path
):
    server, env = private_redis(*NO_PERSISTENCE_ARGS)
    jobs = write_jobs(tmp_path / "jobs.jsonl", [{"custom_id": "a", "prompt": "x"}])
    batch = env.batch_id("gone")
    assert env.run("spec-submit", jobs, "--batch-id", batch).returncode == 0
    assert env.run("spec-status", batch).returncode == 0
    server.stop()
    server.start()
    for command, extra in [
        ("spec-status", []),
        ("spec-status", ["--json"]),
        ("spec-collect", ["-o", str(tmp_path / "r.jsonl")]),
    ]:
        res = env.run(command, batch, *extra)
        assert res.returncode == 1
        assert res.stdout == ""
        assert res.stderr == (
            f"{command}: error: no such batch '{batch}': this Redis (prefix '{env.prefix}') "
            "has no record of any batch; check the id, the Redis URL and SPEC_KEY_PREFIX. If "
            "it was submitted to this Redis, Redis has lost its data (restarted without "
            f"persistence?): re-submit its file with --batch-id {batch}\n"
        )


# -- 5. bad input at scale ----------------------------------------------------------------


def _bad_lines() -> list[tuple[bytes, str]]:
    """(raw line without its ending, expected message) for each kind of malformed line."""
    deep = b"[" * 100_000 + b"]" * 100_000
    big = b'{"custom_id": "big", "prompt": "' + b"x" * (10 * 1024 * 1024) + b'"}'
    return [
        (big, "line is longer than 8388608 bytes"),
        (b'{"custom_id": "deep", "prompt": ' + deep + b"}", "not valid JSON: nested too deeply"),
        (deep, "not valid JSON: nested too deeply"),
        (
            b'{"custom_id": "nan", "prompt": "x", "temperature": NaN}',
            "not valid JSON: NaN is not allowed (numbers must be finite)",
        ),
        (
            b'{"custom_id": "inf", "prompt": "x", "top_p": Infinity}',
            "not valid JSON: Infinity is not allowed (numbers must be finite)",
        ),
        (
            b'{"custom_id": "ninf", "prompt": "x", "temperature": -Infinity}',
            "not valid JSON: -Infinity is not allowed (numbers must be finite)",
        ),
        (
            b'{"custom_id": "huge", "prompt": "x", "temperature": 1e999}',
            "not valid JSON: 1e999 is out of range (numbers must be finite)",
        ),
        (
            b'\xef\xbb\xbf{"custom_id": "bom", "prompt": "x"}',
            "not valid JSON: Unexpected UTF-8 BOM (decode using utf-8-sig) at column 1",
        ),
        (b'{"custom_id": "utf8", "prompt": "caf\xe9"}', "not valid UTF-8: byte 0xe9 at column 37"),
        (b'{"custom_id": "cut", "prompt": "x"', "not valid JSON:"),
        (b"[1, 2, 3]", "must be a JSON object, got an array"),
        (b'{"prompt": "x"}', "custom_id: required"),
        (b'{"custom_id": "t", "prompt": "x", "temperature": -1}', "temperature: must be >= 0"),
        (b'{"custom_id": "u", "prompt": "x", "colour": "red"}', "colour: unknown field"),
        (b'{"custom_id": "k", "prompt": "x", "prompt": "y"}', 'duplicate key "prompt"'),
        (b'{"custom_id": "n", "prompt": "x", "n": 200}', "n: must be in [1, 128], got 200"),
        (b'{"custom_id": "e", "messages": []}', "messages: must not be empty"),
        (b'{"custom_id": "z", "prompt": "x", "max_tokens": 0}', "max_tokens: must be >= 1"),
        (b"\x00\x01\x02", "not valid JSON:"),
        (b'{"custom_id": "k000", "prompt": "again"}', "custom_id: duplicate"),
    ]


def _write_big_file(path: Path, n: int, bad_every: int) -> tuple[list[int], dict[int, str]]:
    """n lines; every bad_every-th line is malformed (cycling through _bad_lines), the rest
    valid, half of them with CRLF endings; the file starts with a BOM. Returns the valid
    line numbers and {bad line number: expected message}."""
    rng = random.Random(7)
    kinds = _bad_lines()
    valid, bad = [], {}
    with open(path, "wb") as f:
        f.write(b"\xef\xbb\xbf")
        for number in range(1, n + 1):
            if number % bad_every == 0:
                raw, message = kinds[(number // bad_every - 1) % len(kinds)]
                bad[number] = message
            else:
                body = {"custom_id": f"k{number - 1:03d}", "prompt": rng.choice(["x", "def f(x):"])}
                body["max_tokens"] = 1
                raw = json.dumps(body).encode()
                valid.append(number)
            f.write(raw + (b"\r\n" if number % 2 else b"\n"))
    return valid, bad


#: Runs a command and prints its exit code and peak RSS (KiB). A small launcher, because a
#: child forked straight from this test process would count the test's own memory.
_MEASURE = """
import os, subprocess, sys
out, err, *command = sys.argv[1:]
with open(out, "wb") as o, open(err, "wb") as e:
    child = subprocess.Popen(command, stdout=o, stderr=e)
    _, status, usage = os.wait4(child.pid, 0)
print(os.waitstatus_to_exitcode(status), usage.ru_maxrss)
"""


def _run_measured(env: RedisEnv, args: list[str], tmp_path: Path) -> tuple[int, str, float]:
    """Run a console script; (exit code, stderr, peak RSS in MB of that process alone)."""
    out, err = tmp_path / "cmd.out", tmp_path / "cmd.err"
    command = [sys.executable, "-c", _MEASURE, str(out), str(err), script(args[0]), *args[1:]]
    launcher = subprocess.run(
        command, env=env.env, capture_output=True, text=True, timeout=scaled(300)
    )
    assert launcher.returncode == 0, launcher.stderr
    code, rss_kib = map(int, launcher.stdout.split())
    return code, err.read_text(errors="replace"), rss_kib / 1024


def test_ten_thousand_lines_with_one_percent_malformed(redis_env, start_worker, tmp_path):
    n, bad_every = 10_000, 100
    path = tmp_path / "jobs.jsonl"
    valid, bad = _write_big_file(path, n, bad_every)
    assert len(bad) == n // bad_every and path.stat().st_size > 10 * 1024 * 1024
    batch = redis_env.batch_id("big")

    code, stderr, rss_reject = _run_measured(
        redis_env, ["spec-submit", str(path), "--batch-id", batch], tmp_path
    )
    assert code == 1
    reported = {}
    for line in stderr.splitlines()[:-1]:
        assert line.startswith(f"{path}:"), line
        number = int(line.split(":")[1])
        reported.setdefault(number, []).append(line)
    assert set(reported) == set(bad)  # every bad line, and only those
    for number, message in bad.items():
        assert any(message in x for x in reported[number]), (number, reported[number])
    assert stderr.splitlines()[-1] == (
        f"spec-submit: error: {path}: {len(bad)} invalid line(s), {len(valid)} valid: nothing was "
        "enqueued (fix them, or pass --skip-invalid to run the valid lines)"
    )
    assert redis_env.conn.exists(redis_env.keys.batch(batch)) == 0  # nothing enqueued

    code, stderr, rss_skip = _run_measured(
        redis_env, ["spec-submit", str(path), "--batch-id", batch, "--skip-invalid"], tmp_path
    )
    assert code == 0, stderr[-2000:]
    assert f"batch {batch}: {n} lines: {len(valid)} enqueued, {len(bad)} invalid" in stderr
    assert max(rss_reject, rss_skip) < 300, (rss_reject, rss_skip)
    conn, keys = redis_env.conn, redis_env.keys
    queue_key = f"rq:queue:{keys.queue_name('demo')}"
    queued = sorted(k for j in conn.lrange(queue_key, 0, -1) for k in _job_lines(redis_env, j))
    assert queued == sorted(f"c:k{number - 1:03d}" for number in valid)  # each once
    assert conn.llen(queue_key) < len(valid) / 10  # jobs of many lines: a 10k-line file
    assert conn.hlen(keys.requests(batch)) == len(valid)
    errors = [stored(v) for v in conn.hvals(keys.errors(batch))]
    assert sorted(e["error"]["line"] for e in errors) == sorted(bad)
    assert {e["error"]["code"] for e in errors} == {"invalid_request"}

    full = os.environ.get("SPEC_FAULTS_FULL") == "1"
    per_worker = None if full else 60
    extra = ["--burst"] if full else ["--max-jobs", str(per_worker)]
    workers = [start_worker(*extra, *PAIR_ARGS) for _ in range(2)]
    for w in workers:
        assert w.wait(timeout=1800 if full else 120) == 0, w.log
    completed = conn.hlen(keys.results(batch))
    left = sum(len(_job_lines(redis_env, j)) for j in conn.lrange(queue_key, 0, -1))
    assert completed == len(valid) - left  # every line of every job taken, none other
    if not full:  # each worker took jobs until it had at least --max-jobs lines
        answered = re.compile(rf"{batch} line \d+ \(k\d+\): \d+ tokens")
        took = [len(answered.findall(w.log)) for w in workers]
        assert all(t >= per_worker for t in took) and sum(took) == completed, took
    sample = [stored(v) for v in conn.hvals(keys.results(batch))]
    assert {r["error"] for r in sample} == {None}
    assert all(r["response"]["body"]["usage"]["completion_tokens"] <= 1 for r in sample)
    figures(
        "bad input",
        lines=n,
        bad_lines=len(bad),
        bad_lines_reported=len(reported),
        enqueued=len(valid),
        completed_through_workers=completed,
        peak_rss_mb=f"{max(rss_reject, rss_skip):.0f}",
    )


# -- 6. a job delivered twice -----------------------------------------------------------------


def test_a_job_delivered_twice_stores_one_result_and_counts_its_tokens_once(
    redis_env, start_worker, slow_pair_args, tmp_path
):
    """Worker A is frozen (SIGSTOP, as a Mac that sleeps) mid-job: its heartbeat lapses,
    worker B takes the job as abandoned, then A wakes up and finishes it too."""
    redis_env.env.update(FAST_HEARTBEAT)
    line = {"custom_id": "twice", "prompt": "def parse(text):", "max_tokens": 120, "temperature": 0}
    jobs = write_jobs(tmp_path / "jobs.jsonl", [line])
    batch = redis_env.batch_id("dup")
    assert redis_env.run("spec-submit", jobs, "--batch-id", batch).returncode == 0
    a_name, b_name = f"{redis_env.prefix}-a", f"{redis_env.prefix}-b"
    a = start_worker("--name", a_name, *slow_pair_args)
    wait_until(lambda: _running(redis_env, batch), timeout=60, what="A to start the job")
    a.signal(signal.SIGSTOP)
    try:
        b = start_worker("--name", b_name, *slow_pair_args)
        wait_until(
            lambda: b_name in _running(redis_env, batch).values(),
            timeout=60,
            what="B to take the abandoned job",
        )
    finally:
        a.signal(signal.SIGCONT)
    key = "c:twice"
    ran = f"{batch} line 1 (twice): 120 tokens"  # the job's own log line, once per run
    wait_until(lambda: ran in a.log and ran in b.log, timeout=120, what="both runs", poll=0.1)
    # The slower run finds the line stored and ends as a plain success (no failure of
    # rq's bookkeeping, no new delivery, no failed-registry entry).
    queue_key = f"rq:queue:{redis_env.keys.queue_name('demo')}"
    wait_until(
        lambda: redis_env.conn.llen(queue_key) == 0 and not _running(redis_env, batch),
        timeout=60,
        what="the queue to drain",
        poll=0.1,
    )
    for w in (a, b):
        w.signal(signal.SIGTERM)
    for w in (a, b):
        assert w.wait(timeout=60) == 0, w.log
    assert "(already stored by another run)" in a.log + b.log
    for said in ("not found in Redis", "internal_error", "Traceback"):
        assert said not in a.log + b.log, a.log + b.log
    failed = FailedJobRegistry(redis_env.keys.queue_name("demo"), connection=redis_env.conn)
    assert failed.get_job_ids() == []
    (result,) = read_jsonl(_collect(redis_env, batch, tmp_path / "r.jsonl"))
    assert result["custom_id"] == "twice" and result["error"] is None
    assert redis_env.conn.hlen(redis_env.keys.results(batch)) == 1
    assert redis_env.conn.lrange(redis_env.keys.done(batch), 0, -1) == [key.encode()]
    _tokens_counted_once(redis_env, batch, [result])
    state = json.loads(redis_env.run("spec-status", batch, "--json").stdout)
    assert sum(w["completed"] for w in state["workers"]) == 1
    tokens = result["response"]["body"]["usage"]["completion_tokens"]
    assert state["usage"]["completion_tokens"] == tokens == 120
    figures("duplicate delivery", requests=1, runs=2, results=1, tokens_counted=tokens)


# -- 8. Redis memory ----------------------------------------------------------------------------


def test_result_ttl_reaches_every_key_of_the_batch_and_delete_frees_them(
    redis_env, start_worker, tmp_path
):
    lines = [
        {"custom_id": "a", "prompt": "def f(x):", "max_tokens": 2},
        {"custom_id": "b", "prompt": "x", "max_tokens": 2},
        {"custom_id": "bad", "prompt": "x", "temperature": -1},
    ]
    jobs = write_jobs(tmp_path / "jobs.jsonl", lines)
    batch = redis_env.batch_id("ttl")
    res = redis_env.run(
        "spec-submit", jobs, "--batch-id", batch, "--skip-invalid", "--result-ttl", "3600"
    )
    assert res.returncode == 0, res.stderr
    conn, keys = redis_env.conn, redis_env.keys

    def ttls() -> dict[str, int]:
        found = conn.scan_iter(match=f"{keys.batch(batch)}*")
        return {k.decode(): conn.ttl(k) for k in found}

    at_submit = ttls()
    assert set(at_submit) >= {keys.batch(batch), keys.requests(batch), keys.order(batch)}
    assert all(0 < t <= 3600 for t in at_submit.values()), at_submit
    assert conn.hget(keys.batch(batch), "result_ttl") == b"3600"
    worker = start_worker("--burst", *PAIR_ARGS)
    assert worker.wait(timeout=120) == 0, worker.log
    after = ttls()
    assert set(after) >= {keys.results(batch), keys.errors(batch), keys.done(batch)}
    assert set(after) >= {keys.batch_workers(batch)}
    assert all(0 < t <= 3600 for t in after.values()), after

    # Re-submitting without --result-ttl keeps the batch's TTL.
    res = redis_env.run("spec-submit", jobs, "--batch-id", batch, "--skip-invalid")
    assert (
        res.returncode == 0 and "0 enqueued, 1 invalid (error lines), 2 already done" in res.stderr
    )
    assert all(0 < t <= 3600 for t in ttls().values())

    out = tmp_path / "r.jsonl"
    res = redis_env.run("spec-collect", batch, "-o", str(out), "--delete")
    assert res.returncode == 0, res.stderr
    assert res.stderr.endswith("; deleted the batch\n")
    assert [r["custom_id"] for r in read_jsonl(out)] == ["a", "b", "bad"]
    assert ttls() == {}
    assert list(conn.scan_iter(match=f"rq:job:{batch}-*")) == []
    assert conn.zscore(keys.batches, batch) is None


def test_a_short_result_ttl_frees_an_uncollected_batch(redis_env, tmp_path):
    jobs = write_jobs(tmp_path / "jobs.jsonl", [{"custom_id": "a", "prompt": "x"}])
    batch = redis_env.batch_id("expire")
    res = redis_env.run("spec-submit", jobs, "--batch-id", batch, "--result-ttl", "1")
    assert res.returncode == 0, res.stderr
    assert redis_env.conn.exists(redis_env.keys.batch(batch))
    pattern = f"{redis_env.keys.batch(batch)}*"
    # Gone within the same 2.1 s as before, but no longer than it takes.
    wait_until(lambda: not list(redis_env.conn.scan_iter(match=pattern)), 2.1, "the keys to expire")
    res = redis_env.run("spec-status", batch)
    assert res.returncode == 1
    assert res.stderr.startswith(f"spec-status: error: batch {batch} was submitted to this Redis")
    assert "its keys are gone: it expired if it had a result TTL" in res.stderr


def test_spec_status_and_spec_worker_warn_when_redis_may_evict(private_redis, tmp_path):
    _, env = private_redis("--save", "", "--maxmemory-policy", "allkeys-lru")
    warning = (
        "Redis maxmemory-policy is allkeys-lru: under memory pressure it may evict queued "
        "jobs and results; set it to noeviction"
    )
    res = env.run("spec-status", "nope")
    assert res.returncode == 1
    assert res.stderr.splitlines()[0] == f"warning: {warning}"
    worker = env.start_worker("--burst", *PAIR_ARGS)
    assert worker.wait(timeout=120) == 0, worker.log
    assert warning in worker.log


def test_a_stop_signal_during_a_redis_outage(private_redis, slow_pair_args, tmp_path):
    """Busy: the first SIGTERM still waits for Redis, so the result is stored when it is
    back. Idle: SIGTERM ends the waiting at once."""
    server, env = private_redis(*COMPOSE_ARGS)
    line = {"custom_id": "long", "prompt": "def parse(text):", "max_tokens": 100, "temperature": 0}
    jobs = write_jobs(tmp_path / "jobs.jsonl", [line])
    batch = env.batch_id("outage")
    assert env.run("spec-submit", jobs, "--batch-id", batch).returncode == 0
    busy = env.start_worker(*slow_pair_args)
    busy.wait_for_log("Listening on", timeout=180)
    wait_until(lambda: _running(env, batch), timeout=60, what="the job to start")
    server.stop()
    busy.signal(signal.SIGTERM)
    time.sleep(3)
    assert busy.proc.poll() is None, busy.log  # still holding its result
    server.start()
    assert busy.wait(timeout=60) == 0, busy.log
    (result,) = read_jsonl(_collect(env, batch, tmp_path / "r.jsonl"))
    assert result["error"] is None
    assert result["response"]["body"]["usage"]["completion_tokens"] == 100

    idle = env.start_worker(*slow_pair_args)
    idle.wait_for_log("Listening on", timeout=60)
    server.stop()
    idle.wait_for_log("(attempt 1)", timeout=30)
    idle.signal(signal.SIGTERM)
    started = time.monotonic()
    assert idle.wait(timeout=30) == 0, idle.log
    assert time.monotonic() - started < scaled(5)
    assert f"stopped while Redis at redis://127.0.0.1:{server.port}/0 was unreachable" in idle.log
