"""Byte-level BPE tokenizer rebuilt from GGUF metadata, token for token what llama.cpp produces.

The BPE merges run in HF `tokenizers`; the GGUF-specific rules (pre-tokenizer regex chosen by
`tokenizer.ggml.pre`, token types, special-token parsing, EOG set, detokenization) follow
llama.cpp's `src/llama-vocab.cpp`. No NFC normalization is applied, like llama.cpp.
"""

from __future__ import annotations

import functools
import re
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import IntEnum
from typing import TYPE_CHECKING, Any

from tokenizers import AddedToken, Regex, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

if TYPE_CHECKING:
    from sparkinfer_cli.gguf.reader import GGUFFile


class TokenType(IntEnum):
    """`tokenizer.ggml.token_type` values (gguf.TokenType)."""

    NORMAL = 1
    UNKNOWN = 2
    CONTROL = 3
    USER_DEFINED = 4
    UNUSED = 5
    BYTE = 6


@dataclass(frozen=True)
class PreTokenizerRule:
    """How llama.cpp treats one `tokenizer.ggml.pre` value."""

    regexes: tuple[str, ...]  # applied in order, each splitting the pieces of the previous one
    ignore_merges: bool = False  # a piece that is itself a token is taken whole
    add_bos: bool = False  # default when tokenizer.ggml.add_bos_token is absent
    clean_spaces: bool = False  # llama.cpp's clean_up_tokenization_spaces on decode


# llama.cpp spells the (?i:...) contraction group out; onig accepts both, this is its exact form.
_CONTRACTIONS = "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
_QWEN2_REGEX = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN35_REGEX = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
                 r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_LLAMA3_REGEX = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                 r"|\s*[\r\n]+|\s+(?!\S)|\s+")
# GPT-2's regex; llama.cpp's custom splitter for it also takes a trailing whitespace run (\s+).
_GPT2_REGEX = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"

_QWEN2 = PreTokenizerRule((_QWEN2_REGEX,))
_LLAMA3 = PreTokenizerRule((_LLAMA3_REGEX,), ignore_merges=True, add_bos=True, clean_spaces=True)
PRE_TOKENIZER_RULES: dict[str, PreTokenizerRule] = {
    "qwen2": _QWEN2,
    "deepseek-r1-qwen": _QWEN2,
    "qwen35": PreTokenizerRule((_QWEN35_REGEX,)),
    "smollm": PreTokenizerRule((r"\p{N}", _GPT2_REGEX)),
    "llama-bpe": _LLAMA3,
    "llama3": _LLAMA3,
    "llama-v3": _LLAMA3,
}

# Token texts llama.cpp treats as end-of-generation (and forces to CONTROL), by text.
_EOG_TEXTS = frozenset({"<|endoftext|>", "<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end|>",
                        "<|end_of_text|>", "<end_of_turn>", "<EOT>"})
# FIM pad / repo / file-separator tokens: llama.cpp also stops on these.
_FIM_EOG_TEXTS = (("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>"),
                  ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"),
                  ("<|file_sep|>",))
# fill-in-the-middle's prefix, suffix and middle markers, each as the model families spell it
_FIM_MARKERS = (("<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<PRE>"),
                ("<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<SUF>"),
                ("<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<MID>"))
_FIM_OTHER_TEXTS = frozenset(t for group in _FIM_MARKERS for t in group)


_BYTE_TOKEN = re.compile(r"<0x[0-9A-Fa-f]{2}>")
# the types tokenizer.* metadata must have, checked before anything is built from it
_TYPED_LISTS = {"tokenizer.ggml.tokens": str, "tokenizer.ggml.token_type": int,
                "tokenizer.ggml.merges": str}
_TYPED_VALUES = {"tokenizer.ggml.model": str, "tokenizer.ggml.pre": str,
                 "tokenizer.ggml.bos_token_id": int, "tokenizer.ggml.eos_token_id": int,
                 "tokenizer.ggml.eot_token_id": int, "tokenizer.ggml.eom_token_id": int,
                 "tokenizer.ggml.add_bos_token": bool, "tokenizer.chat_template": str}


def check_metadata_types(gguf: GGUFFile) -> None:
    """GGUFError naming the first tokenizer.* key whose value has the wrong type."""
    for key, kind in _TYPED_LISTS.items():
        gguf.typed_list(key, kind)
    for key, kind in _TYPED_VALUES.items():
        gguf.typed(key, kind)


