"""A Redis that refuses writes (maxmemory reached, noeviction) is an outage to a worker.

The worker holds what it was writing (a result, RQ's bookkeeping, a heartbeat) and
tries again with capped exponential back-off until Redis accepts writes, as it does
while Redis is unreachable (jobstore.connection): nothing is lost and no job's retry is
spent. One warning when Redis fills up and one when it accepts writes again, however
many commands and threads wait. Reads go on meanwhile. A stop signal ends the waiting
like an outage's (`interrupt`).

When it is full, a side thread tries a small expiring write (`probe`) until Redis takes
it, and then says so: a refused transaction under WATCH leaves through RQ, which runs
it again as a new call, so the call that was refused may never be the one that succeeds.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from redis.exceptions import OutOfMemoryError

from jobstore.connection import ReconnectingRetry

log = logging.getLogger("specfleet.redis")


class WaitWhileFull(ReconnectingRetry):
    """ReconnectingRetry that also waits out `OutOfMemoryError` (see the module docstring)."""

    def __init__(self, *args, probe: Callable[[], object] | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self._full_lock = threading.Lock()
        self._full_since: float | None = None
        #: A small write that expires by itself, on a client without this retry; raises
        #: OutOfMemoryError while Redis is full.
        self.probe = probe

    def call_with_retry(self, do, fail, is_retryable=None, with_failure_count=False):
        refused = 0  # writes refused in this call
        while True:
            try:
                result = super().call_with_retry(do, fail, is_retryable, with_failure_count)
            except OutOfMemoryError as error:
                refused += 1
                self._note_full(error)
                # Wait first: a refused transaction under WATCH raises WatchError from
                # fail(), and its caller (RQ) would otherwise try again at once.
                if self._interrupted.wait(min(self.cap_s, self.base_s * 2**refused)):
                    raise
                if with_failure_count:
                    fail(error, refused)
                else:
                    fail(error)
                continue
            if refused:
                self._note_writable()
            return result

    def _note_full(self, error: OutOfMemoryError) -> None:
        with self._full_lock:
            if self._full_since is not None:
                return
            self._full_since = time.monotonic()
        log.warning(
            "Redis at %s is full and refuses writes (%s): holding results and retrying "
            "every %.1f s at most until it accepts them; raise its maxmemory or collect "
            "finished batches",
            self.where,
            str(error).splitlines()[0][:200],
            self.cap_s,
        )
        if self.probe is not None:
            threading.Thread(target=self._watch, name="redis-full", daemon=True).start()

    def _watch(self) -> None:
        """Try the probe write with back-off until Redis takes it (or we are stopped)."""
        tries = 0
        while self._full_since is not None:
            tries += 1
            if self._interrupted.wait(min(self.cap_s, self.base_s * 2**tries)):
                return
            try:
                self.probe()
            except Exception:  # still full, or away: the next round tries again
                continue
            self._note_writable()
            return

    def _note_writable(self) -> None:
        with self._full_lock:
            since, self._full_since = self._full_since, None
        if since is not None:
            log.warning(
                "Redis at %s accepts writes again after %.1f s",
                self.where,
                time.monotonic() - since,
            )
