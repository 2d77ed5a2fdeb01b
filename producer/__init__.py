"""specfleet's producer: submitting a job file, status, collect, retry and cancel.

Public API: `submit`, and one module per command that follows a batch: `status`,
`collect`, `retry`, `cancel`, with their exceptions in `errors` (the checked batch
record they all read is `meta`, collect's files `outputs`). The job file, the key layout,
result lines and the store it uses live in `jobstore`. This package never
imports MLX or `engine`: a machine that only submits installs without them.
"""

__all__ = ["cancel", "collect", "errors", "retry", "status", "submit"]
