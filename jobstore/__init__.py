"""specfleet's shared core: what the submit side and the workers share.

Settings (`config`), the contract's constants (`limits`), the Redis connection
(`connection`), the job file and its validation (`jobfile`), the Redis key layout with
RQ's keys and the audit fields (`keys`), result and error lines (`lines`), the result
store (`store`), rates from raw counters (`stats`), the click options and error style
every command shares (`options`), and the package's exceptions (`errors`).

Nothing here imports MLX or `engine`, so a machine that only submits installs without
them; `producer` and `worker` both import this package and never each other. This
file and `stats` import no Redis either, so the engine may use `jobstore.stats`.
"""

__all__ = [
    "config",
    "connection",
    "errors",
    "jobfile",
    "keys",
    "limits",
    "lines",
    "options",
    "stats",
    "store",
]
