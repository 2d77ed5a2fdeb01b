"""A private redis-server for the queue benchmarks (queue_overhead, queue_scale,
serve_upload): started on a free loopback port with no persistence, so a benchmark never
touches a Redis it did not start, and stopped when the benchmark is done."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from redis import Redis

from jobstore.keys import Keys

#: This interpreter's bin folder: the spec-* commands of the same environment.
BIN = Path(sys.executable).parent


def script(name: str) -> str:
    """The path of command `name`: this environment's, else the one on PATH."""
    path = BIN / name
    return str(path) if path.exists() else (shutil.which(name) or name)


def start_redis(workdir: Path) -> tuple[subprocess.Popen, str]:
    """A redis-server on a free port, its files in `workdir`; returns once it answers
    (SystemExit naming the port when it does not within 10 s)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", ""]
        + ["--appendonly", "no", "--dir", str(workdir)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"redis://127.0.0.1:{port}/0"
    conn = Redis.from_url(url)
    deadline = time.monotonic() + 10
    while True:
        try:
            conn.ping()
            return proc, url
        except Exception:
            if time.monotonic() > deadline or proc.poll() is not None:
                proc.kill()
                raise SystemExit(f"redis-server on port {port} did not start") from None
            time.sleep(0.05)


@dataclass
class PrivateRedis:
    """A running private Redis and what a benchmark talks to it with."""

    url: str
    conn: Redis
    keys: Keys  # under a fresh key prefix
    env: dict  # for spec-* subprocesses: this Redis, that prefix, BIN first on PATH


@contextmanager
def private_redis(workdir: Path, tag: str, stop_s: float) -> Iterator[PrivateRedis]:
    """A private Redis for the block, keys prefixed `tag` + 6 random hex digits; the
    server is terminated on exit (waiting up to `stop_s` seconds for it)."""
    proc, url = start_redis(workdir)
    try:
        prefix = f"{tag}{uuid.uuid4().hex[:6]}"
        env = dict(os.environ, SPEC_REDIS_URL=url, SPEC_KEY_PREFIX=prefix)
        env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
        yield PrivateRedis(url, Redis.from_url(url), Keys(prefix), env)
    finally:
        proc.terminate()
        proc.wait(timeout=stop_s)