def _byte_level_alphabet() -> dict[int, str]:
    """GPT-2's byte → printable-character map used by byte-level BPE vocabularies."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    extra = (b for b in range(256) if b not in printable)
    mapping = {b: chr(b) for b in printable}
    mapping.update({b: chr(256 + i) for i, b in enumerate(extra)})
    return mapping


BYTE_TO_CHAR = _byte_level_alphabet()
_CHAR_TO_BYTE_TABLE = {ord(c): b for b, c in BYTE_TO_CHAR.items()}
_NOT_IN_ALPHABET = 0x110000  # marks characters outside the alphabet so latin-1 encoding fails
_DECODE_TABLE = {**dict.fromkeys(range(256), _NOT_IN_ALPHABET), **_CHAR_TO_BYTE_TABLE}


def byte_level_encode(data: bytes) -> str:
    """UTF-8 bytes → their byte-level vocabulary spelling ("Ġ" for a space)."""
    return "".join(BYTE_TO_CHAR[b] for b in data)


def byte_level_decode(text: str) -> bytes:
    """A NORMAL token's text → raw bytes (llama.cpp `llama_decode_text`)."""
    try:
        return text.translate(_DECODE_TABLE).encode("latin-1")
    except (UnicodeEncodeError, ValueError):
        return b"".join(_decode_char(c, text) for c in text)


def _decode_char(char: str, token_text: str) -> bytes:
    byte = _CHAR_TO_BYTE_TABLE.get(ord(char))
    if byte is not None:
        return bytes([byte])
    # llama.cpp's marker for a character outside the byte alphabet
    return f"[UNK_BYTE_0x{char.encode('utf-8').hex()}{token_text}]".encode()


def clean_up_spaces(text: str) -> str:
    """llama.cpp's three clean-up passes: " ?"→"?", " ' "→"'", " 's"→"'s" (also 'm 're 've)."""
    text = re.sub(r" (?=[?!.,])", "", text)
    text = text.replace(" ' ", "'")
    return re.sub(r" (?='[sm]|'re|'ve)", "", text)


