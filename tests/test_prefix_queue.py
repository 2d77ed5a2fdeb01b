"""Lines sharing a long prefix, as a user runs them: `spec-run`, and `spec-submit` +
`spec-worker --batch`. Every result line says how many prompt tokens came from the
worker's prefix cache, both give the same text (tests/test_prefix.py proves it is the
text with the cache off), and the batch's status sums them."""

from __future__ import annotations

import json

from conftest import PAIR_ARGS
from test_queue import comparable, read_jsonl, write_jobs

PREFIX = (
    "import os\nimport sys\n\n\ndef read_config(path):\n"
    '    """Read a key = value file into a dict, skipping comments."""\n'
    "    out = {}\n    with open(path) as f:\n        for line in f:\n"
    "            line = line.strip()\n            if not line or line.startswith('#'):\n"
    "                continue\n            key, _, value = line.partition('=')\n"
    "            out[key.strip()] = value.strip()\n    return out\n\n\n"
    "def main(argv):\n    config = read_config(argv[1])\n"
    "    for key in sorted(config):\n        print(key, config[key])\n\n\n"
)
ENDINGS = ["def add(a, b):", "class Stack:", "def fib(n):", "for i in range(10):", "x = [", "if "]


def _lines() -> list[dict]:
    return [
        {"custom_id": f"p{i}", "prompt": PREFIX + end, "max_tokens": 6, "temperature": 0}
        for i, end in enumerate(ENDINGS)
    ]


def _cached(line: dict) -> int:
    return line["response"]["body"]["usage"]["prompt_tokens_details"]["cached_tokens"]


def _without_cached(line: dict) -> dict:
    line = comparable(line)
    line["response"]["body"]["usage"].pop("prompt_tokens_details")
    return line


def test_shared_prefixes_are_reused_through_spec_run_and_the_queue(
    redis_env, start_worker, tmp_path
):
    jobs = write_jobs(tmp_path / "jobs.jsonl", _lines())
    batch = redis_env.batch_id("pfx")
    out = tmp_path / "local.jsonl"
    res = redis_env.run("spec-run", jobs, "-o", str(out), "--batch-id", batch, *PAIR_ARGS)
    assert res.returncode == 0, res.stderr
    on = read_jsonl(out)
    prompt_tokens = [x["response"]["body"]["usage"]["prompt_tokens"] for x in on]
    cached = [_cached(x) for x in on]
    # The rows join together: their shared prefix (whole blocks of 64) is prefilled once.
    assert len(set(cached)) == 1 and cached[0] % 64 == 0 and cached[0] >= 128
    assert all(c < n for c, n in zip(cached, prompt_tokens, strict=True))

    assert redis_env.run("spec-submit", jobs, "--batch-id", batch).returncode == 0
    worker = start_worker("--burst", "--batch", "8", *PAIR_ARGS)
    assert worker.wait(timeout=300) == 0, worker.log
    assert "prefix cache: " in worker.log
    assert f"{sum(cached)} reused from the prefix cache" in res.stderr
    results = tmp_path / "results.jsonl"
    assert redis_env.run("spec-collect", batch, "-o", str(results)).returncode == 0
    got = read_jsonl(results)
    assert [_without_cached(x) for x in got] == [_without_cached(x) for x in on]
    # A row admitted before the others meets an empty cache; every later one hits.
    assert sum(_cached(x) == cached[0] for x in got) >= len(ENDINGS) - 1
    state = json.loads(redis_env.run("spec-status", batch, "--json").stdout)
    assert state["usage"]["cached_prompt_tokens"] == sum(_cached(x) for x in got)
    text = redis_env.run("spec-status", batch).stdout
    assert f"({state['usage']['cached_prompt_tokens']} reused from prefix caches)" in text
