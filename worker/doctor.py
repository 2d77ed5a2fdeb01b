"""`spec-doctor`: is this machine ready to be a worker? One line per check, OK/WARN/FAIL.

Checks Redis (reachable, version, persistence, eviction policy), MLX (version, device,
BLAS), the model pair (loads, tokenizers agree, fits in memory with its KV caches at
a given context), whether the drafter's drafts get accepted at all, and whether
speculation pays on this machine (short timed runs alternating with plain decoding).
Exit status 0 when nothing FAILed, 1 otherwise.
"""

from __future__ import annotations

import json
import os
import platform
import struct
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import click

#: Prompts and length of the timed run (greedy, so both runs emit the same tokens).
BENCH_PROMPTS = (
    "def fibonacci(n):",
    "import os\nimport sys\n\n",
    "class Stack:\n    def __init__(self):",
)
BENCH_TOKENS = 48
#: Draft and plain runs alternate, this many pairs: a busy machine moves the speedup from
#: pair to pair (1.23x then 0.77x a minute apart), so only a verdict the range agrees on.
BENCH_REPEATS = 3

#: Above this share of the machine's memory the pair is a WARN: the OS needs the rest,
#: and on a Mac the GPU may by default use only about 75% of unified memory.
MEMORY_WARN_SHARE = 0.75

GB = 1024**3

DRAFT_ADVICE = (
    "use a draft from the same family with the same tokenizer, ~10-30x smaller "
    "(a distilled draft is best); sample at a lower temperature; use fewer draft "
    "tokens (num_draft_tokens 1-2, or 'auto'); for input-grounded work (summaries, "
    "extraction, code edits) try drafter 'lookup'; else drafter 'none' "
    "(docs/choosing-a-draft.md)"
)


@dataclass(frozen=True)
class Check:
    """One line of the report: status OK, WARN, FAIL or SKIP, what was checked, and
    what was found (a FAIL says what to do)."""

    status: str
    name: str
    message: str

    def line(self) -> str:
        return f"{self.status:<4} {self.name}: {self.message}"


# --- Redis -----------------------------------------------------------------------------


def check_redis(url: str | None) -> list[Check]:
    """Reachable, server version, persistence, maxmemory-policy. Without a URL: SKIP."""
    url = url or os.environ.get("SPEC_REDIS_URL") or os.environ.get("REDIS_URL")
    if not url:
        return [
            Check(
                "SKIP",
                "redis",
                "no --redis, SPEC_REDIS_URL or REDIS_URL: Redis checks skipped "
                "(spec-run needs no Redis; spec-worker does)",
            )
        ]
    import redis

    from jobstore.config import redact
    from jobstore.connection import RedisUnavailable, connect

    try:
        conn = connect(url)
        info = conn.info("server")
    except RedisUnavailable as exc:
        return [
            Check(
                "FAIL",
                "redis",
                f"{exc}; start Redis (`docker compose up -d redis` or `redis-server`) "
                "or fix the host, port and password in --redis",
            )
        ]
    checks = [
        Check("OK", "redis", f"reachable at {redact(url)}"),
        Check("OK", "redis version", f"server {info.get('redis_version', 'unknown')}"),
    ]
    try:
        config = conn.config_get("appendonly") | conn.config_get("save")
        config |= conn.config_get("maxmemory-policy")
    except redis.exceptions.ResponseError:  # managed Redis often disables CONFIG
        return checks + [
            Check(
                "WARN",
                "redis config",
                "CONFIG GET is not allowed here: make sure persistence is on and "
                "maxmemory-policy is noeviction",
            )
        ]
    aof = config.get("appendonly") == "yes"
    rdb = bool((config.get("save") or "").strip())
    if aof or rdb:
        kinds = " and ".join(
            k for k, on in (("AOF", aof), (f"RDB (save {config.get('save')})", rdb)) if on
        )
        checks.append(Check("OK", "redis persistence", kinds))
    else:
        checks.append(
            Check(
                "WARN",
                "redis persistence",
                "none (appendonly no, save ''): a Redis restart loses queued jobs and "
                "results; set appendonly yes",
            )
        )
    policy = config.get("maxmemory-policy")
    if policy == "noeviction":
        checks.append(Check("OK", "redis maxmemory-policy", "noeviction"))
    else:
        checks.append(
            Check(
                "WARN",
                "redis maxmemory-policy",
                f"{policy}: under memory pressure Redis may evict queued jobs and results; "
                "set maxmemory-policy noeviction",
            )
        )
    return checks


