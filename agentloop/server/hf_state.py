"""What the ``hf`` engine keeps track of: whether it can serve, and one record per request in its
continuous-batching manager (who asked, when it ends, the awaitable its caller waits on)."""

from __future__ import annotations

import asyncio
import enum
from dataclasses import dataclass, field

from agentloop.protocol import FinishReason, TokenOutput
from agentloop.server.sampling import finish_reason_of
from agentloop.server.hf_batching import GenerationOutput, RequestStatus


class EngineState(enum.Enum):
    """``serving``: a batching manager runs. ``asleep``: ``sleep`` released it, and ``wake_up`` builds a fresh one.
    ``broken``: building one failed (on a wake-up, after a weight update or a dead generation thread); only a
    replacement of the server serves again."""

    SERVING = "serving"
    ASLEEP = "asleep"
    BROKEN = "broken"


@dataclass
class Request:
    """One generation in the batching manager, from its submission until its caller has the answer.

    Made on the engine's event loop; the manager's result callback (``take``) is delivered there too.
    """

    session: str  # the caller's request id: ``abort`` ends every generation of it
    stop_ids: list[int]
    max_new_tokens: int
    answer: asyncio.Future[TokenOutput] = field(default_factory=lambda: asyncio.get_running_loop().create_future())
    cached_tokens: int = 0  # prompt tokens found in the prefix cache (written by the manager's thread)

    def take(self, output: GenerationOutput) -> None:
        """The manager's result: the generated tokens and their logprobs, or the error it met."""
        if output.status == RequestStatus.FAILED:
            self.fail(RuntimeError(f"generation failed in the engine: {output.error}"))
        else:
            self.finish(list(output.generated_tokens), [float(x) for x in output.logprobs], "abort")

    def finish(self, tokens: list[int], log_probs: list[float], otherwise: FinishReason) -> None:
        """Answer with these tokens: ``stop``/``length`` when they end the request (its stop token, or its last
        token, was sampled), else ``otherwise`` (it was cut short). A request already answered keeps its answer."""
        if not self.answer.done():
            reason = finish_reason_of(tokens, self.stop_ids, self.max_new_tokens, otherwise)
            self.answer.set_result(TokenOutput(tokens, log_probs, reason, self.cached_tokens))

    def fail(self, error: Exception) -> None:
        if not self.answer.done():
            self.answer.set_exception(error)
