"""Reading a drafter's safetensors into its module: what engine.dflash, engine.eagle3 and
engine.mtp (and engine.loading for whole models) do alike, so it is done once."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_map

from .types import ModelLoadError


def read_safetensors(path: Path, where: str) -> dict:
    """Every tensor of every *.safetensors file in `path`, files in name order (a later
    file's tensor wins); raises ModelLoadError "{where}: no *.safetensors files"."""
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{where}: no *.safetensors files")
    weights = {}
    for f in files:
        weights.update(mx.load(str(f)))
    return weights


def float32(x: mx.array) -> mx.array:
    """`x` in float32 when it is float16 or bfloat16: those matmuls bypass BLAS on the CPU
    backend and run ~20x slower than float32."""
    return x.astype(mx.float32) if x.dtype in (mx.float16, mx.bfloat16) else x


def to_float32(module: nn.Module) -> None:
    """Cast `module`'s half-precision parameters to float32 (`float32`) and evaluate them."""
    module.update(tree_map(float32, module.parameters()))
    mx.eval(module.parameters())


def load_strict(module: nn.Module, weights: dict, mismatch: str, quant: dict | None = None):
    """Load `weights` into `module`, every name and shape matching, ready to run here.

    With `quant` (config.json's `quantization`, as mlx-lm writes it) the layers whose
    `.scales` the weights hold are quantized first. A mismatch raises ModelLoadError
    "{mismatch}: {what mlx says}" in one line. On the CPU backend half-precision weights
    are cast to float32 (`float32`); the parameters are evaluated."""
    if quant:
        nn.quantize(
            module,
            group_size=int(quant.get("group_size", 64)),
            bits=int(quant.get("bits", 4)),
            class_predicate=lambda p, m: f"{p}.scales" in weights,
        )
    try:
        module.load_weights(list(weights.items()), strict=True)
    except ValueError as exc:
        msg = " ".join(str(exc).split())
        raise ModelLoadError(f"{mismatch}: {msg}") from exc
    if mx.default_device() == mx.cpu:
        to_float32(module)
    else:
        mx.eval(module.parameters())
