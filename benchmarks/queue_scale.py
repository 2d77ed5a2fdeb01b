"""A million lines on one Redis (issue 14): memory and Redis work per line, and the
commands of a batch that size.

    nice -n 10 python benchmarks/queue_scale.py [--lines 1000000] [--fleet-lines 60000]

Starts a private redis-server on a free port (no persistence), writes a job file of
--lines 1-token requests (~100-character prompts), then:

1. `spec-submit` of the file: wall time and peak RSS; Redis memory per queued line
   (INFO memory before and after, beyond the request's own JSON); Redis commands and
   microseconds per line (INFO commandstats).
2. Answers every line with stub workers (benchmarks/stub_worker.py: the real worker,
   claiming, storing and all, with an engine that answers one fixed token at once):
   Redis commands and CPU per answered line, from INFO commandstats (`calls`, `usec`,
   scripts' inner commands included, so `usec` counts their time twice) and from INFO
   cpu (the server process's CPU, idle time subtracted); memory per answered line
   against the result line's JSON size.
3. `spec-status` (wall time of the command, and of the status call alone),
   `spec-collect` (wall time, peak RSS) and `spec-report` (wall time, peak RSS) on the
   answered batch.
4. A loopback fleet: 1, 2 and 4 stub workers (`--batch 8`) on a batch of
   --fleet-lines lines each: lines/s from the batch's first start to its last stored
   line, and Redis CPU per line.

Prints its tables (and writes them to the `queue-scale` section of --out FILE).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

from redis import Redis

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import report  # noqa: E402
from private_redis import private_redis, script  # noqa: E402
from queue_overhead import log  # noqa: E402

from jobstore.keys import Keys  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
STUB = ROOT / "benchmarks" / "stub_worker.py"
PROMPTS = ["def fibonacci(n):", "class Stack:\n    def push(self, item):", "import os\n\ndef walk("]


def write_jobs(path: Path, n: int, prefix: str = "r") -> float:
    """n 1-token greedy requests with ~100-character prompts; returns bytes per line."""
    with path.open("w") as f:
        for i in range(n):
            prompt = f"{PROMPTS[i % len(PROMPTS)]}  # request {i}: " + "y" * 60
            line = {"custom_id": f"{prefix}{i:07d}", "prompt": prompt, "max_tokens": 1}
            f.write(json.dumps({**line, "temperature": 0}) + "\n")
    return path.stat().st_size / n


def measured(env: dict, args: list[str], stdout=subprocess.DEVNULL) -> dict:
    """Run a command; its exit code, wall time, peak RSS (of that process) and stderr."""
    started = time.perf_counter()
    with tempfile.TemporaryFile() as err:
        proc = subprocess.Popen(args, env=env, stdout=stdout, stderr=err)
        _, status, usage = os.wait4(proc.pid, 0)
        seconds = time.perf_counter() - started
        err.seek(0)
        stderr = err.read().decode(errors="replace")
    code = os.waitstatus_to_exitcode(status)
    if code != 0:
        raise SystemExit(f"{' '.join(args)} failed ({code}):\n{stderr[-3000:]}")
    return {"s": seconds, "rss_mb": usage.ru_maxrss / 1024, "stderr": stderr[-500:]}


class RedisMeter:
    """Commands, command microseconds and server CPU between `start` and `stop`."""

    def __init__(self, conn: Redis):
        self.conn = conn
        self.idle_cpu_per_s = self._idle_rate()

    def _cpu(self) -> float:
        cpu = self.conn.info("cpu")
        return float(cpu["used_cpu_user"]) + float(cpu["used_cpu_sys"])

    def _idle_rate(self) -> float:
        """Server CPU per second with nothing to do (its timers): subtracted later."""
        before, t0 = self._cpu(), time.monotonic()
        time.sleep(3)
        return (self._cpu() - before) / (time.monotonic() - t0)

    def start(self) -> None:
        self.conn.config_resetstat()
        self._t0, self._cpu0 = time.monotonic(), self._cpu()

    def stop(self, lines: int) -> dict:
        seconds = time.monotonic() - self._t0
        cpu = self._cpu() - self._cpu0 - self.idle_cpu_per_s * seconds
        stats = self.conn.info("commandstats")
        stats = {
            k: v for k, v in stats.items() if k not in ("cmdstat_info", "cmdstat_config|resetstat")
        }
        top = sorted(stats.items(), key=lambda kv: -kv[1]["calls"])[:8]
        return {
            "commands": sum(v["calls"] for v in stats.values()) / lines,
            "usec": sum(v["usec"] for v in stats.values()) / lines,
            "cpu_us": cpu / lines * 1e6,
            "top": ", ".join(f"{k[8:]} {v['calls'] / lines:.2f}" for k, v in top),
        }


def used_memory(conn: Redis) -> int:
    return int(conn.info("memory")["used_memory"])


def stub_workers(env: dict, count: int, *args: str) -> list[subprocess.Popen]:
    return [
        subprocess.Popen(
            [sys.executable, str(STUB), "--log-level", "WARNING", *args],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        for _ in range(count)
    ]


def wait_all(procs: list[subprocess.Popen], timeout: float) -> None:
    for p in procs:
        if p.wait(timeout=timeout) != 0:
            raise SystemExit(f"a stub worker exited with {p.returncode}")


def span_s(conn: Redis, keys: Keys, batch: str) -> float:
    started, last = conn.hmget(keys.batch(batch), "started_at", "last_done_at")
    return float(last) - float(started)


def big_batch(conn, env, keys, tmp: Path, n: int, workers: int) -> dict:
    out: dict = {"lines": n}
    jobs = tmp / "jobs.jsonl"
    log(f"writing {n:,} lines")
    out["request_bytes"] = write_jobs(jobs, n)
    out["file_mb"] = jobs.stat().st_size / 1e6
    batch = f"big_{uuid.uuid4().hex[:6]}"
    meter = RedisMeter(conn)
    before = used_memory(conn)
    meter.start()
    log("spec-submit")
    run = measured(env, [script("spec-submit"), str(jobs), "--batch-id", batch])
    out["submit"] = {**run, **meter.stop(n)}
    out["queued_bytes"] = (used_memory(conn) - before) / n
    out["jobs"] = conn.llen(f"rq:queue:{keys.queue_name('demo')}")
    log(f"  {run['s']:.1f} s, {run['rss_mb']:.0f} MB; {out['queued_bytes']:.0f} B/line")
    out["status_queued"] = time_status(env, conn, keys, batch)

    log(f"answering with {workers} stub worker(s)")
    meter.start()
    t0 = time.monotonic()
    wait_all(stub_workers(env, workers, "--burst", "--batch", "8"), timeout=7200)
    out["drain_s"] = time.monotonic() - t0
    out["answer"] = meter.stop(n)
    out["answered_bytes"] = (used_memory(conn) - before) / n
    out["lines_per_s"] = n / span_s(conn, keys, batch)
    log(f"  {out['drain_s']:.0f} s; {out['answer']['cpu_us']:.1f} us CPU/line")
    out["memory"] = {
        name: conn.memory_usage(key, samples=0) or 0
        for name, key in (
            ("results", keys.results(batch)),
            ("order", keys.order(batch)),
            ("done", keys.done(batch)),
            ("requests", keys.requests(batch)),
            ("batch hash", keys.batch(batch)),
        )
    }
    out["status_answered"] = time_status(env, conn, keys, batch)

    results = tmp / "results.jsonl"
    log("spec-collect")
    run = measured(env, [script("spec-collect"), batch, "-o", str(results)])
    out["collect"] = run
    out["result_bytes"] = results.stat().st_size / n - 1  # without the newline
    with results.open("rb") as f:
        out["collected"] = sum(1 for _ in f)
    log(f"  {run['s']:.1f} s, {run['rss_mb']:.0f} MB")
    results.unlink()
    log("spec-report")
    out["report"] = measured(env, [script("spec-report"), batch, "-o", str(tmp / "r.html")])
    log(f"  {out['report']['s']:.1f} s, {out['report']['rss_mb']:.0f} MB")
    return out


def time_status(env, conn, keys, batch: str) -> dict:
    """spec-status: the command's wall time (median of 3) and the status call alone."""
    sys.path.insert(0, str(ROOT))
    from producer.status import status

    runs = sorted(measured(env, [script("spec-status"), batch])["s"] for _ in range(3))
    calls = []
    for _ in range(3):
        t0 = time.perf_counter()
        status(conn, keys, batch)
        calls.append(time.perf_counter() - t0)
    return {"command_s": runs[1], "call_s": sorted(calls)[1]}


