"""Constants of the data contract (FORMATS.md), stated once. Pure Python: the engine,
the job-file validation and the CLIs all import them from here."""

from __future__ import annotations

#: Batch statuses of `spec-status --json`; a batch in a terminal one changes no more.
BATCH_STATUSES = ("queued", "in_progress", "completed", "failed", "cancelled")
TERMINAL_STATUSES = ("completed", "failed", "cancelled")
