"""Reading a target's hidden states during its ordinary forward passes: each named decoder
layer is stood in for by a hook that keeps its output, for as long as a `with` block lasts.
Every drafter that reads the target (engine.dflash, engine.heads' MTP and EAGLE-3 heads)
captures through `capture_layers`."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from .types import ModelLoadError


def target_layers(target: nn.Module) -> list:
    """The decoder-layer list of an mlx-lm causal LM (llama, qwen3, qwen3_5 style)."""
    for path in ("model.layers", "language_model.model.layers", "layers"):
        obj: Any = target
        try:
            for part in path.split("."):
                obj = getattr(obj, part)
        except AttributeError:
            continue
        if isinstance(obj, list):
            return obj
    raise ModelLoadError(f"cannot find the decoder layers of {type(target).__name__}")


class _Hook:
    """Stands in for a target layer: calls it and keeps its output."""

    def __init__(self, layer, slot: int, store: list):
        self._layer, self._slot, self._store = layer, slot, store

    def __call__(self, *args, **kwargs):
        out = self._layer(*args, **kwargs)
        self._store[self._slot] = out
        return out

    def __getattr__(self, name):
        return getattr(self._layer, name)


class LayerCapture:
    """Outputs of some target layers in the latest pass, turned into features by `finish`."""

    def __init__(self, n: int, finish: Callable[[list], mx.array]):
        self._outputs: list = [None] * n
        self._finish = finish

    @property
    def features(self) -> mx.array:
        """(B, T, feature size); raises RuntimeError when no target pass ran inside."""
        if any(o is None for o in self._outputs):
            raise RuntimeError("no target forward pass ran inside the capture")
        return self._finish(self._outputs)


@contextmanager
def capture_layers(target, ids: list[int], finish) -> Iterator[LayerCapture]:
    """Inside the block, target forwards record the outputs of layers `ids` (negative ids
    count from the end; one layer may be named twice); the layer list is restored on exit."""
    layers = target_layers(target)
    where = sorted({i % len(layers) for i in ids})
    cap = LayerCapture(
        len(where), lambda outs: finish([outs[where.index(i % len(layers))] for i in ids])
    )
    originals = {i: layers[i] for i in where}
    try:
        for slot, i in enumerate(where):
            layers[i] = _Hook(originals[i], slot, cap._outputs)
        yield cap
    finally:
        for i, layer in originals.items():
            layers[i] = layer
