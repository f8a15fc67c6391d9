"""N-gram (prompt-lookup) drafting: a decode step may carry a few guessed tokens, which the model
checks in the same pass; the greedy token of each checked row decides how many are kept, so the
output is exactly what one-token-at-a-time greedy decoding gives.

A draft is what followed the latest earlier occurrence of the sequence's last n tokens (n from
MAX_NGRAM down to 1): cheap, and right often where an answer repeats its prompt (code edits,
retrieval, quoting).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

MAX_NGRAM = 3


def ngram_draft(token_ids: Sequence[int], max_drafts: int) -> list[int]:
    """Up to max_drafts tokens that followed the latest earlier occurrence of token_ids' last n
    tokens, for the longest n ≤ MAX_NGRAM that occurs; [] when none does."""
    if max_drafts < 1:
        return []
    ids = np.asarray(token_ids, dtype=np.int64)  # (L,)
    length = len(ids)
    for n in range(min(MAX_NGRAM, length - 1), 0, -1):
        starts = np.ones(length - n, dtype=bool)  # windows ids[i:i + n], i < length - n
        for j in range(n):
            starts &= ids[j:length - n + j] == ids[length - n + j]
        found = np.flatnonzero(starts)
        if found.size:
            follow = int(found[-1]) + n
            return ids[follow:follow + max_drafts].tolist()
    return []


def accepted_drafts(drafts: Sequence[int], greedy: Sequence[int | None]) -> int:
    """How many drafts the checked rows confirm: greedy[i] is the model's pick after the fed
    token and drafts[:i]; the first mismatch ends the run."""
    for i, draft in enumerate(drafts):
        if greedy[i] != draft:
            return i
    return len(drafts)
