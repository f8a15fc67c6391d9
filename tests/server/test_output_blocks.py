"""OutputBlocks: chat deltas → ordered blocks, one open at a time, a tool call opened and closed
at once; arguments_object: what a tool_use input can be."""

from __future__ import annotations

from sparkinfer_cli.server.output_blocks import (
    DELTA,
    REASONING,
    START,
    STOP,
    TEXT,
    TOOL_CALL,
    OutputBlocks,
    arguments_object,
)


def call(name: str, arguments: str) -> dict:
    return {"id": f"call_{name}", "type": "function",
            "function": {"name": name, "arguments": arguments}}


def test_a_delta_of_another_kind_closes_the_open_block() -> None:
    blocks = OutputBlocks(chat=None)
    events = [*blocks.push({"reasoning_content": "hm"}), *blocks.push({"reasoning_content": "m"}),
              *blocks.push({"content": "Hi", "tool_calls": [call("a", "{}"), call("b", "{")]}),
              *blocks.close()]
    assert [(e.action, e.block.index, e.delta) for e in events] == [
        (START, 0, ""), (DELTA, 0, "hm"), (DELTA, 0, "m"), (STOP, 0, ""),
        (START, 1, ""), (DELTA, 1, "Hi"), (STOP, 1, ""),
        (START, 2, ""), (DELTA, 2, "{}"), (STOP, 2, ""),
        (START, 3, ""), (DELTA, 3, "{"), (STOP, 3, "")]
    assert [(b.kind, b.text, b.name) for b in blocks.blocks] == [
        (REASONING, "hmm", ""), (TEXT, "Hi", ""), (TOOL_CALL, "{}", "a"), (TOOL_CALL, "{", "b")]
    assert blocks.close() == []


def test_arguments_that_are_not_an_object_become_an_empty_input() -> None:
    assert arguments_object('{"city": "Paris"}') == {"city": "Paris"}
    assert arguments_object('{"city": "Par') == {}
    assert arguments_object("[1]") == {}
