"""Every wait on a remote thing is bounded, and its error says what was awaited."""

from __future__ import annotations

from typing import Any

import ray


def wait_for(refs: list[Any], timeout: float, what: str) -> list[Any]:
    """``ray.get`` with a timeout whose error names what was awaited; late work is cancelled."""
    try:
        return ray.get(refs, timeout=timeout)
    except ray.exceptions.GetTimeoutError:
        for ref in refs:
            ray.cancel(ref)
        raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}") from None
