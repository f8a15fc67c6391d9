"""Constrained output: a grammar the answer must follow, enforced token by token with llguidance
(the grammar engine vLLM, SGLang and llama.cpp use: it compiles JSON schemas and Lark grammars
itself and computes the mask of allowed tokens from the vocabulary's bytes, so no grammar code
lives here). response_format's JSON schema is one such grammar; the tool calls of a chat request
(server/tool_call_grammar.py) are a Lark one.

Thinking-aware: an answer that reasons first (its prompt opened a thought, or its first token
opens one) writes free text until its `</think>` token, and the grammar applies from the token
after it.

Off the critical path: once a token is consumed, the mask of the next one is computed on a worker
thread while the model runs the pass that produces that token's logits (the engine thread waits on
the device or the CPU kernels meanwhile), so sampling finds it ready.
"""

from __future__ import annotations

import functools
import importlib
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import numpy as np

from sparkinfer_cli.model.batch import mask_words

if TYPE_CHECKING:
    from sparkinfer_cli.tokenizer.tokenizer import Tokenizer

# NOTE: compact JSON (", " and ": ", as Qwen's templates write it): free whitespace lets a weak
# model pad forever
COMPACT_JSON = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def _llguidance() -> Any:
    """The module, imported on first use: a server that never constrains an answer runs
    without it (the GPU machines' minimal environments)."""
    return importlib.import_module("llguidance")


class _VocabAdapter:
    """What llguidance.TokenizerWrapper reads of a tokenizer: each token's bytes, the special
    ids, and encoding (without BOS)."""

    def __init__(self, tokenizer: Tokenizer):
        self._tokenizer = tokenizer
        self.eos_token_id = tokenizer.eos_id
        self.bos_token_id = tokenizer.bos_id
        self.tokens = [tokenizer.token_bytes(i) for i in range(tokenizer.vocab_size)]
        self.special_token_ids = [i for i in range(tokenizer.vocab_size)
                                  if tokenizer.is_special(i)]

    def __call__(self, text: str | bytes) -> list[int]:
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        ids = self._tokenizer.encode(text, parse_special=False)
        return ids[1:] if self._tokenizer.add_bos else ids


@functools.lru_cache(maxsize=4)
def grammar_tokenizer(tokenizer: Tokenizer, n_vocab: int) -> Any:
    """llguidance's LLTokenizer for a vocabulary (built once: it reads every token's bytes)."""
    llg = _llguidance()
    wrapper = llg.TokenizerWrapper(_VocabAdapter(tokenizer))
    eos = sorted(tokenizer.eog_ids) or None
    return llg.LLTokenizer(wrapper, n_vocab=n_vocab, eos_token=eos)


def json_schema_grammar(schema_json: str) -> str:
    """The llguidance grammar of a JSON schema (compact JSON); ValueError when it is no JSON
    object (check_grammar finds the rest)."""
    return _llguidance().LLMatcher.grammar_from_json_schema(schema_json, overrides=COMPACT_JSON)


def lark_grammar(lark: str) -> str:
    """The llguidance grammar of a Lark grammar in llguidance's dialect (docs/syntax.md there:
    %json {schema}, lazy lexemes)."""
    return _llguidance().LLMatcher.grammar_from_lark(lark)


@functools.cache
def _mask_workers() -> ThreadPoolExecutor:
    """The threads that compute next-token masks ahead (llguidance computes one in well under
    a pass's time, so two serve a full batch)."""
    return ThreadPoolExecutor(max_workers=2, thread_name_prefix="grammar-mask")


@functools.lru_cache(maxsize=64)
def _compiled(grammar: str, tokenizer: Tokenizer, n_vocab: int) -> Any:
    """A matcher at the start of the grammar (in error state if it does not compile), compiled
    once: compiling a request's tools takes milliseconds, and an agent resends the same tools
    every turn; each request copies it."""
    return _llguidance().LLMatcher(grammar_tokenizer(tokenizer, n_vocab), grammar, log_level=0)


def check_grammar(grammar: str, tokenizer: Tokenizer, n_vocab: int) -> str:
    """The grammar, once llguidance has compiled it for this vocabulary; ValueError naming the
    problem (the first line of llguidance's message: the rest quotes the grammar) when it
    cannot."""
    matcher = _compiled(grammar, tokenizer, n_vocab)
    if matcher.is_error():
        raise ValueError(matcher.get_error().splitlines()[0])
    return grammar


class GrammarConstraint:
    """One request's matcher: the tokens it may sample next, and the tokens it sampled."""

    def __init__(self, grammar: str, tokenizer: Tokenizer, n_vocab: int,
                 reasoning_tokens: tuple[int, int] | None = None, reasoning_open: bool = False):
        """grammar: from json_schema_grammar or lark_grammar. reasoning_tokens: (<think>,
        </think>) where the answer may reason first: its first token may open a thought (Qwen3
        templates), or the prompt has opened one already (reasoning_open: Qwen3.5 / 3.6); the
        grammar applies from the token after the close."""
        self.n_vocab = n_vocab
        self._matcher = _compiled(grammar, tokenizer, n_vocab).deep_copy()
        self._think = reasoning_tokens
        self._thinking = reasoning_tokens is not None and reasoning_open
        self._first = True
        self._next_bits: Future | None = None  # the next token's bitmask, being computed

    @property
    def is_computing_ahead(self) -> bool:
        """Whether the next token's mask is being (or has been) computed on a worker thread."""
        return self._next_bits is not None

    def allowed_words(self) -> np.ndarray | None:
        """(mask_words(n_vocab),) uint32: a bit per token the grammar allows next (bit j of word
        w: token 32w + j; none once it cannot be continued); None while the answer is free
        (reasoning)."""
        if self._thinking:
            return None
        ahead, self._next_bits = self._next_bits, None
        raw = ahead.result() if ahead is not None else self._matcher.compute_bitmask()
        words = np.frombuffer(raw, dtype=np.uint32)[:mask_words(self.n_vocab)].copy()
        if self._first and self._think is not None:  # the answer may open a thought first
            think = self._think[0]
            words[think >> 5] |= np.uint32(1 << (think & 31))
        return words

    def allowed(self) -> np.ndarray | None:
        """allowed_words as (n_vocab,) bool."""
        words = self.allowed_words()
        if words is None:
            return None
        return np.unpackbits(words.view(np.uint8), bitorder="little")[:self.n_vocab].astype(bool)

    def consume(self, token_id: int) -> None:
        """Advance past the sampled token; start computing the next token's mask."""
        if self._next_bits is not None:  # no worker reads the matcher while it changes
            self._next_bits.result()
            self._next_bits = None
        first, self._first = self._first, False
        if self._think is not None and (self._thinking or first and token_id == self._think[0]):
            self._thinking = token_id != self._think[1]
        else:
            self._matcher.consume_token(token_id)  # NOTE: a refused token leaves it in error
        if not self._thinking and not self._matcher.is_stopped():
            self._next_bits = _mask_workers().submit(self._matcher.compute_bitmask)
