"""specfleet's worker: runs validated lines on a loaded model pair.

`worker.rqworker.SpecWorker` serves a Redis queue (spec-worker); `worker.local` runs a
file in one process (spec-run). Both build lines with `worker.execute`. Importing this
package is cheap; `worker.execute`, `worker.jobs` and `worker.local` import the engine.
"""

__all__ = ["cli", "execute", "jobs", "local", "rqworker"]
