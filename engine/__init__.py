"""specfleet's engine: lossless speculative decoding on MLX.

Public API: load_pair, ModelPair, GenerationRequest, GenerationResult, SpecStats,
generate, generate_many (batched), generate_choices and choice_requests (n choices), stream (StreamItem pieces, the last with the result), count_prompt_tokens, prefix_line (the
prefix cache in words), and the errors below EngineError.

MLX is imported on first use of anything that needs it (after a fast system BLAS
is loaded on Linux), so `engine.types` stays cheap to import.
"""

from __future__ import annotations

from .blas import preload_openblas

preload_openblas()  # must run before anything imports mlx

from .types import (  # noqa: E402
    CacheError,
    ContextLengthError,
    EngineError,
    GenerationRequest,
    GenerationResult,
    InvalidRequestError,
    ModelLoadError,
    RequestExpired,
    SpecStats,
    StreamItem,
    TokenizerMismatchError,
)

__all__ = [
    "CacheError",
    "ContextLengthError",
    "EngineError",
    "GenerationRequest",
    "GenerationResult",
    "InvalidRequestError",
    "ModelLoadError",
    "ModelPair",
    "RequestExpired",
    "SpecStats",
    "StreamItem",
    "TokenizerMismatchError",
    "choice_requests",
    "count_prompt_tokens",
    "generate",
    "generate_choices",
    "generate_many",
    "load_pair",
    "prefix_line",
    "stream",
]

_LAZY = {
    "load_pair": "loading",
    "ModelPair": "loading",
    "generate": "text",
    "generate_many": "text",
    "generate_choices": "text",
    "choice_requests": "text",
    "stream": "text",
    "count_prompt_tokens": "text",
    "prefix_line": "prefix",
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        module = importlib.import_module(f".{_LAZY[name]}", __name__)
        return getattr(module, name)
    raise AttributeError(f"module 'engine' has no attribute {name!r}")
