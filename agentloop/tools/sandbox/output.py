"""``CappedOutput``: a run's stdout and stderr, kept up to a shared byte budget."""

from __future__ import annotations

import asyncio

CHUNK_BYTES = 65536


class CappedOutput:
    """Keeps the first ``limit`` bytes of stdout and stderr together; later bytes are read (so the
    program never blocks on a full pipe) and counted in ``dropped``, not kept."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.kept = {"stdout": bytearray(), "stderr": bytearray()}
        self.dropped = 0

    async def drain(self, stream: asyncio.StreamReader, name: str) -> None:
        """Read ``stream`` to its end into the ``name`` part."""
        while chunk := await stream.read(CHUNK_BYTES):
            room = max(self.limit - sum(len(part) for part in self.kept.values()), 0)
            self.kept[name] += chunk[:room]
            self.dropped += max(len(chunk) - room, 0)

    def text(self, name: str) -> str:
        """The kept bytes as text (a character cut at the limit becomes U+FFFD)."""
        return self.kept[name].decode("utf-8", errors="replace")
