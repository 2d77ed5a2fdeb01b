"""specfleet's producer: submitting a job file, status, collect, retry and cancel.

Public API: `submit`, `batches` (status, collect, retry, cancel). The job file, the key
layout, result lines and the store it uses live in `jobstore`. This package never
imports MLX or `engine`: a machine that only submits installs without them.
"""

__all__ = ["batches", "submit"]
