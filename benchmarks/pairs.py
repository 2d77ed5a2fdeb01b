"""Benchmark models, built on the fly and cached under benchmarks/.cache/ (git-ignored).

- A *widened target*: the demo target with extra MLP hidden units whose down-projection
  columns are zero. The function is unchanged (the new units add exactly 0 to the
  residual stream) but every forward pass costs what a model of `total_params` costs.
- A *useless draft*: the demo draft's shape and tokenizer with random weights, so
  speculation never pays and "auto" has to back off.

Both are saved in the standard layout (config.json, model.safetensors, tokenizer files)
so `engine.load_pair(widened_dir, draft_dir)` and `mlx_lm.load` read them; `with_draft`
pairs a loaded target with another draft (the useless one) without loading it again.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import engine  # noqa: F401  (loads OpenBLAS before mlx is imported)

# isort: split
import mlx.core as mx
import mlx_lm

from engine.loading import ModelPair

CACHE = Path(__file__).resolve().parent / ".cache"
WEIGHTS = "model.safetensors"
#: Bump when the construction changes, so stale cache entries are not reused.
VERSION = 1


def digest(model_dir: Path) -> str:
    """First 12 hex digits of the sha256 of config.json + model.safetensors."""
    h = hashlib.sha256()
    for name in ("config.json", WEIGHTS):
        h.update((model_dir / name).read_bytes())
    return h.hexdigest()[:12]


def _copy_tokenizer(src: Path, dst: Path) -> None:
    for path in src.iterdir():
        if path.is_file() and path.name not in ("config.json", WEIGHTS) and path.suffix != ".md":
            shutil.copy2(path, dst / path.name)


def _save(out: Path, weights: dict, config: dict, tokenizer_from: Path) -> Path:
    """Write a model directory atomically (a half-written cache entry is never used)."""
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    mx.save_safetensors(str(tmp / WEIGHTS), weights)
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    _copy_tokenizer(tokenizer_from, tmp)
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out


def widened_size(target_dir: Path, total_params: int) -> tuple[int, int]:
    """(current parameter count, the intermediate_size that brings it to ~total_params)."""
    config = json.loads((target_dir / "config.json").read_text())
    current = sum(v.size for v in mx.load(str(target_dir / WEIGHTS)).values())
    per_unit = 3 * config["hidden_size"] * config["num_hidden_layers"]  # gate + up + down
    extra = max(0, round((total_params - current) / per_unit))
    inter = config["intermediate_size"] + extra
    return current, -(-inter // 64) * 64  # a multiple of 64: friendlier to BLAS blocking


def widen(target_dir: Path, total_params: int, cache: Path = CACHE, seed: int = 0) -> Path:
    """The target widened to ~total_params parameters (same function); cached."""
    target_dir = Path(target_dir)
    _, inter = widened_size(target_dir, total_params)
    out = cache / f"widened-{digest(target_dir)}-i{inter}-s{seed}-v{VERSION}"
    if (out / WEIGHTS).exists():
        return out
    config = json.loads((target_dir / "config.json").read_text())
    old = config["intermediate_size"]
    weights = mx.load(str(target_dir / WEIGHTS))
    if any(v.dtype not in (mx.float32, mx.float16, mx.bfloat16) for v in weights.values()):
        raise SystemExit(f"{target_dir}: quantized weights cannot be widened")
    key = mx.random.key(seed)
    for name in sorted(weights):
        if not name.endswith("mlp.down_proj.weight"):
            continue
        prefix = name[: -len("down_proj.weight")]
        for proj in ("gate_proj", "up_proj"):
            w = weights[f"{prefix}{proj}.weight"].astype(mx.float32)  # (old, hidden)
            key, sub = mx.random.split(key)
            std = mx.std(w).item()
            new = mx.random.normal((inter - old, w.shape[1]), key=sub) * std
            weights[f"{prefix}{proj}.weight"] = mx.concatenate([w, new])
        down = weights[name].astype(mx.float32)  # (hidden, old): new columns are zero
        weights[name] = mx.concatenate([down, mx.zeros((down.shape[0], inter - old))], axis=1)
    weights = {k: v.astype(mx.float32) for k, v in weights.items()}
    mx.eval(weights)
    config.update(intermediate_size=inter, torch_dtype="float32")
    return _save(out, weights, config, target_dir)


def useless_draft(draft_dir: Path, cache: Path = CACHE, seed: int = 1234) -> Path:
    """A draft with the given draft's shape and tokenizer and random weights; cached.

    Each tensor is redrawn from a normal law with the original tensor's mean and
    standard deviation, so activations keep a sane scale but carry no knowledge.
    """
    draft_dir = Path(draft_dir)
    out = cache / f"useless-{digest(draft_dir)}-s{seed}-v{VERSION}"
    if (out / WEIGHTS).exists():
        return out
    config = json.loads((draft_dir / "config.json").read_text())
    weights = mx.load(str(draft_dir / WEIGHTS))
    key = mx.random.key(seed)
    fresh = {}
    for name in sorted(weights):
        w = weights[name].astype(mx.float32)
        key, sub = mx.random.split(key)
        fresh[name] = mx.random.normal(w.shape, key=sub) * mx.std(w) + mx.mean(w)
    mx.eval(fresh)
    return _save(out, fresh, config, draft_dir)


def max_logit_difference(model_a, model_b, prompts: list[list[int]]) -> float:
    """Largest |logit_a - logit_b| over every position of the given prompts."""
    worst = 0.0
    for ids in prompts:
        x = mx.array([ids])
        worst = max(worst, mx.max(mx.abs(model_a(x) - model_b(x))).item())
    return worst


def with_draft(pair: ModelPair, draft_dir: Path, name: str) -> ModelPair:
    """`pair`'s target (the same loaded model) with the draft in `draft_dir`, and a
    draft-length policy of its own: the useless-draft pair of bench.py and lockstep.py."""
    draft, _ = mlx_lm.load(str(draft_dir))
    other = ModelPair(
        target=pair.target,
        draft=draft,
        tokenizer=pair.tokenizer,
        target_path=pair.target_path,
        draft_path=str(draft_dir),
        context_length=pair.context_length,
        target_vocab=pair.target_vocab,
        draft_vocab=pair.draft_vocab,
        name=name,
    )
    return other