# --- memory ----------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelSize:
    """Bytes one model needs: weights as loaded, and its KV cache at `context` tokens."""

    weights: int
    kv_cache: int
    context: int


def _config(model_dir: Path) -> dict:
    config = json.loads((model_dir / "config.json").read_text())
    return {**config, **config.get("text_config", {})}


def _weight_bytes(model_dir: Path, on_cpu: bool) -> int:
    """Tensor bytes from the safetensors headers (no weights are read). On the CPU
    the engine casts fp16/bf16 to fp32, doubling them."""
    total = 0
    for path in sorted(model_dir.glob("*.safetensors")):
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(n))
        for name, tensor in header.items():
            if name == "__metadata__":
                continue
            start, end = tensor["data_offsets"]
            grow = 2 if on_cpu and tensor["dtype"] in ("F16", "BF16") else 1
            total += (end - start) * grow
    return total


def kv_cache_bytes(config: dict, context: int, bytes_per_element: int) -> int:
    """2 (K and V) * layers * kv_heads * head_dim * context * bytes per element."""
    layers = config.get("num_hidden_layers") or config.get("n_layer") or config["num_layers"]
    heads = config.get("num_attention_heads") or config["n_head"]
    kv_heads = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim") or (config.get("hidden_size") or config["n_embd"]) // heads
    return 2 * layers * kv_heads * head_dim * context * bytes_per_element


def model_size(model_dir: Path, context: int, on_cpu: bool) -> ModelSize:
    """What a local model directory needs in memory. Raises OSError, KeyError, ValueError."""
    config = _config(model_dir)
    float32 = on_cpu or config.get("torch_dtype") in ("float32", None)
    return ModelSize(
        _weight_bytes(model_dir, on_cpu),
        kv_cache_bytes(config, context, 4 if float32 else 2),
        context,
    )


def _size(n: int) -> str:
    return f"{n / GB:.3g} GB" if n >= GB / 10 else f"{n / 1024**2:.3g} MB"


def machine_memory() -> tuple[int, str]:
    """(bytes of RAM, where the number came from). (0, reason) when unknown."""
    if sys.platform == "darwin":
        out = subprocess.run(["sysctl", "-n", "hw.memsize"], capture_output=True, text=True)
        if out.returncode == 0 and out.stdout.strip().isdigit():
            return int(out.stdout), "sysctl hw.memsize"
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024, "/proc/meminfo"
    except OSError:
        pass
    return 0, f"unknown on {platform.system()}"


def _model_dirs(target: str | None, draft: str | None) -> tuple[Path, Path | None]:
    from engine.loading import DEMO_DRAFT, DEMO_TARGET
    from engine.mtp import is_mtp_spec

    if target is None and draft is None:
        return DEMO_TARGET, DEMO_DRAFT
    if is_mtp_spec(draft):  # the head's weights are in the target's files
        draft = None
    return Path(target).expanduser() if target else DEMO_TARGET, (
        Path(draft).expanduser() if draft else None
    )


