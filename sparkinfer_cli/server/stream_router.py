"""StreamRouter: generated text → content, reasoning and tool calls, one fragment at a time.

Pure text in, pure text out. Markers can be split across fragments anywhere, so the router holds
back any tail that could still become a marker; any split of the same text routes identically.

  <think> … </think>        → reasoning (only before any content; Qwen3.5+ opens it in the prompt)
  <tool_call> … </tool_call> → tool calls (only when the request has tools)
  an answer that is one call without the tags (bare JSON or a ```json fence), naming a tool
                             → that tool call (held back until it completes, or cannot)
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
    may_be_untagged_tool_call,
    parse_tool_calls,
    parse_untagged_tool_call,
)

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"

CONTENT, REASONING, TOOL_CALL = "content", "reasoning", "tool_call"
UNTAGGED_CALL = "untagged_call"  # the answer so far may be one tool call written without tags


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
        self._answer_started = False  # content or a tool call came (a thought does not count)

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
        out = RoutedText()
        if self._state == UNTAGGED_CALL:
            calls = parse_untagged_tool_call(self._buffer, self._tools or ())
            if calls:
                out.tool_calls, self._buffer = calls, ""
                return out
            self._route_as_text()
            while self._consume_marker(out):
                pass
        rest, self._buffer = self._buffer, ""
        if self._state == TOOL_CALL:
            self._close_tool_call(out, rest)
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
        if self._may_be_untagged_call():
            self._state = UNTAGGED_CALL  # held whole: markers inside it may be JSON string text
            return False
        if self._state == UNTAGGED_CALL:
            self._route_as_text()
        markers = self._markers()
        found = [(i, m) for m in markers if (i := self._buffer.find(m)) >= 0]
        if not found:
            self._emit_safe_prefix(out, markers)
            return False
        index, marker = min(found)
        before, self._buffer = self._buffer[:index], self._buffer[index + len(marker):]
        self._on_marker(out, marker, before)
        return True

    def _may_be_untagged_call(self) -> bool:
        could_start = self._state == CONTENT and bool(self._tools) and \
            not self._answer_started and bool(self._buffer.strip())
        return (could_start or self._state == UNTAGGED_CALL) and \
            may_be_untagged_tool_call(self._buffer, self._tools or ())

    def _route_as_text(self) -> None:
        """The held answer is not one untagged call after all: it is content (and markers)."""
        self._state, self._answer_started = CONTENT, True

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
            self._answer_started = True
            self._enter(TOOL_CALL)
        else:
            self._close_tool_call(out, before)
            self._enter(CONTENT)

    def _close_tool_call(self, out: RoutedText, body: str) -> None:
        """A call closed by its tag or cut by the end of the generation (parse_tool_calls reads
        what a cut call holds). The tags never reach the content: tool_choice 'required' or a
        named function puts them in the prompt, and a call the model left empty is no call."""
        calls = parse_tool_calls(body, self._tools)
        self._seen_content = True
        if calls:
            out.tool_calls += calls
            return
        self._state = CONTENT  # it names no function: the model wrote text, hand it over as such
        self._emit(out, body.strip())

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
            self._answer_started = self._answer_started or bool(text.strip())


def _partial_marker_length(text: str, markers: tuple[str, ...]) -> int:
    """Length of the longest tail of text that is a proper prefix of one of the markers."""
    best = 0
    for marker in markers:
        for length in range(min(len(marker) - 1, len(text)), best, -1):
            if text.endswith(marker[:length]):
                best = length
                break
    return best
