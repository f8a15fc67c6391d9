"""A chat answer as an ordered list of output blocks (reasoning, text, tool calls), built from the
chat stream's deltas: what the Responses API calls output items and the Messages API content
blocks. Each delta opens, extends or closes a block; both APIs render the same block events, and
their non-streamed answers are the same blocks, folded.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from sparkinfer_cli.server.responses import ChatResponse

REASONING, TEXT, TOOL_CALL = "reasoning", "text", "tool_call"
START, DELTA, STOP = "start", "delta", "stop"


@dataclass
class Block:
    index: int
    kind: str  # REASONING | TEXT | TOOL_CALL
    text: str = ""  # a tool call's arguments (JSON text)
    call_id: str = ""
    name: str = ""
    is_done: bool = False


@dataclass(frozen=True)
class BlockEvent:
    """A block opened (render it empty: its text grows after), grew by delta, or closed."""

    action: str  # START | DELTA | STOP
    block: Block
    delta: str = ""


class OutputBlocks:
    """A one-choice chat builder's deltas → block events. One block is open at a time; a delta of
    another kind closes it. A tool call arrives whole: it opens, carries its arguments, closes."""

    def __init__(self, chat: ChatResponse) -> None:
        self.chat = chat
        self.blocks: list[Block] = []
        self.finish_reason: str | None = None  # the chat's: stop | length | tool_calls | ...

    def push_event(self, index: int, event: Any) -> list[BlockEvent]:
        """The block events of an engine event; the last one closes the open block."""
        out = []
        for chunk in self.chat.push(index, event):
            for choice in chunk["choices"]:
                out += self.push(choice["delta"])
                self.finish_reason = choice["finish_reason"] or self.finish_reason
        return out + (self.close() if self.finish_reason is not None else [])

    def push(self, delta: dict[str, Any]) -> list[BlockEvent]:
        events = []
        if delta.get("reasoning_content"):
            events += self._extend(REASONING, delta["reasoning_content"])
        if delta.get("content"):
            events += self._extend(TEXT, delta["content"])
        for call in delta.get("tool_calls", ()):
            events += self._add_call(call["id"], call["function"]["name"],
                                     call["function"]["arguments"])
        return events

    def close(self) -> list[BlockEvent]:
        """Close the open block (the generation ended)."""
        open_block = self._open_block()
        if open_block is None:
            return []
        open_block.is_done = True
        return [BlockEvent(STOP, open_block)]

    def _open_block(self) -> Block | None:
        last = self.blocks[-1] if self.blocks else None
        return last if last is not None and not last.is_done else None

    def _extend(self, kind: str, text: str) -> list[BlockEvent]:
        open_block = self._open_block()
        events = []
        if open_block is None or open_block.kind != kind:
            events += self.close()
            open_block = Block(len(self.blocks), kind)
            self.blocks.append(open_block)
            events.append(BlockEvent(START, open_block))
        open_block.text += text
        return [*events, BlockEvent(DELTA, open_block, text)]

    def _add_call(self, call_id: str, name: str, arguments: str) -> list[BlockEvent]:
        events = self.close()
        block = Block(len(self.blocks), TOOL_CALL, arguments, call_id, name)
        self.blocks.append(block)
        return [*events, BlockEvent(START, block), BlockEvent(DELTA, block, arguments),
                *self.close()]


def arguments_object(arguments: str) -> dict[str, Any]:
    """A call's arguments as an object (what Anthropic's tool_use input must be). Arguments that
    are not a JSON object (a call cut by the token limit, or malformed) become {}: a client would
    fail on them anyway, and Anthropic's SDK cannot even stream them."""
    try:
        parsed = json.loads(arguments)
    except ValueError:
        return {}
    return parsed if isinstance(parsed, dict) else {}
