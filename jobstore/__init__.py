"""specfleet's shared core: what the submit side and the workers share.

Settings (`config`), the Redis connection (`connection`), the job file and its
validation (`jobfile`), the Redis key layout (`keys`), result and error lines
(`lines`) and the result store (`store`). This package never imports MLX or `engine`,
so a machine that only submits installs without them; `producer` and `worker` both
import it and never each other.
"""

__all__ = ["config", "connection", "errors", "jobfile", "keys", "limits", "lines", "stats", "store"]