def check_memory(
    target: str | None, draft: str | None, context: int | None, memory_gb: float | None
) -> Check:
    """The pair's weights plus both KV caches at `context` (default: the target's
    context length) against the machine's memory (or --memory-gb)."""
    from engine.loading import context_length_of

    on_cpu = sys.platform != "darwin"
    target_dir, draft_dir = _model_dirs(target, draft)
    try:
        ctx = context or context_length_of(_config(target_dir))
        parts = [("target", model_size(target_dir, ctx, on_cpu))]
        if draft_dir is not None:
            parts.append(("draft", model_size(draft_dir, ctx, on_cpu)))
    except (OSError, KeyError, ValueError) as exc:
        return Check("WARN", "memory", f"cannot size the pair from its files ({exc}); not checked")
    need = sum(p.weights + p.kv_cache for _, p in parts)
    detail = ", ".join(
        f"{role} {_size(p.weights)} weights + {_size(p.kv_cache)} KV cache" for role, p in parts
    )
    if memory_gb is not None:
        have, source = int(memory_gb * GB), "--memory-gb"
    else:
        have, source = machine_memory()
    if not have:
        return Check("WARN", "memory", f"pair needs {_size(need)} ({detail}); RAM {source}")
    what = (
        f"pair needs {_size(need)} at context {ctx} ({detail}); "
        f"machine has {have / GB:.3g} GB ({source})"
    )
    if need > have:
        return Check(
            "FAIL",
            "memory",
            f"{what}: the pair does not fit; use a smaller or quantized target, a shorter "
            "--context, or a machine with more memory",
        )
    if need > MEMORY_WARN_SHARE * have:
        return Check("WARN", "memory", f"{what}: more than {MEMORY_WARN_SHARE:.0%}, tight")
    return Check("OK", "memory", what)


# --- MLX, the pair, and a timed run -----------------------------------------------------


def check_mlx() -> Check:
    from engine.blas import blas_info  # first: loads a fast BLAS before mlx, on Linux

    # isort: split
    import mlx.core as mx
    import mlx_lm

    blas = blas_info()
    what = f"mlx {mx.__version__}, mlx-lm {mlx_lm.__version__}, {mx.default_device()}, BLAS {blas}"
    if blas.startswith("reference"):
        return Check(
            "WARN",
            "mlx",
            f"{what}: matmuls run ~20x slower; install OpenBLAS (Debian: apt-get install libopenblas0)",
        )
    return Check("OK", "mlx", what)


def load(target: str | None, draft: str | None) -> tuple[Check, object | None]:
    """Load the pair as a worker does; a Check, and the pair (None when it failed)."""
    import engine
    from engine.families import UnsupportedModelError
    from jobstore import config

    try:
        pair = engine.load_pair(target, draft, prefix_cache_bytes=config.prefix_cache_bytes())
    except ValueError as exc:  # a bad SPEC_PREFIX_CACHE_MB
        return Check("FAIL", "pair", str(exc)), None
    except engine.TokenizerMismatchError as exc:
        return Check("FAIL", "tokenizers", str(exc)), None
    except UnsupportedModelError as exc:
        return Check("FAIL", "model family", str(exc)), None
    except engine.ModelLoadError as exc:
        return Check("FAIL", "pair", f"{exc}; check the --target/--draft paths"), None
    info = pair.info()
    what = (
        f"{info['name']}: target {info['target_parameters'] / 1e6:.3g}M parameters, "
        f"context {info['context_length']}"
    )
    if pair.dflash is not None and hasattr(pair.dflash, "describe"):  # MTP, EAGLE-3
        return Check(
            "OK", "pair", f"{what}; drafter {pair.dflash.kind}: {pair.dflash.describe()}"
        ), pair
    if pair.dflash is not None:
        d = pair.dflash.info()
        return Check(
            "OK",
            "pair",
            f"{what}; draft: {pair.dflash.config.name} block drafter ({d['drafter']}), "
            f"block size {d['block_size']}, "
            f"{d['parameters'] / 1e6:.3g}M parameters, reads target layers "
            f"{', '.join(map(str, d['target_layer_ids']))}",
        ), pair
    if pair.plain_only:
        return Check(
            "WARN",
            "pair",
            f"{what}; {pair.plain_only}; it is served with plain decoding only: every "
            "request runs as drafter 'none', one row per forward pass",
        ), pair
    if pair.draft is None:
        return Check("OK", "pair", f"{what}, no draft (drafters lookup and none only)"), pair
    return Check(
        "OK",
        "pair",
        f"{what}; draft {info['draft_parameters'] / 1e6:.3g}M parameters, tokenizers agree",
    ), pair