def fleet(conn, env, keys, tmp: Path, n: int, counts: list[int]) -> list[dict]:
    rows = []
    for count in counts:
        jobs = tmp / f"fleet{count}.jsonl"
        write_jobs(jobs, n, prefix=f"f{count}_")
        batch = f"fleet{count}_{uuid.uuid4().hex[:6]}"
        measured(env, [script("spec-submit"), str(jobs), "--batch-id", batch])
        meter = RedisMeter(conn)
        meter.start()
        log(f"fleet: {count} stub worker(s), {n:,} lines")
        wait_all(stub_workers(env, count, "--burst", "--batch", "8"), timeout=3600)
        row = {"workers": count, **meter.stop(n), "lines_per_s": n / span_s(conn, keys, batch)}
        log(f"  {row['lines_per_s']:.0f} lines/s, {row['cpu_us']:.1f} us Redis CPU/line")
        rows.append(row)
        conn.delete(*keys.batch_keys(batch))
    return rows


def render(big: dict, rows: list[dict], facts: dict) -> str:
    n = big["lines"]
    sub, ans = big["submit"], big["answer"]
    queued_beyond = big["queued_bytes"] - big["request_bytes"]
    targets = [
        report.Target(
            "Redis memory per queued line, beyond its request", queued_beyond, 600, " B", True
        ),
        report.Target(
            "Redis memory per answered line", big["answered_bytes"], big["result_bytes"], " B", True
        ),
        report.Target("Redis commands per answered line", ans["commands"], 20, "", True),
        report.Target("Redis CPU per answered line (INFO cpu)", ans["cpu_us"], 60, " us", True),
        report.Target(
            "Redis usec per answered line (commandstats, scripts twice)",
            ans["usec"],
            60,
            " us",
            True,
        ),
        report.Target(f"spec-submit, {n:,} lines", sub["s"], 60, " s", True),
        report.Target("spec-submit peak RSS", sub["rss_mb"], 200, " MB", True),
        report.Target(f"spec-collect, {n:,} results", big["collect"]["s"], 60, " s", True),
        report.Target("spec-collect peak RSS", big["collect"]["rss_mb"], 200, " MB", True),
        report.Target(
            "spec-status (the command)", big["status_answered"]["command_s"], 0.5, " s", True
        ),
        report.Target(f"spec-report, {n:,} lines", big["report"]["s"], 60, " s", True),
    ]
    rows_big = [
        ["job file", f"{n:,} lines, {big['file_mb']:.0f} MB, {big['request_bytes']:.0f} B a line"],
        ["RQ jobs", f"{big['jobs']:,} ({n / big['jobs']:.0f} lines a job)"],
        ["spec-submit", f"{sub['s']:.1f} s, peak RSS {sub['rss_mb']:.0f} MB"],
        [
            "Redis per line, submit",
            f"{sub['commands']:.2f} commands, {sub['usec']:.1f} usec, {sub['cpu_us']:.1f} us CPU",
        ],
        [
            "Redis memory, queued",
            f"{big['queued_bytes']:.0f} B a line ({big['queued_bytes'] * n / 2**20:.0f} MiB for the batch)",
        ],
        [
            "answering (stub workers, --batch 8)",
            f"{big['drain_s']:.0f} s, {big['lines_per_s']:.0f} lines/s",
        ],
        [
            "Redis per answered line",
            f"{ans['commands']:.2f} commands, {ans['usec']:.1f} usec (commandstats), {ans['cpu_us']:.1f} us CPU (INFO cpu)",
        ],
        ["commands per answered line, most called", ans["top"]],
        [
            "Redis memory, answered",
            f"{big['answered_bytes']:.0f} B a line ({big['answered_bytes'] * n / 2**20:.0f} MiB for the batch); result line {big['result_bytes']:.0f} B of JSON",
        ],
        [
            "keys of the answered batch",
            ", ".join(f"{k} {v / 2**20:.1f} MiB" for k, v in big["memory"].items()),
        ],
        [
            "spec-status, queued batch",
            f"{big['status_queued']['command_s']:.2f} s (the call alone {big['status_queued']['call_s'] * 1000:.1f} ms)",
        ],
        [
            "spec-status, answered batch",
            f"{big['status_answered']['command_s']:.2f} s (the call alone {big['status_answered']['call_s'] * 1000:.1f} ms)",
        ],
        [
            "spec-collect",
            f"{big['collect']['s']:.1f} s, peak RSS {big['collect']['rss_mb']:.0f} MB, {big['collected']:,} lines",
        ],
        ["spec-report", f"{big['report']['s']:.1f} s, peak RSS {big['report']['rss_mb']:.0f} MB"],
    ]
    fleet_rows = [
        [
            str(r["workers"]),
            f"{r['lines_per_s']:.0f}",
            f"{r['cpu_us']:.1f}",
            f"{r['usec']:.1f}",
            f"{r['commands']:.2f}",
        ]
        for r in rows
    ]
    return "\n\n".join(
        [
            "## A million lines on one Redis (`benchmarks/queue_scale.py`)",
            f"Command: `nice -n 10 {report.command_line()}`",
            report.machine_facts(facts, mlx=False),
            "### Targets (issue 14)",
            report.targets_table(targets),
            "### The batch",
            report.table(["measure", "value"], rows_big),
            "### Loopback fleet (stub workers, `--batch 8`, one Redis)",
            report.table(
                [
                    "workers",
                    "lines/s",
                    "Redis CPU us/line",
                    "commandstats usec/line",
                    "commands/line",
                ],
                fleet_rows,
            ),
            "Stub workers answer each line with one fixed token at once, through the real "
            "worker (claiming, vetting, heartbeats, storing); the engine's time is left out, "
            "so these are the queue's own limits. Redis CPU is the server process's "
            "(INFO cpu), its idle timers subtracted; commandstats `usec` counts a script's "
            "inner commands inside the script's time and again on their own. Every process "
            "ran at `nice -n 10` on the shared 2-core machine.",
        ]
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lines", type=int, default=1_000_000)
    parser.add_argument("--workers", type=int, default=2, help="stub workers answering the batch")
    parser.add_argument("--fleet-lines", type=int, default=60_000)
    parser.add_argument("--fleet", default="1,2,4")
    parser.add_argument("--out", type=Path, help="also write the report's section here")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="queue-scale-") as tmp_name:
        tmp = Path(tmp_name)
        with private_redis(tmp, "qs", stop_s=60) as redis:
            conn, env, keys = redis.conn, redis.env, redis.keys
            wait_all(stub_workers(env, 1, "--burst"), timeout=120)  # registers the alias
            os.environ.update(SPEC_KEY_PREFIX=keys.prefix)
            big = big_batch(conn, env, keys, tmp, args.lines, args.workers)
            rows = fleet(
                conn, env, keys, tmp, args.fleet_lines, [int(c) for c in args.fleet.split(",")]
            )
            version = conn.info("server")["redis_version"]
    import rq

    md = render(big, rows, {"redis-server": version, "rq": rq.__version__})
    print(
        json.dumps({"big": {k: v for k, v in big.items()}, "fleet": rows}, default=str)[:20000],
        file=sys.stderr,
    )
    report.publish(md, args.out, "queue-scale")
    return 0


if __name__ == "__main__":
    sys.exit(main())
