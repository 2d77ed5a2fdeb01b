"""spec-doctor: a healthy setup passes; Redis down, mismatched tokenizers and a pair too
large for the memory each fail with a line that says what to do."""

from __future__ import annotations

import json
import os
import shutil
import socket

import pytest
from click.testing import CliRunner
from conftest import random_pair
from tiny_models import build_llama

from jobstore.config import redact
from worker.doctor import kv_cache_bytes, main, model_size


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """target, draft (same tokenizer) and a draft whose tokenizer swaps two ids."""
    root = tmp_path_factory.mktemp("doctor")
    random_pair(root, hidden=64, layers=2)
    data = json.loads((root / "tok" / "tokenizer.json").read_text())
    n = len(data["model"]["vocab"])
    vocab = data["model"]["vocab"]
    a, b = sorted(vocab, key=vocab.get)[300:302]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (root / "tok_b").mkdir()
    shutil.copy(root / "tok" / "tokenizer_config.json", root / "tok_b")
    (root / "tok_b" / "tokenizer.json").write_text(json.dumps(data))
    build_llama(
        root / "other", vocab_size=n, hidden=32, layers=1, seed=2, tokenizer_from=root / "tok_b"
    )
    return root


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _doctor(*args: str, env: dict | None = None):
    env = {"SPEC_REDIS_URL": None, "REDIS_URL": None, **(env or {})}
    return CliRunner().invoke(main, list(args), env=env, catch_exceptions=False)


def _lines(result) -> dict[str, str]:
    """{check name: status} from the report lines."""
    out = {}
    for line in result.stdout.splitlines():
        status, rest = line.split(" ", 1)
        out[rest.strip().split(":", 1)[0]] = status
    return out


def test_healthy_setup_exits_0(models, redis_url):
    res = _doctor(
        "--redis",
        redis_url,
        "--target",
        str(models / "target"),
        "--draft",
        str(models / "draft"),
    )
    assert res.exit_code == 0, res.output
    status = _lines(res)
    assert list(status) == [
        "redis",
        "redis version",
        "redis persistence",
        "redis maxmemory-policy",
        "mlx",
        "memory",
        "pair",
        "features",
        "prefix cache",
        "acceptance",
        "speculation",
    ]
    assert (
        "OK   features: drafters model, lookup, none; batching exact; "
        "target layers: 2 attention; draft layers: 1 attention" in res.stdout.splitlines()
    )
    assert [status[k] for k in ("redis", "redis version", "redis maxmemory-policy")] == ["OK"] * 3
    assert (status["memory"], status["pair"]) == ("OK", "OK")
    # The private test server runs without persistence; MLX warns without OpenBLAS; random
    # tiny models may not pay for speculation, nor get drafts accepted. None is a FAIL.
    checks = ("redis persistence", "mlx", "acceptance", "speculation")
    assert {status[k] for k in checks} <= {"OK", "WARN"}
    assert f"OK   redis: reachable at {redact(redis_url)}\n" in res.stdout
    assert "drafter model, 3 prompts x 48 tokens: acceptance rate " in res.stdout
    assert "spec-doctor: ready (" in res.stderr


def test_eviction_policy_warns(models, redis_url):
    import redis

    conn = redis.Redis.from_url(redis_url, decode_responses=True)
    was = conn.config_get("maxmemory-policy")["maxmemory-policy"]
    conn.config_set("maxmemory-policy", "allkeys-lru")
    try:
        res = _doctor("--redis", redis_url, "--target", str(models / "target"), "--no-bench")
    finally:
        conn.config_set("maxmemory-policy", was)
    assert res.exit_code == 0, res.output
    assert (
        "WARN redis maxmemory-policy: allkeys-lru: under memory pressure Redis may evict "
        "queued jobs and results; set maxmemory-policy noeviction\n"
    ) in res.stdout


def test_redis_down_fails_with_what_to_do(models):
    url = f"redis://:hunter2@127.0.0.1:{_free_port()}/0"
    res = _doctor("--target", str(models / "target"), "--no-bench", env={"SPEC_REDIS_URL": url})
    assert res.exit_code == 1
    first = res.stdout.splitlines()[0]
    assert first.startswith(
        f"FAIL redis: cannot reach Redis at redis://:***@127.0.0.1:{url.rsplit(':', 1)[1][:-2]}"
    )
    assert "start Redis (`docker compose up -d redis` or `redis-server`)" in first
    assert "hunter2" not in res.output
    assert "spec-doctor: not ready (redis): fix the FAIL lines above" in res.stderr


def test_no_redis_url_skips_redis(models):
    res = _doctor("--target", str(models / "target"), "--no-bench")
    assert res.exit_code == 0, res.output
    assert res.stdout.splitlines()[0].startswith(
        "SKIP redis: no --redis, SPEC_REDIS_URL or REDIS_URL"
    )


def test_mismatched_tokenizers_fail(models):
    res = _doctor("--target", str(models / "target"), "--draft", str(models / "other"))
    assert res.exit_code == 1
    line = next(ln for ln in res.stdout.splitlines() if ln.startswith("FAIL"))
    assert line.startswith("FAIL tokenizers: tokenizers differ: target ")
    assert "id 300" in line and "use a draft from the same model family" in line
    assert "speculation" not in res.stdout


