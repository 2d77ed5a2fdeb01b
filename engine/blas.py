"""Load a fast system BLAS into the process before MLX is imported (Linux CPU only).

The `mlx[cpu]` wheel links a reference BLAS that is ~30x slower than OpenBLAS for
fp32 matmul. Loading a system OpenBLAS with RTLD_GLOBAL first makes MLX's CPU
backend resolve its BLAS symbols there. Set SPECFLEET_NO_OPENBLAS=1 to turn it off.
"""

from __future__ import annotations

import ctypes
import os
import sys

OPENBLAS_CANDIDATES = (
    "/usr/lib/x86_64-linux-gnu/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/libopenblas.so.0",
    "/usr/lib64/libopenblas.so.0",
    "/usr/lib/libopenblas.so.0",
)

_loaded: str | None = None
_reason = "not attempted"


def preload_openblas() -> str | None:
    """Load the first system OpenBLAS found, once. Returns its path or None.

    Does nothing off Linux, when SPECFLEET_NO_OPENBLAS is set, or after MLX has
    already been imported (too late to change where its symbols resolve).
    """
    global _loaded, _reason
    if _loaded or _reason != "not attempted":
        return _loaded
    if not sys.platform.startswith("linux"):
        _reason = "not Linux (MLX uses Accelerate/Metal or its own kernels)"
        return None
    if os.environ.get("SPECFLEET_NO_OPENBLAS", "") not in ("", "0"):
        _reason = "disabled by SPECFLEET_NO_OPENBLAS"
        return None
    if "mlx.core" in sys.modules:
        _reason = "mlx was imported before the engine; OpenBLAS not preloaded"
        return None
    extra = os.environ.get("SPECFLEET_OPENBLAS_PATH")
    for path in ((extra,) if extra else ()) + OPENBLAS_CANDIDATES:
        if path and os.path.exists(path):
            try:
                ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
            except OSError as exc:
                _reason = f"could not load {path}: {exc}"
                continue
            _loaded = path
            _reason = "loaded"
            return path
    _reason = "no system OpenBLAS found (Debian: apt-get install libopenblas0)"
    return None


def blas_info() -> str:
    """One line saying which BLAS MLX's CPU backend uses in this process."""
    if _loaded:
        return f"OpenBLAS ({_loaded})"
    if sys.platform == "darwin":
        return "Accelerate (macOS)"
    return f"reference BLAS bundled with mlx ({_reason})"
