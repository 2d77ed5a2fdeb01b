"""specfleet's reporting: how a batch or a run looks to a person.

`progress` draws the live status of `spec-status --watch`, `spec-submit --wait` and
`spec-run` from status objects (FORMATS.md shape); `report` writes the HTML report of
`spec-report`. No MLX here; Redis only through `jobstore`.
"""

__all__ = ["progress", "report"]
