"""The exceptions of jobstore: one base, a subclass per thing a user can get wrong."""

from __future__ import annotations


class JobStoreError(Exception):
    """Base of every error jobstore raises; the message is safe to print."""


class RedisUnavailable(JobStoreError):
    """Redis cannot be reached or refused us; the message is safe to print."""


class BatchIdError(JobStoreError, ValueError):
    """A batch id that cannot be used in Redis keys and RQ job ids."""
