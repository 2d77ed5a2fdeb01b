"""specfleet's data contract, stated once: what a request may ask (`limits`), what it
gets when it does not say (`defaults`), and the speculative-decoding counters, their
hash-field form and their rates (`stats`).

Standard library only, so every package may import it: the engine (which imports
nothing else of this project), the shared core `jobstore`, and the commands.
The shapes themselves are described in docs/formats.md.
"""

from contract import defaults, limits, stats

__all__ = ["defaults", "limits", "stats"]
