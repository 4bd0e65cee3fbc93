"""Block ops and functions that record, in order, which of them ran: for tests of what a loss call
runs and when (how many passes over the tiles, what comes before a kernel and what after)."""

from __future__ import annotations

from hf_infcl import TorchTiles


class RecordingTiles(TorchTiles):
    """The torch tiles, appending the name of each block entry point that runs to ``events``
    ("forward_block", "backward_block", "forward_backward_block")."""

    def __init__(self, tile_rows: int = 5, tile_keys: int = 7, events: list | None = None):
        super().__init__(tile_rows=tile_rows, tile_keys=tile_keys)
        object.__setattr__(self, "events", [] if events is None else events)  # a dataclass's __init__ ran

    def forward_block(self, *args, **kwargs):
        self.events.append("forward_block")
        return super().forward_block(*args, **kwargs)

    def backward_block(self, *args, **kwargs):
        self.events.append("backward_block")
        return super().backward_block(*args, **kwargs)

    def forward_backward_block(self, *args, **kwargs):
        self.events.append("forward_backward_block")
        return super().forward_backward_block(*args, **kwargs)


def recorded(events: list, name: str, function):
    """``function``, appending ``name`` to ``events`` at each call."""
    def call(*args, **kwargs):
        events.append(name)
        return function(*args, **kwargs)
    return call