def check_features(pair) -> Check:
    """Which drafters and batching the pair supports, and its layer kinds."""
    f = pair.features()

    def kinds(layers: dict) -> str:
        return ", ".join(f"{n} {kind}" for kind, n in sorted(layers.items()))

    layers = f"target layers: {kinds(f.target_layers)}"
    if f.draft_layers:
        layers += f"; draft layers: {kinds(f.draft_layers)}"
    if pair.dflash is not None and hasattr(pair.dflash, "head"):  # MTP, EAGLE-3
        layers += f"; draft: {pair.dflash.kind} head, {len(pair.dflash.head.layers)} layer(s)"
    elif pair.dflash is not None:
        layers += f"; draft: {pair.dflash.config.name}, block size {pair.dflash.block_size}"
    batching = "batching exact" if f.batching else "no batching"
    return Check("OK", "features", f"drafters {', '.join(f.drafters)}; {batching}; {layers}")


def check_prefix(pair) -> Check:
    """The prefix cache's budget, and any state it does not keep."""
    import engine

    caches = pair.prefix
    status = "WARN" if caches is not None and caches.not_kept else "OK"
    return Check(status, "prefix cache", engine.prefix_line(pair).split(": ", 1)[1])


def check_drafts_accepted(pair) -> Check | None:
    """Whether the drafter's drafts get accepted on a few greedy tokens (the worker's
    start-up check, engine.acceptance_check); None when the pair has nothing to draft."""
    from engine.acceptance_check import check_acceptance

    try:
        found = check_acceptance(pair)
    except Exception as exc:  # jobs would fail the same way: say how
        return Check("FAIL", "acceptance", f"drafting a few tokens failed: {exc!r}")
    if found is None:
        return None
    warning = found.warning()
    return (
        Check("WARN", "acceptance", warning)
        if warning
        else Check("OK", "acceptance", found.summary())
    )


def _timed(pair, drafter: str, stats) -> tuple[float, int]:
    """Seconds and tokens of the BENCH_PROMPTS with `drafter`; its statistics merged
    into `stats` (an engine.SpecStats)."""
    import engine

    total_s, tokens = 0.0, 0
    for prompt in BENCH_PROMPTS:
        request = engine.GenerationRequest(
            prompt=prompt, max_tokens=BENCH_TOKENS, temperature=0.0, drafter=drafter
        )
        start = time.perf_counter()
        result = engine.generate(pair, request)
        total_s += time.perf_counter() - start
        tokens += result.usage["completion_tokens"]
        stats.merge(result.stats)
    return total_s, tokens


def speed_verdict(rates: list[tuple[float, float]]) -> tuple[str, str]:
    """(status, words) from (draft tokens/s, plain tokens/s) of alternating runs, one pair
    each. The range of the per-pair speedups decides: OK when the whole range says the
    draft pays (>= 1x), WARN with advice when the whole range says it does not, else WARN
    that the machine was too busy to tell. Raises ValueError on no pairs."""
    if not rates:
        raise ValueError("speed_verdict: no timed pairs")
    ratios = [draft / plain for draft, plain in rates]
    low, high = min(ratios), max(ratios)
    span = f"{low:.2f}-{high:.2f}x" if len(ratios) > 1 else f"{low:.2f}x"
    what = f"speedup {span} over {len(ratios)} alternating draft/plain pair(s)"
    if low >= 1.0:
        return "OK", f"{what}: the draft pays here"
    if high < 1.0:
        return "WARN", f"{what}: the draft does not pay here; {DRAFT_ADVICE}"
    return "WARN", (
        f"{what}: the machine was too busy to tell (the pairs disagree on whether the draft "
        "pays); run spec-doctor again when the machine is idle, or with more --repeats"
    )


