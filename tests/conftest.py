"""Shared fixtures: a Redis for the queue tests, and real worker processes.

`redis_url` is REDIS_URL when set (CI with a service container), else a private
redis-server started on a free port for the session: tests never touch a Redis they
were not given. Each test gets its own key prefix (SPEC_KEY_PREFIX) and batch ids
that start with it, so tests cannot see each other's keys even on a shared server.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from redis import Redis

from jobstore.keys import Keys

BIN = Path(sys.executable).parent

#: Queue and CLI tests run on the bundled demo pair. SPEC_TEST_PAIR="TARGET_DIR,DRAFT_DIR"
#: runs them on another pair (for example while the demo pair is being retrained).
PAIR_ARGS: list[str] = []
PAIR_TARGET_DIR = Path(__file__).resolve().parent.parent / "engine" / "demo" / "target"
if os.environ.get("SPEC_TEST_PAIR"):
    _target, _draft = os.environ["SPEC_TEST_PAIR"].split(",")
    PAIR_ARGS = ["--target", _target, "--draft", _draft, "--alias", "demo"]
    PAIR_TARGET_DIR = Path(_target)


def stored(raw: bytes) -> dict:
    """A line as a worker stored it in Redis (packed JSON), parsed."""
    import json

    from jobstore.lines import unpack

    return json.loads(unpack(raw, 1 << 26))


class Pace:
    """How many times slower than idle this machine runs now, as the tests see it, from
    two measurements: a short computing child's wall time over its CPU time (taken once,
    on the first deadline asked for: 1 on an idle machine, ~4 with two heavy processes
    on each of 2 cores), and the slowest start of a spec-worker so far (launch to RQ's
    "Listening on": imports, the pair's load, registration) over IDLE_START_S, its start
    on an idle 2-core machine. The larger, between 1 and MAX_FACTOR. Every deadline of a
    wait on a real process is scaled by it (`scaled`): a suite beside heavy processes
    gets the time it needs, and a hung wait on an idle machine still fails fast."""

    #: A spec-worker's start on an idle 2-core x86_64 machine (the tests' tiny pairs).
    IDLE_START_S = 4.0
    MAX_FACTOR = 8.0
    factor = 1.0
    calibrated = False

    @classmethod
    def note(cls, slowdown: float) -> None:
        cls.factor = min(cls.MAX_FACTOR, max(cls.factor, slowdown))

    @classmethod
    def note_start(cls, seconds: float) -> None:
        """A worker took `seconds` from launch to "Listening on"."""
        cls.note(seconds / cls.IDLE_START_S)

    @classmethod
    def calibrate(cls) -> None:
        """Wall time over CPU time of a child that computes for ~0.3 s of CPU: the share
        of a core a process gets now."""
        cls.calibrated = True
        started = time.monotonic()
        proc = subprocess.Popen([sys.executable, "-c", "sum(range(20_000_000))"])
        _, _, usage = os.wait4(proc.pid, 0)
        cpu = usage.ru_utime + usage.ru_stime
        if cpu > 0.05:
            cls.note((time.monotonic() - started) / cpu)


def scaled(seconds: float) -> float:
    """A deadline of `seconds` on an idle machine, for this machine as it runs now."""
    if not Pace.calibrated:
        Pace.calibrate()
    return seconds * Pace.factor


def wait_until(predicate, timeout: float, what: str, poll: float = 0.05):
    """The first true value of `predicate()`, polled every `poll` s; fails after
    `timeout` seconds scaled to the machine's pace (Pace), saying what it waited for."""
    allowed = scaled(timeout)
    deadline = time.monotonic() + allowed
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(
                f"timed out after {allowed:.0f} s ({timeout} s scaled by the machine's "
                f"pace {Pace.factor:.1f}) waiting for {what}"
            )
        time.sleep(poll)


def script(name: str) -> str:
    """Path of one of this project's console scripts in the running environment."""
    path = BIN / name
    return str(path) if path.exists() else (shutil.which(name) or name)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory):
    """A Redis URL for the whole session: REDIS_URL, or a private redis-server."""
    if os.environ.get("REDIS_URL"):
        yield os.environ["REDIS_URL"]
        return
    server = shutil.which("redis-server")
    if server is None:
        pytest.fail("redis-server not found: install it, or set REDIS_URL")
    port = _free_port()
    workdir = tmp_path_factory.mktemp("redis")
    proc = subprocess.Popen(
        [server, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
        + ["--dir", str(workdir)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"redis://127.0.0.1:{port}/0"
    conn = Redis.from_url(url)
    deadline = time.monotonic() + 10
    while True:
        try:
            conn.ping()
            break
        except Exception:
            if time.monotonic() > deadline or proc.poll() is not None:
                proc.kill()
                pytest.fail(f"private redis-server on port {port} did not start")
            time.sleep(0.05)
    yield url
    proc.terminate()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()


@dataclass
class RedisEnv:
    """One test's view of Redis: URL, key prefix, a client, and the environment that
    subprocesses (spec-* commands) must run with."""

    url: str
    prefix: str
    conn: Redis
    keys: Keys
    env: dict = field(default_factory=dict)

    def batch_id(self, name: str = "b") -> str:
        return f"{self.prefix}_{name}"

    def run(self, *args: str, timeout: float = 120, **kwargs) -> subprocess.CompletedProcess:
        """Run a console script to completion; stdout and stderr captured as text
        (`env=` replaces the test's environment; `timeout` is scaled to the pace)."""
        return subprocess.run(
            [script(args[0]), *args[1:]],
            env=kwargs.pop("env", self.env),
            capture_output=True,
            text=True,
            timeout=scaled(timeout),
            **kwargs,
        )


@pytest.fixture
def redis_env(redis_url, monkeypatch) -> RedisEnv:
    prefix = f"t{uuid.uuid4().hex[:10]}"
    monkeypatch.setenv("SPEC_KEY_PREFIX", prefix)
    monkeypatch.setenv("SPEC_REDIS_URL", redis_url)
    conn = Redis.from_url(redis_url)
    env = dict(os.environ, SPEC_KEY_PREFIX=prefix, SPEC_REDIS_URL=redis_url)
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
    yield RedisEnv(redis_url, prefix, conn, Keys(prefix), env)
    # Leave nothing behind, even on a shared server: our prefix and our batches' jobs.
    for pattern in (f"{prefix}*", f"rq:*{prefix}*"):
        for key in conn.scan_iter(match=pattern, count=1000):
            conn.delete(key)
    conn.close()


#: Where the test-only `sitecustomize` lives that slows a worker's decode steps.
SLEEPY = Path(__file__).resolve().parent / "sleepy"
#: Each decode step of a worker serving the slow pair waits this long (tests/sleepy).
STEP_SLEEP_S = 0.015
#: Target folders of the slow pairs built this session (worker_env looks for them).
SLOW_TARGETS: set[str] = set()
#: Target folders of the busy pairs: their workers skip "auto"'s start-up timing (sleepy).
BUSY_TARGETS: set[str] = set()


@dataclass
class Hold:
    """A file that, while it exists, holds every decode step of the slow pair's workers
    started with `env` (tests/sleepy): their jobs then run until the test lets them go,
    whatever the machine's speed, instead of racing the test's polling."""

    path: Path

    @property
    def env(self) -> dict:
        return {"SPEC_TEST_HOLD": str(self.path)}

    def hold(self) -> None:
        self.path.touch()

    def release(self) -> None:
        self.path.unlink(missing_ok=True)


def worker_env(env: dict, args) -> dict:
    """The environment of a spec-worker started with `args`: a worker that serves the
    slow pair waits STEP_SLEEP_S in every decode step, so its jobs are long by waiting
    and leave the CPU to the tests running beside them. The start-up acceptance check is skipped (up to a second a worker) unless a test's env
    asks for it."""
    env = {"SPEC_ACCEPTANCE_CHECK": "0", **env}
    path = os.pathsep.join(p for p in (str(SLEEPY), env.get("PYTHONPATH", "")) if p)
    if SLOW_TARGETS.intersection(args):
        return dict(env, PYTHONPATH=path, SPEC_TEST_STEP_SLEEP_S=str(STEP_SLEEP_S))
    return env


def random_pair(root: Path, hidden: int, layers: int) -> list[str]:
    """spec-worker arguments for a random target (hidden x layers) and a tiny random
    draft on the test tokenizer, served under the alias "demo". Random weights at this
    scale never end a text early."""
    import json

    from tiny_models import build_llama, build_tokenizer

    build_tokenizer(root / "tok")
    vocab = len(json.loads((root / "tok" / "tokenizer.json").read_text())["model"]["vocab"])
    build_llama(
        root / "target",
        vocab_size=vocab,
        hidden=hidden,
        layers=layers,
        seed=1,
        scale=3.0,
        tokenizer_from=root / "tok",
    )
    build_llama(
        root / "draft",
        vocab_size=vocab,
        hidden=32,
        layers=1,
        seed=2,
        scale=3.0,
        tokenizer_from=root / "tok",
    )
    return ["--target", str(root / "target"), "--draft", str(root / "draft"), "--alias", "demo"]


@pytest.fixture(scope="session")
def slow_pair_args(tmp_path_factory) -> list[str]:
    """spec-worker arguments for a pair slow enough (STEP_SLEEP_S and more per step, and
    no early end of text) that a job outlives signals and heartbeat TTLs in tests of
    worker liveness, whatever the machine's speed. The pair itself is small and fast:
    its workers wait in each step (worker_env), they do not compute."""
    args = random_pair(tmp_path_factory.mktemp("slow-pair"), hidden=128, layers=2)
    SLOW_TARGETS.add(args[1])
    return args


@pytest.fixture(scope="session")
def busy_pair_args(tmp_path_factory) -> list[str]:
    """Like slow_pair_args, but slow by computing (a 768-wide, 6-layer target, over 10 ms
    per token on a CPU): for the tests of what a worker does while its job keeps the
    CPU busy."""
    args = random_pair(tmp_path_factory.mktemp("busy-pair"), hidden=768, layers=6)
    BUSY_TARGETS.add(args[1])
    return args


class WorkerProcess:
    """A real `spec-worker` subprocess, logging to a file; stopped at teardown."""

    def __init__(self, env: RedisEnv, log_path: Path, *args: str):
        self.log_path = log_path
        self._log = open(log_path, "wb")
        self.launched = time.monotonic()
        self.start_s: float | None = None  # launch to "Listening on", once seen
        self.proc = subprocess.Popen(
            [script("spec-worker"), *args],
            env=worker_env(env.env, args),
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )

    @property
    def log(self) -> str:
        if not self._log.closed:
            self._log.flush()
        return self.log_path.read_text(errors="replace")

    def wait(self, timeout: float) -> int:
        """Its exit code; fails after `timeout` s scaled to the machine's pace."""
        allowed = scaled(timeout)
        try:
            return self.proc.wait(timeout=allowed)
        except subprocess.TimeoutExpired as exc:
            log = self.log
            self.stop()
            raise AssertionError(
                f"spec-worker still running after {allowed:.0f} s ({timeout} s scaled):\n{log}"
            ) from exc

    def signal(self, signum: int = signal.SIGTERM) -> None:
        self.proc.send_signal(signum)

    def wait_for_log(self, text: str, timeout: float) -> None:
        """Until the log has `text` (fails after `timeout` s scaled to the pace, or when
        the worker exits). Waiting for "Listening on" measures the worker's start for
        Pace."""
        deadline = time.monotonic() + scaled(timeout)
        while text not in self.log:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"never logged {text!r}:\n{self.log}")
            time.sleep(0.05)
        if text == "Listening on" and self.start_s is None:
            self.start_s = time.monotonic() - self.launched
            Pace.note_start(self.start_s)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)
        self._log.close()


@pytest.fixture
def start_worker(redis_env, tmp_path):
    """start_worker(*args) -> WorkerProcess; every worker is killed at teardown."""
    started: list[WorkerProcess] = []

    def start(*args: str) -> WorkerProcess:
        w = WorkerProcess(redis_env, tmp_path / f"worker{len(started)}.log", *args)
        started.append(w)
        return w

    yield start
    for w in started:
        w.stop()
