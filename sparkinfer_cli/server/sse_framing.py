"""How a generation's chunks go on the wire as server-sent events, per API dialect.

The chat and completion routes send bare `data:` lines, a usage chunk and `[DONE]` (OpenAI's chat
stream); the Responses and Anthropic Messages streams name each event (`event: <type>`), end with
their own closing events and report a mid-stream error as an event of their own shape.
"""

from __future__ import annotations

from typing import Any, Protocol

from sparkinfer_cli.server.protocol import ApiError
from sparkinfer_cli.server.responses import dumps


class SseFraming(Protocol):
    def frame(self, chunk: dict[str, Any]) -> str: ...

    def end(self, builder: Any) -> str: ...

    def failure(self, builder: Any, exc: ApiError) -> str: ...


class OpenAIChatFraming:
    """Chat and legacy completions: data-only events, then the usage chunk and [DONE]."""

    def frame(self, chunk: dict[str, Any]) -> str:
        return f"data: {dumps(chunk)}\n\n"

    def end(self, builder: Any) -> str:
        usage = builder.usage_chunk()
        return (self.frame(usage) if usage is not None else "") + "data: [DONE]\n\n"

    def failure(self, builder: Any, exc: ApiError) -> str:
        return self.frame(exc.body())


class NamedEventFraming:
    """Events named by their chunk's "type" (Responses and Anthropic); the builder supplies the
    closing events (closing_events()) and the error events (failure_events(exc))."""

    def frame(self, chunk: dict[str, Any]) -> str:
        return f"event: {chunk['type']}\ndata: {dumps(chunk)}\n\n"

    def end(self, builder: Any) -> str:
        return "".join(self.frame(c) for c in builder.closing_events())

    def failure(self, builder: Any, exc: ApiError) -> str:
        return "".join(self.frame(c) for c in builder.failure_events(exc))


OPENAI_CHAT_SSE = OpenAIChatFraming()
NAMED_EVENT_SSE = NamedEventFraming()
