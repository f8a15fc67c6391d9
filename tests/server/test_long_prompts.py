"""Long prompts (issue 31, reliability): a prompt that certainly overflows the context is refused
before it is tokenized, and tokenizing a long one does not stall the server's other requests."""

from __future__ import annotations

import threading

import httpx
from server_fakes import CharTokenizer
from test_admission import assert_openai_error

REPEATED = [{"role": "user", "content": "hello there"}] * 2000


class RecordingTokenizer(CharTokenizer):
    """CharTokenizer that records the length of every text it encodes."""

    def __init__(self) -> None:
        self.encoded_lengths: list[int] = []

    def encode(self, text: str, parse_special: bool = True) -> list[int]:
        self.encoded_lengths.append(len(text))
        return super().encode(text, parse_special)


class GatedTokenizer(CharTokenizer):
    """CharTokenizer whose encode of a text containing "[gate]" waits until the gate opens."""

    def __init__(self) -> None:
        self.entered, self.gate = threading.Event(), threading.Event()

    def encode(self, text: str, parse_special: bool = True) -> list[int]:
        if "[gate]" in text:
            self.entered.set()
            self.gate.wait(60)
        return super().encode(text, parse_special)


def test_a_prompt_that_must_overflow_the_context_is_refused_untokenized(make_server) -> None:
    srv = make_server(ctx=1024)
    srv.state.tokenizer = tokenizer = RecordingTokenizer()
    chat = httpx.post(f"{srv.base_url}/chat/completions", json={"messages": REPEATED}, timeout=30)
    error = assert_openai_error(chat, 400, "context_length_exceeded")
    assert "1024" in error["message"]
    completion = httpx.post(f"{srv.base_url}/completions", json={"prompt": "x" * 5000},
                            timeout=30)
    assert_openai_error(completion, 400, "context_length_exceeded")
    assert tokenizer.encoded_lengths == []
    # a prompt that might fit is still tokenized and measured exactly
    assert_openai_error(httpx.post(f"{srv.base_url}/completions", json={"prompt": "x" * 1500},
                                   timeout=30), 400, "context_length_exceeded")
    assert tokenizer.encoded_lengths == [1500]


def test_other_requests_are_answered_while_a_prompt_is_tokenized(make_server) -> None:
    srv = make_server()
    srv.state.tokenizer = tokenizer = GatedTokenizer()
    outcome: dict[str, httpx.Response] = {}
    thread = threading.Thread(target=lambda: outcome.update(slow=httpx.post(
        f"{srv.base_url}/completions", json={"prompt": "[gate]", "max_tokens": 2}, timeout=90)))
    thread.start()
    try:
        assert tokenizer.entered.wait(30)
        # the event loop is free: another request is answered while the first still tokenizes
        assert httpx.get(f"{srv.url}/health", timeout=30).status_code == 200
        assert httpx.post(f"{srv.base_url}/completions", json={"prompt": "hi", "max_tokens": 2},
                          timeout=30).status_code == 200
    finally:
        tokenizer.gate.set()
        thread.join(90)
    assert outcome["slow"].status_code == 200


def test_the_byte_bound_never_exceeds_the_real_token_count() -> None:
    from test_e2e_real import MODEL

    from sparkinfer_cli.gguf.reader import GGUFFile
    from sparkinfer_cli.tokenizer.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_gguf(GGUFFile(MODEL))
    texts = ["", "a" * 300, " " * 300, "<|im_start|>user\nhello<|im_end|>\n" * 40,
             "ünïcödé ✓ 漢字 🙂 " * 30, "0123456789" * 50, "\n\n\t  x" * 60]
    for text in texts:
        assert -(-len(text.encode()) // tokenizer.max_token_bytes) <= len(tokenizer.encode(text))
