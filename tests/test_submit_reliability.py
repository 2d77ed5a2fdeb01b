"""spec-submit when things go wrong on the submit side, against real redis-servers:
Redis full mid-file, a re-submitted file whose lines moved, two submits of one batch
at once, and a prompt of megabytes. Each test failed before its fix."""

from __future__ import annotations

import json
import subprocess
import sys

from conftest import script

from producer.tokencount import WINDOW_CHARS

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