class Tokenizer:
    """Text ↔ token ids for a GGUF byte-level BPE vocabulary (`tokenizer.ggml.model == "gpt2"`)."""

    def __init__(self, tokens: Sequence[str], token_types: Sequence[int], merges: Sequence[str],
                 pre: str, *, bos_id: int | None = None, eos_id: int | None = None,
                 eot_id: int | None = None, eom_id: int | None = None,
                 add_bos: bool | None = None, chat_template: str | None = None):
        if pre not in PRE_TOKENIZER_RULES:
            raise ValueError(f"unsupported tokenizer.ggml.pre {pre!r}; this engine knows "
                             f"{', '.join(sorted(PRE_TOKENIZER_RULES))}")
        if len(token_types) < len(tokens):
            raise ValueError(f"tokenizer.ggml.token_type has {len(token_types)} entries for "
                             f"{len(tokens)} tokens")
        self.rule = PRE_TOKENIZER_RULES[pre]
        self.tokens = [t or f"[EMPTY_{i}]" for i, t in enumerate(tokens)]
        self.vocab_size = len(self.tokens)
        self.token_to_id = self._index_tokens(self.tokens)
        self.bos_id, self.eos_id = self._checked_id(bos_id), self._checked_id(eos_id)
        self.add_bos = self.rule.add_bos if add_bos is None else bool(add_bos)
        if self.add_bos and self.bos_id is None:
            raise ValueError("tokenizer.ggml.add_bos_token is true, but there is no BOS id")
        self.chat_template = chat_template
        self.token_types = self._effective_types(token_types)
        self._check_byte_tokens()
        eog_extra = {i for i in (self._checked_id(eot_id), self._checked_id(eom_id), self.eos_id)
                     if i is not None}
        self.eog_ids = frozenset(self._eog_by_text() | eog_extra)
        self._bytes: list[bytes | None] = [None] * self.vocab_size  # filled on first use
        self._hf = self._build_hf(merges)
        self._encode_lock = threading.Lock()

    # ---- construction ------------------------------------------------------------------------
    @classmethod
    def from_gguf(cls, gguf: GGUFFile) -> Tokenizer:
        """The file's tokenizer; anything wrong with its tokenizer.* metadata is a GGUFError."""
        from sparkinfer_cli.gguf.reader import GGUFError

        check_metadata_types(gguf)
        try:
            return cls.from_metadata(gguf.metadata)
        except Exception as exc:  # tokenizers raises bare Exception (e.g. a merge out of vocab)
            raise GGUFError(f"{gguf.path}: tokenizer: {exc}") from exc

    @classmethod
    def from_metadata(cls, metadata: Mapping[str, Any]) -> Tokenizer:
        model = metadata.get("tokenizer.ggml.model")
        if model != "gpt2":
            raise ValueError(f"tokenizer.ggml.model is {model!r}; only byte-level BPE ('gpt2') "
                             "vocabularies are supported")
        for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.pre"):
            if key not in metadata:
                raise ValueError(f"GGUF metadata has no {key}")
        tokens = metadata["tokenizer.ggml.tokens"]
        token_types = metadata.get("tokenizer.ggml.token_type", [TokenType.NORMAL] * len(tokens))
        return cls(tokens, token_types,
                   metadata["tokenizer.ggml.merges"], metadata["tokenizer.ggml.pre"],
                   bos_id=metadata.get("tokenizer.ggml.bos_token_id"),
                   eos_id=metadata.get("tokenizer.ggml.eos_token_id"),
                   eot_id=metadata.get("tokenizer.ggml.eot_token_id"),
                   eom_id=metadata.get("tokenizer.ggml.eom_token_id"),
                   add_bos=metadata.get("tokenizer.ggml.add_bos_token"),
                   chat_template=metadata.get("tokenizer.chat_template"))

    @staticmethod
    def _index_tokens(tokens: list[str]) -> dict[str, int]:
        index = dict(zip(tokens, range(len(tokens))))
        if len(index) != len(tokens):
            dup = next(t for i, t in enumerate(tokens) if index[t] != i)
            raise ValueError(f"duplicate token in vocabulary: {dup!r} has ids "
                             f"{tokens.index(dup)} and {index[dup]}")
        return index

    def _checked_id(self, token_id: int | None) -> int | None:
        if token_id is None or 0 <= int(token_id) < self.vocab_size:
            return None if token_id is None else int(token_id)
        raise ValueError(f"special token id {token_id} is outside the vocabulary "
                         f"(size {self.vocab_size})")

    def _effective_types(self, token_types: Sequence[int]) -> list[int]:
        # NOTE: llama.cpp forces control-looking EOG/FIM tokens to CONTROL whatever the file says.
        types = list(map(int, token_types[:self.vocab_size]))
        forced = _EOG_TEXTS | _FIM_OTHER_TEXTS | {t for group in _FIM_EOG_TEXTS for t in group}
        for text in forced:
            token_id = self.token_to_id.get(text)
            if token_id is not None:
                types[token_id] = TokenType.CONTROL
        return types

    def _check_byte_tokens(self) -> None:
        """BYTE tokens are decoded from their spelling, so a misspelt one would fail mid-stream."""
        for token_id in self._ids_of(TokenType.BYTE):
            if not _BYTE_TOKEN.fullmatch(self.tokens[token_id]):
                raise ValueError(f"token {token_id} {self.tokens[token_id]!r} has type BYTE but "
                                 "is not spelled <0xHH>")

    def _eog_by_text(self) -> set[int]:
        eog = {self.token_to_id[t] for t in _EOG_TEXTS if t in self.token_to_id}
        for group in _FIM_EOG_TEXTS:
            found = [self.token_to_id[t] for t in group if t in self.token_to_id]
            eog.update(found[:1])
        return eog

    def _piece_bytes(self, token_id: int) -> bytes:
        """What llama.cpp's token_to_piece(special=True) gives for one token."""
        token_type, text = self.token_types[token_id], self.tokens[token_id]
        if token_type in (TokenType.CONTROL, TokenType.USER_DEFINED, TokenType.UNKNOWN):
            return text.encode("utf-8")
        if token_type == TokenType.NORMAL:
            return byte_level_decode(text)
        if token_type == TokenType.BYTE:
            return bytes([int(text[3:5], 16)])  # "<0xAB>"
        return b""  # UNUSED and undefined types print nothing

    def _build_hf(self, merges: Sequence[str]) -> HFTokenizer:
        malformed = next((m for m in merges if " " not in m), None)
        if malformed is not None:
            raise ValueError(f"the merge {malformed!r} is not two tokens separated by a space")
        pairs = [(left, right) for left, right in (m.split(" ", 1) for m in merges)]
        bpe = models.BPE(self.token_to_id, pairs, unk_token=None, continuing_subword_prefix="",
                         end_of_word_suffix="", fuse_unk=False, byte_fallback=False,
                         ignore_merges=self.rule.ignore_merges)
        hf = HFTokenizer(bpe)
        splits = [pre_tokenizers.Split(Regex(r), behavior="isolated", invert=False)
                  for r in self.rule.regexes]
        hf.pre_tokenizer = pre_tokenizers.Sequence(
            [*splits, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
        hf.add_special_tokens([self._added(i) for i in self._ids_of(TokenType.CONTROL,
                                                                      TokenType.UNKNOWN)])
        hf.add_tokens([self._added(i) for i in self._ids_of(TokenType.USER_DEFINED)])
        return hf

    def _ids_of(self, *types: int) -> list[int]:
        return [i for i, t in enumerate(self.token_types) if t in types]

    def _added(self, token_id: int) -> AddedToken:
        special = self.token_types[token_id] != TokenType.USER_DEFINED
        return AddedToken(self.tokens[token_id], special=special, normalized=False)

    # ---- public API ----------------------------------------------------------------------------
    def encode(self, text: str, parse_special: bool = True) -> list[int]:
        """Token ids of `text`; CONTROL tokens are matched only when `parse_special` is true
        (USER_DEFINED ones always, as in llama.cpp). BOS is prepended if the GGUF asks for it."""
        with self._encode_lock:
            self._hf.encode_special_tokens = not parse_special
            # NOTE: encode_batch, unlike encode, releases the GIL while it runs, so that a server
            # tokenizing a long prompt on a worker thread keeps its event loop answering.
            ids = self._hf.encode_batch([text], add_special_tokens=False)[0].ids
        return [self.bos_id, *ids] if self.add_bos and self.bos_id is not None else ids

    @functools.cached_property
    def max_token_bytes(self) -> int:
        """The most text bytes one token can stand for: len(text.encode()) / max_token_bytes is
        a lower bound on len(encode(text)) that costs no tokenization."""
        return max(map(self._matched_bytes, range(self.vocab_size)), default=1)

    def _matched_bytes(self, token_id: int) -> int:
        """How many bytes of input text the token can match: special and added tokens match their
        literal text, the others their byte-level spelling decoded."""
        text = self.tokens[token_id]
        if self.token_types[token_id] in (TokenType.CONTROL, TokenType.USER_DEFINED,
                                          TokenType.UNKNOWN):
            return len(text.encode("utf-8"))
        return len(byte_level_decode(text))  # longer than matched where not byte-level: safe

    def fill_in_the_middle(self, prefix: str, suffix: str) -> list[int] | None:
        """A fill-in-the-middle prompt (prefix-suffix-middle order, as llama.cpp's infill and
        Qwen2.5-Coder use), or None when the vocabulary lacks the three markers."""
        markers = [next((self.token_to_id[t] for t in group if t in self.token_to_id), -1)
                   for group in _FIM_MARKERS]
        if -1 in markers:
            return None
        pre, suf, mid = markers
        bos = [self.bos_id] if self.add_bos and self.bos_id is not None else []
        prefix_ids = self.encode(prefix, parse_special=False)[len(bos):]
        suffix_ids = self.encode(suffix, parse_special=False)[len(bos):]
        return [*bos, pre, *prefix_ids, suf, *suffix_ids, mid]

    def decode(self, ids: Sequence[int], skip_special: bool = False) -> str:
        """Text of `ids`; invalid UTF-8 becomes U+FFFD. `skip_special` drops CONTROL tokens."""
        data = b"".join(self.token_bytes(i) for i in ids
                        if not (skip_special and self.is_special(i)))
        text = data.decode("utf-8", errors="replace")
        return clean_up_spaces(text) if self.rule.clean_spaces else text

    def token_bytes(self, token_id: int) -> bytes:
        if not 0 <= token_id < self.vocab_size:
            raise ValueError(f"token id {token_id} is outside the vocabulary "
                             f"(size {self.vocab_size})")
        piece = self._bytes[token_id]
        if piece is None:
            piece = self._bytes[token_id] = self._piece_bytes(token_id)
        return piece

    def is_special(self, token_id: int) -> bool:
        """CONTROL / UNKNOWN tokens: markup that `skip_special` hides."""
        return self.token_types[token_id] in (TokenType.CONTROL, TokenType.UNKNOWN)

    def id_of(self, text: str) -> int | None:
        """Id of the single token spelled `text`: a special/added token's literal text, or the
        raw text of a normal token (looked up in its byte-level form)."""
        token_id = self.token_to_id.get(text)
        if token_id is not None and self.token_types[token_id] != TokenType.NORMAL:
            return token_id
        token_id = self.token_to_id.get(byte_level_encode(text.encode("utf-8")))
        if token_id is not None and self.token_types[token_id] == TokenType.NORMAL:
            return token_id
        return None

    def __repr__(self) -> str:
        return (f"Tokenizer(vocab_size={self.vocab_size}, bos={self.bos_id}, eos={self.eos_id}, "
                f"eog={sorted(self.eog_ids)})")