def check_speculation(pair, repeats: int = BENCH_REPEATS) -> Check:
    """Acceptance and speedup over plain decoding on this machine, greedy: draft and plain
    runs alternate (A B A B ...), `repeats` pairs, and the verdict is the range's."""
    import engine

    drafter = "model" if pair.draft is not None or pair.dflash is not None else "lookup"
    for d in (drafter, "none"):  # warm-up: first calls compile kernels and fill caches
        engine.generate(
            pair, engine.GenerationRequest(prompt=BENCH_PROMPTS[0], max_tokens=4, drafter=d)
        )
    stats, plain = engine.SpecStats(drafter=drafter), engine.SpecStats(drafter="none")
    rates = []
    for _ in range(repeats):
        spec_s, spec_n = _timed(pair, drafter, stats)
        plain_s, plain_n = _timed(pair, "none", plain)
        rates.append((spec_n / spec_s, plain_n / plain_s))
    status, verdict = speed_verdict(rates)
    d = stats.to_dict()
    spec_tps, plain_tps = [r[0] for r in rates], [r[1] for r in rates]
    accepted = (
        f"acceptance rate {d['draft_acceptance_rate']:.2f}, mean acceptance length "
        f"{d['mean_acceptance_length']:.2f}"
        if stats.num_draft_tokens
        else "no drafts made ('auto' chose plain steps)"
    )
    what = (
        f"drafter {d['drafter']}, {len(BENCH_PROMPTS)} prompts x {BENCH_TOKENS} tokens: "
        f"{accepted}, {_span(spec_tps)} tokens/s vs {_span(plain_tps)} plain; {verdict}"
    )
    return Check(status, "speculation", what)


def _span(values: list[float]) -> str:
    low, high = min(values), max(values)
    return f"{low:.1f}-{high:.1f}" if f"{low:.1f}" != f"{high:.1f}" else f"{low:.1f}"


# --- command ---------------------------------------------------------------------------


def run_checks(
    redis_url, target, draft, context, memory_gb, bench, echo, repeats: int = BENCH_REPEATS
) -> list[Check]:
    """Run every check in order, passing each to `echo` as soon as it is known."""
    checks: list[Check] = []

    def add(*new: Check) -> None:
        for c in new:
            checks.append(c)
            echo(c.line())

    add(*check_redis(redis_url))
    add(check_mlx())
    memory = check_memory(target, draft, context, memory_gb)
    add(memory)
    if memory.status == "FAIL":
        add(Check("SKIP", "pair", "not loaded: it does not fit in memory"))
        return checks
    loaded, pair = load(target, draft)
    add(loaded)
    if pair is None:
        return checks
    add(check_features(pair))
    add(check_prefix(pair))
    accepted = check_drafts_accepted(pair)
    if accepted is not None:
        add(accepted)
    if bench:
        add(check_speculation(pair, repeats))
    return checks


@click.command()
@click.option(
    "--redis",
    "redis_url",
    metavar="URL",
    help="Redis URL [default: $SPEC_REDIS_URL, else $REDIS_URL; none: skip].",
)
@click.option(
    "--target",
    default=None,
    metavar="DIR",
    help="Target model directory or hub id (default: demo).",
)
@click.option(
    "--draft",
    default=None,
    metavar="DIR",
    help="Draft model directory or hub id (default: demo's).",
)
@click.option(
    "--context",
    type=click.IntRange(min=1),
    default=None,
    metavar="N",
    help="Tokens of KV cache to budget for [default: the target's context length].",
)
@click.option(
    "--memory-gb",
    type=click.FloatRange(min=0, min_open=True),
    default=None,
    metavar="X",
    help="Memory to check against instead of the machine's.",
)
@click.option("--no-bench", is_flag=True, help="Skip the timed speculative run.")
@click.option(
    "--repeats",
    type=click.IntRange(min=1),
    default=BENCH_REPEATS,
    show_default=True,
    metavar="N",
    help="Alternating draft/plain run pairs of the timed run (more: a surer verdict).",
)
def main(redis_url, target, draft, context, memory_gb, no_bench, repeats):
    """Check that this machine can serve as a worker: Redis, MLX, the model pair,
    memory, and whether speculation pays here. Exit status 1 when a check FAILs."""
    checks = run_checks(
        redis_url, target, draft, context, memory_gb, not no_bench, click.echo, repeats
    )
    failed = [c for c in checks if c.status == "FAIL"]
    warned = sum(c.status == "WARN" for c in checks)
    if failed:
        names = ", ".join(c.name for c in failed)
        click.echo(f"spec-doctor: not ready ({names}): fix the FAIL lines above", err=True)
        sys.exit(1)
    click.echo(f"spec-doctor: ready ({warned} warning{'s' * (warned != 1)})", err=True)
