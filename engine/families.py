"""What a model's layers are, and what the engine can do with them exactly.

mlx-lm says what state each layer keeps through `model.make_cache()`: `KVCache`
(full attention), `RotatingKVCache` (sliding window), `ArraysCache` (recurrent state:
gated delta-nets, conv and SSM layers), or something else (`CacheList`, quantized KV
caches...). Each known kind has a ragged counterpart that keeps every row exact after
`advance` and `drop_last` (ragged.py, recurrent.py). A layer kind without one would
make batched or speculative output differ from target-only decoding, so such a model
is refused when it is loaded (`check_model`), never corrupted at request time.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache, KVCache, RotatingKVCache

from contract.limits import DRAFTERS

from .ragged import RaggedLayerCache, RaggedRows
from .recurrent import RecurrentLayerCache, install_recorder
from .types import ModelLoadError

#: Names mlx-lm models give the module that owns a recurrent layer's state.
MIXER_NAMES = ("linear_attn", "mixer", "conv", "mamba", "ssm")


class UnsupportedModelError(ModelLoadError):
    """A model has a layer kind whose state the engine cannot keep exact per row."""


@dataclass(frozen=True)
class Features:
    """What a loaded pair supports: drafters, batching, and its layer kinds."""

    drafters: tuple[str, ...]
    batching: bool
    target_layers: dict
    draft_layers: dict

    def as_dict(self) -> dict:
        return {
            "drafters": list(self.drafters),
            "batching": self.batching,
            "target_layers": dict(self.target_layers),
            "draft_layers": dict(self.draft_layers),
        }


def _template(model) -> list:
    if hasattr(model, "make_cache"):
        return model.make_cache()
    return [KVCache() for _ in model.layers]


def _kind(cache) -> str:
    # Exact types: a subclass (e.g. a quantized or batched cache) behaves differently.
    if type(cache) is KVCache:
        return "attention"
    if type(cache) is RotatingKVCache and cache.keep == 0:
        return "sliding"
    if type(cache) is ArraysCache:
        return "recurrent"
    name = type(cache).__name__
    if type(cache) is RotatingKVCache:
        name += f" (keep={cache.keep})"
    return name


def layer_kinds(model) -> Counter:
    """How many layers of each kind: {"attention": 4, "recurrent": 12, ...}."""
    return Counter(_kind(c) for c in _template(model))


def _install_recorders(model) -> None:
    for layer in model.layers:
        for name in MIXER_NAMES:
            child = getattr(layer, name, None)
            if child is not None and callable(child):
                install_recorder(child)


def make_ragged_cache(model, batch: int) -> tuple[RaggedRows, list]:
    """A ragged cache for `model` with `batch` empty rows, in the layout the model's
    own `make_cache()` has (one ragged layer cache per mlx-lm layer cache).

    Raises UnsupportedModelError for a layer kind it cannot keep exact."""
    rows = RaggedRows(batch)
    return rows, layer_caches(model, rows)


def layer_caches(model, rows) -> list:
    """One ragged layer cache per entry of the model's own cache layout.

    Raises UnsupportedModelError naming the first layer kind with no exact ragged form."""
    template = _template(model)
    caches = []
    for i, cache in enumerate(template):
        kind = _kind(cache)
        if kind == "attention":
            caches.append(RaggedLayerCache(rows))
        elif kind == "sliding":
            caches.append(RaggedLayerCache(rows, window=cache.max_size))
        elif kind == "recurrent":
            caches.append(RecurrentLayerCache(rows, len(cache.cache)))
        else:
            raise UnsupportedModelError(_refusal(model, i, kind))
    if any(isinstance(c, RecurrentLayerCache) for c in caches):
        _install_recorders(model)
    return caches


def _refusal(model, index: int, kind: str) -> str:
    model_type = getattr(model, "model_type", type(model).__module__.rsplit(".", 1)[-1])
    return (
        f"model type {model_type!r}: layer {index} keeps its state in a {kind}, which "
        "this engine cannot batch or roll back exactly, so it would change the output; "
        "no speculation or batching runs on it here (or pick a model whose layers are "
        "full attention, sliding-window attention or ArraysCache recurrent state)"
    )


def check_model(model, role: str) -> Counter:
    """Refuse a model the engine cannot keep exact; return its layer kinds.

    Builds its ragged cache and runs one 2-token pass, so every recurrent layer's
    mixer is proven to report its inputs (replays need them). Raises
    UnsupportedModelError (a ModelLoadError) saying which layer and what still works."""
    try:
        rows, caches = make_ragged_cache(model, 1)
    except UnsupportedModelError as exc:
        hint = (
            "; load the target without this draft: drafters 'lookup' and 'none' still work"
            if role == "draft"
            else ""
        )
        raise UnsupportedModelError(f"{role} model: {exc}{hint}") from exc
    recurrent = [i for i, c in enumerate(caches) if isinstance(c, RecurrentLayerCache)]
    if recurrent:
        model(mx.array([[0, 0]]), cache=caches)
        silent = [i for i in recurrent if caches[i]._pending is None]
        if silent:
            raise UnsupportedModelError(
                f"{role} model: recurrent layer {silent[0]} does not go through a mixer "
                f"named one of {', '.join(MIXER_NAMES)}, so its state could not be rolled "
                "back per row; no speculation or batching runs on it here"
                + (
                    "; drafters 'lookup' and 'none' still work without it"
                    if role == "draft"
                    else ""
                )
            )
    return layer_kinds(model)


def features(target, draft, block_drafter=None, plain_only: bool = False) -> Features:
    """Features of a pair whose models passed `check_model` (`block_drafter`: a DFlash
    drafter, which serves drafter "model" and has no cache of its own kinds), or of a
    plain-only target (engine.plain: no drafter but "none", no batching)."""
    has_draft = draft is not None or block_drafter is not None
    drafters = DRAFTERS if has_draft else ("lookup", "none")
    if plain_only:
        drafters = ("none",)
    return Features(
        drafters=drafters,
        batching=not plain_only,
        target_layers=dict(layer_kinds(target)),
        draft_layers=dict(layer_kinds(draft)) if draft is not None else {},
    )
