"""chat.Conversation: the history as prompts that fit the context, oldest turns dropped first."""

from __future__ import annotations

import pytest

from sparkinfer_cli.app.chat import Conversation
from sparkinfer_cli.gguf.reader import GGUFFile
from sparkinfer_cli.tokenizer.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tokenizer(fixtures_dir) -> Tokenizer:
    return Tokenizer.from_gguf(GGUFFile(fixtures_dir / "tiny/qwen3/qwen3-F32.gguf"))


def test_each_prompt_extends_the_last_turn_by_turn(tokenizer):
    chat = Conversation(tokenizer, "be brief", True, limit=4096)
    first = chat.ask("hello", 16)
    chat.answered("hi there")
    second = chat.ask("and now?", 16)
    assert len(second) > len(first) + 4
    assert tokenizer.decode(second).count("hello") == 1 and "be brief" in tokenizer.decode(second)


def test_the_oldest_turns_go_when_the_context_is_full(tokenizer):
    one_turn = len(Conversation(tokenizer, None, True, 4096).ask("question number 0", 8))
    chat = Conversation(tokenizer, None, True, limit=3 * one_turn)
    for i in range(6):
        ids = chat.ask(f"question number {i}", 8)
        assert len(ids) + 8 <= 3 * one_turn
        chat.answered(f"answer {i}")
    text = tokenizer.decode(ids)
    assert "question number 5" in text and "question number 0" not in text


def test_a_message_too_long_for_the_context_is_refused_and_forgotten(tokenizer):
    chat = Conversation(tokenizer, None, True, limit=64)
    with pytest.raises(ValueError, match="do not fit in --ctx 64"):
        chat.ask("word " * 200, 8)
    assert chat.turns == []
    assert chat.ask("short", 8)
