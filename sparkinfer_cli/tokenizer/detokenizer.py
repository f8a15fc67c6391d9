"""Streaming detokenizer: turns generated ids into text pieces that are safe to send.

A token may end inside a multi-byte UTF-8 character (byte-level BPE splits emoji and CJK), so
bytes are fed through an incremental UTF-8 decoder that holds back an incomplete tail. The
concatenation of every `push` and the final `flush` equals `Tokenizer.decode` of all ids.
"""

from __future__ import annotations

import codecs

from sparkinfer_cli.tokenizer.tokenizer import Tokenizer, clean_up_spaces

# clean_up_spaces looks at most 3 characters ahead of a space it may drop; holding back more
# than that keeps emitted text identical to a clean-up of the whole text.
_CLEAN_UP_HOLDBACK = 4


class IncrementalDetokenizer:
    """Feed generated ids one at a time; get back only text that will not change."""

    def __init__(self, tokenizer: Tokenizer, skip_special: bool = False):
        self.tokenizer = tokenizer
        self.skip_special = skip_special
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._clean_spaces = tokenizer.rule.clean_spaces
        self._raw_text = ""  # decoded so far, before space clean-up (clean-up vocabularies only)
        self._num_emitted = 0  # characters of the cleaned text already returned

    def push(self, token_id: int) -> str:
        """Text that became final with this token (possibly empty)."""
        if self.skip_special and self.tokenizer.is_special(token_id):
            return ""
        text = self._utf8.decode(self.tokenizer.token_bytes(token_id))
        return self._emit(text, final=False)

    def flush(self) -> str:
        """Everything still held back; call once at the end of generation."""
        return self._emit(self._utf8.decode(b"", final=True), final=True)

    def _emit(self, text: str, final: bool) -> str:
        if not self._clean_spaces:
            return text
        # NOTE: clean-up of a prefix equals the prefix of the clean-up, except near its end.
        self._raw_text += text
        cleaned = clean_up_spaces(self._raw_text)
        end = len(cleaned) if final else max(self._num_emitted, len(cleaned) - _CLEAN_UP_HOLDBACK)
        piece, self._num_emitted = cleaned[self._num_emitted:end], end
        return piece
