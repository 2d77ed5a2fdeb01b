"""spec-serve with a large file (issue 21): server memory, upload time, validation time.

    nice -n 10 python benchmarks/serve_upload.py [--lines 100000]

Starts a private redis-server and a spec-serve on free loopback ports, writes a job file
of --lines chat requests (envelope form, ~200 bytes each), then with the official
`openai` client: `files.create` (wall time), `batches.create` and polling
`batches.retrieve` until the batch leaves `validating` (the server's validation and
queueing: spec-submit's own code). The server's resident memory is read from
/proc/PID/status before and after: VmRSS when idle, VmHWM (peak) after each step. The
baseline is `spec-submit` of the same file into another key prefix of the same Redis,
run afterwards in this process's session: the same validation and queueing without
HTTP. No worker runs: nothing is decoded.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import openai

sys.path.insert(0, str(Path(__file__).resolve().parent))
from private_redis import script, start_redis  # noqa: E402
from queue_overhead import log  # noqa: E402

KEY = "sk-bench"


def memory_kib(pid: int) -> dict[str, int]:
    """VmRSS and VmHWM of a process, in KiB."""
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        name, _, value = line.partition(":")
        if name in ("VmRSS", "VmHWM"):
            out[name] = int(value.split()[0])
    return out


def write_jobs(path: Path, n: int) -> int:
    with open(path, "w") as f:
        for i in range(n):
            body = {
                "model": "demo",
                "messages": [{"role": "user", "content": f"Write a short poem about tea, {i}."}],
                "max_tokens": 16,
                "temperature": 0.0,
            }
            f.write(
                json.dumps(
                    {
                        "custom_id": f"r{i}",
                        "method": "POST",
                        "url": "/v1/chat/completions",
                        "body": body,
                    }
                )
                + "\n"
            )
    return path.stat().st_size


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lines", type=int, default=100_000)
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="serve-bench-"))
    redis_proc, url = start_redis(tmp)
    env = dict(os.environ, SPEC_REDIS_URL=url, SPEC_KEY_PREFIX="bench", SPEC_API_KEY=KEY)
    with socket_port() as port:
        pass
    server = subprocess.Popen(
        [script("spec-serve"), "--port", str(port), "--data-dir", str(tmp / "data")],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    base = f"http://127.0.0.1:{port}/v1"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(
                    f"{base}/models", headers={"Authorization": f"Bearer {KEY}"}
                ).is_success:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise SystemExit("spec-serve did not start")
            time.sleep(0.1)
        jobs = tmp / "jobs.jsonl"
        size = write_jobs(jobs, args.lines)
        log(f"job file: {args.lines} lines, {size / 1e6:.1f} MB")
        idle = memory_kib(server.pid)
        client = openai.OpenAI(base_url=base, api_key=KEY, timeout=600, max_retries=0)
        started = time.perf_counter()
        with open(jobs, "rb") as f:
            uploaded = client.files.create(file=f, purpose="batch")
        upload_s = time.perf_counter() - started
        after_upload = memory_kib(server.pid)
        started = time.perf_counter()
        batch = client.batches.create(
            input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
        )
        while batch.status == "validating":
            time.sleep(0.05)
            batch = client.batches.retrieve(batch.id)
        validate_s = time.perf_counter() - started
        after_validation = memory_kib(server.pid)
        assert batch.status == "in_progress", batch
        assert batch.request_counts.total == args.lines, batch.request_counts
        started = time.perf_counter()
        submitted = subprocess.run(
            [script("spec-submit"), str(jobs)],
            env=dict(env, SPEC_KEY_PREFIX="bench-baseline"),
            capture_output=True,
            text=True,
        )
        submit_s = time.perf_counter() - started
        assert submitted.returncode == 0, submitted.stderr
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(timeout=30)
        redis_proc.terminate()
        redis_proc.wait(timeout=30)
    mib = 1024
    print(f"lines {args.lines}, file {size / 1e6:.1f} MB")
    print(f"server RSS idle {idle['VmRSS'] / mib:.0f} MiB")
    print(f"server peak RSS after upload {after_upload['VmHWM'] / mib:.0f} MiB")
    print(f"server peak RSS after validation {after_validation['VmHWM'] / mib:.0f} MiB")
    print(f"upload {upload_s:.2f} s ({size / 1e6 / upload_s:.0f} MB/s)")
    print(f"validation + queueing {validate_s:.2f} s ({args.lines / validate_s:.0f} lines/s)")
    print(f"spec-submit of the same file {submit_s:.2f} s (the baseline)")
    print(f"ratio server/spec-submit {validate_s / submit_s:.2f}")


class socket_port:
    """A free loopback port (closed again before use)."""

    def __enter__(self) -> int:
        import socket

        self._s = socket.socket()
        self._s.bind(("127.0.0.1", 0))
        return self._s.getsockname()[1]

    def __exit__(self, *exc) -> None:
        self._s.close()


if __name__ == "__main__":
    main()
