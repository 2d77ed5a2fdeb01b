"""specfleet's producer: the job file, the Redis key layout, submitting and collecting.

Public API: `jobfile` (JobLine, LineError, validate_file), `lines` (result and error
lines), `keys.Keys`, `submit`, `batches` (status, collect, retry, cancel). This package
never imports MLX or `engine`: a machine that only submits installs without them.
"""

__all__ = ["batches", "config", "jobfile", "keys", "lines", "store", "submit"]