def test_pair_too_large_for_memory_fails_before_loading(models):
    res = _doctor(
        "--target", str(models / "target"), "--draft", str(models / "draft"), "--memory-gb", "0.001"
    )
    assert res.exit_code == 1
    line = next(ln for ln in res.stdout.splitlines() if ln.startswith("FAIL"))
    assert line.startswith("FAIL memory: pair needs ")
    assert "machine has 0.001 GB (--memory-gb): the pair does not fit" in line
    assert "SKIP pair: not loaded: it does not fit in memory" in res.stdout


def test_memory_arithmetic_is_exact(models):
    config = json.loads((models / "target" / "config.json").read_text())
    # 2 (K, V) * 2 layers * 2 kv heads * (64 / 2) head dim * 100 tokens * 4 bytes
    assert kv_cache_bytes(config, 100, 4) == 2 * 2 * 2 * 32 * 100 * 4
    gqa = {
        "num_hidden_layers": 28,
        "num_attention_heads": 28,
        "num_key_value_heads": 4,
        "hidden_size": 3584,
    }
    assert kv_cache_bytes(gqa, 32768, 2) == 2 * 28 * 4 * 128 * 32768 * 2  # Qwen2.5-7B: 1.75 GiB
    size = model_size(models / "target", 512, on_cpu=True)
    params = os.path.getsize(models / "target" / "model.safetensors")
    assert 0.99 * params < size.weights <= params  # fp32 weights: the file minus its header
    assert size.kv_cache == 2 * 2 * 2 * 32 * 512 * 4


def test_a_target_without_an_exact_ragged_form_is_named_with_what_still_works(tmp_path):
    from tiny_families import build_model, tokenizer_dir

    tok, vocab = tokenizer_dir(tmp_path)
    target = build_model(tmp_path / "falcon", "falcon_h1", vocab_size=vocab, tokenizer_from=tok)
    res = _doctor("--target", str(target), "--no-bench")
    assert res.exit_code == 0, res.output
    line = next(ln for ln in res.stdout.splitlines() if ln.startswith("WARN pair:"))
    assert "layer 0 keeps its state in a CacheList" in line
    assert line.endswith(
        "served with plain decoding only: every request runs as drafter 'none', one row per "
        "forward pass"
    )
    assert "OK   features: drafters none; no batching" in res.stdout
    res = _doctor("--target", str(target), "--draft", str(target), "--no-bench")
    assert res.exit_code == 1
    assert "FAIL model family: target model: model type 'falcon_h1'" in res.stdout


# -- whether the draft pays: alternating runs, a verdict only where the range agrees -----
ADVICE_START = "the draft does not pay here; use a draft from the same family"


@pytest.mark.parametrize(
    "rates, status, words",
    [
        # (draft tokens/s, plain tokens/s) per alternating pair
        ([(12.3, 10.0), (7.7, 10.0), (11.0, 10.0)], "WARN", "0.77-1.23x over 3 alternating"),
        ([(12.0, 10.0), (10.0, 10.0), (15.0, 10.0)], "OK", "1.00-1.50x over 3 alternating"),
        ([(9.0, 10.0), (5.0, 10.0), (9.9, 10.0)], "WARN", "0.50-0.99x over 3 alternating"),
        ([(11.0, 10.0)], "OK", "speedup 1.10x over 1 alternating"),
    ],
)
def test_the_speed_verdict_is_the_whole_ranges(rates, status, words):
    from worker.doctor import speed_verdict

    got_status, got = speed_verdict(rates)
    assert got_status == status and words in got, got
    low, high = (min(d / p for d, p in rates), max(d / p for d, p in rates))
    if low >= 1.0:
        assert got.endswith(": the draft pays here")
    elif high < 1.0:
        assert ADVICE_START in got and "too busy" not in got
    else:
        assert got.endswith(
            ": the machine was too busy to tell (the pairs disagree on whether the draft "
            "pays); run spec-doctor again when the machine is idle, or with more --repeats"
        )
        assert "does not pay" not in got  # no advice to change a draft that may pay


def test_spec_doctor_alternates_draft_and_plain_and_reports_the_range(models, monkeypatch):
    import worker.doctor as doctor

    # A busy machine: the same pair measures 1.23x, then 0.77x (seconds per run).
    seconds = iter([1.0, 1.23, 1.3, 1.0, 1.0, 1.1])
    order = []

    def timed(pair, drafter, stats):
        order.append(drafter)
        return next(seconds), 100

    monkeypatch.setattr(doctor, "_timed", timed)
    res = _doctor(
        "--target", str(models / "target"), "--draft", str(models / "draft"), "--repeats", "3"
    )
    assert res.exit_code == 0, res.output
    assert order == ["model", "none"] * 3
    line = next(ln for ln in res.stdout.splitlines() if " speculation:" in ln)
    assert line.startswith(
        "WARN speculation: drafter model, 3 prompts x 48 tokens: no drafts made ('auto' chose "
        "plain steps), "
    )
    assert "76.9-100.0 tokens/s vs 81.3-100.0 plain; speedup 0.77-1.23x over 3 " in line
    assert "the machine was too busy to tell" in line
