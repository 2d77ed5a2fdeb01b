"""specfleet's shared core: what the submit side and the workers share.

Settings (`config`), the Redis connection (`connection`), the job file and its
validation (`jobfile`), the Redis key layout with RQ's keys and the audit fields
(`keys`), result and error lines (`lines`), the result store (`store`), the click
options and error style every command shares (`options`), and the package's
exceptions (`errors`). The contract's limits, defaults and statistics are the
`contract` package's, which this one imports.

Nothing here imports MLX or `engine`, so a machine that only submits installs without
them; `producer` and `worker` both import this package and never each other.
"""

__all__ = [
    "config",
    "connection",
    "errors",
    "jobfile",
    "keys",
    "lines",
    "options",
    "store",
]
