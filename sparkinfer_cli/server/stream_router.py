"""StreamRouter: generated text → content, reasoning and tool calls, one fragment at a time.

Pure text in, pure text out. Markers can be split across fragments anywhere, so the router holds
back any tail that could still become a marker; any split of the same text routes identically.

  <think> … </think>        → reasoning (only before any content; Qwen3.5+ opens it in the prompt)
  <tool_call> … </tool_call> → tool calls (only when the request has tools)
  everything else            → content
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from sparkinfer_cli.server.tool_calls import (
    TOOL_CALL_CLOSE,
    TOOL_CALL_OPEN,
    ToolCall,
    parse_tool_calls,
)

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"

CONTENT, REASONING, TOOL_CALL = "content", "reasoning", "tool_call"


@dataclass
class RoutedText:
    content: str = ""
    reasoning: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.content or self.reasoning or self.tool_calls)

    def extend(self, other: RoutedText) -> None:
        self.content += other.content
        self.reasoning += other.reasoning
        self.tool_calls += other.tool_calls


def prompt_opens_thinking(prompt: str) -> bool:
    """Qwen3.5/3.6 generation prompts end in '<think>\\n': the output starts inside the thought."""
    return prompt.rstrip().endswith(THINK_OPEN)


class StreamRouter:
    def __init__(self, *, reasoning: bool, thinking_open: bool = False,
                 tools: Sequence[Mapping[str, Any]] | None = None):
        self._may_think = reasoning
        self._tools = tools
        self._state = REASONING if reasoning and thinking_open else CONTENT
        self._buffer = ""
        self._strip_leading = self._state == REASONING  # drop whitespace right after a marker
        self._seen_content = False

    @property
    def in_reasoning(self) -> bool:
        return self._state == REASONING

    def push(self, text: str) -> RoutedText:
        out = RoutedText()
        self._buffer += text
        while self._consume_marker(out):
            pass
        return out

    def finish(self) -> RoutedText:
        """Flush what was held back: the generation ended, so no marker can complete any more."""
        out, rest, self._buffer = RoutedText(), self._buffer, ""
        if self._state == TOOL_CALL:
            self._close_tool_call(out, rest, closed=False)
        else:
            self._emit(out, rest.rstrip() if self._state == REASONING else rest)
        return out

    def _markers(self) -> tuple[str, ...]:
        if self._state == REASONING:
            return (THINK_CLOSE,)
        if self._state == TOOL_CALL:
            return (TOOL_CALL_CLOSE,)
        think = (THINK_OPEN,) if self._may_think and not self._seen_content else ()
        return think + ((TOOL_CALL_OPEN,) if self._tools else ())

    def _consume_marker(self, out: RoutedText) -> bool:
        """Route the buffer up to the first marker and act on it; False when none is complete."""
        markers = self._markers()
        found = [(i, m) for m in markers if (i := self._buffer.find(m)) >= 0]
        if not found:
            self._emit_safe_prefix(out, markers)
            return False
        index, marker = min(found)
        before, self._buffer = self._buffer[:index], self._buffer[index + len(marker):]
        self._on_marker(out, marker, before)
        return True

    def _emit_safe_prefix(self, out: RoutedText, markers: tuple[str, ...]) -> None:
        if self._state == TOOL_CALL:
            return  # a call is emitted whole, at its closing tag
        keep = _partial_marker_length(self._buffer, markers)
        if self._state == REASONING or not self._seen_content:
            # whitespace may still turn out to precede </think> or <think>: hold it too
            keep = len(self._buffer) - len(self._buffer[:len(self._buffer) - keep].rstrip())
        cut = len(self._buffer) - keep
        self._emit(out, self._buffer[:cut])
        self._buffer = self._buffer[cut:]

    def _on_marker(self, out: RoutedText, marker: str, before: str) -> None:
        if marker == THINK_OPEN and before.strip():
            self._emit(out, before + marker)  # text came first: this <think> is just content
        elif marker == THINK_OPEN:
            self._enter(REASONING)
        elif marker == THINK_CLOSE:
            self._emit(out, before.rstrip())
            self._seen_content = True  # one thought per turn
            self._enter(CONTENT)
        elif marker == TOOL_CALL_OPEN:
            self._emit(out, before)
            self._enter(TOOL_CALL)
        else:
            self._close_tool_call(out, before, closed=True)
            self._enter(CONTENT)

    def _close_tool_call(self, out: RoutedText, body: str, *, closed: bool) -> None:
        calls = parse_tool_calls(body, self._tools)
        self._seen_content = True
        if calls:
            out.tool_calls += calls
            return
        self._state = CONTENT  # unparseable: hand the raw text to the client as content
        self._emit(out, TOOL_CALL_OPEN + body + (TOOL_CALL_CLOSE if closed else ""))

    def _enter(self, state: str) -> None:
        self._state, self._strip_leading = state, True

    def _emit(self, out: RoutedText, text: str) -> None:
        if self._strip_leading:
            text = text.lstrip()
            self._strip_leading = not text
        if not text:
            return
        if self._state == REASONING:
            out.reasoning += text
        else:
            out.content += text
            self._seen_content = self._seen_content or bool(text.strip())


def _partial_marker_length(text: str, markers: tuple[str, ...]) -> int:
    """Length of the longest tail of text that is a proper prefix of one of the markers."""
    best = 0
    for marker in markers:
        for length in range(min(len(marker) - 1, len(text)), best, -1):
            if text.endswith(marker[:length]):
                best = length
                break
    return best
