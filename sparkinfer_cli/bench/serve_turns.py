"""`sparkinfer bench --serve --turns N`: one conversation through the real server, the way chat
clients and agents send it: every turn resends the whole history as chat messages (the earlier
turns, the last answer as the client received it, then a user message of `turn_tokens` new
tokens), so the prefix cache decides how much of each prompt is computed again. Then a fresh
prompt as long as the last turn's, which no cache can serve: the cold TTFT each warm turn is set
against.

Per turn: TTFT as the client sees it, prompt tokens, the tokens the server took from its cache
(usage.prompt_tokens_details.cached_tokens) and so the tokens it computed, against the tokens the
turn added to the conversation.
"""

from __future__ import annotations

import json
import random
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from sparkinfer_cli.bench.report import free_stem
from sparkinfer_cli.bench.serve_client import PROMPT_WORDS, Endpoint, stream_chat

SAMPLE_WORDS = 32


@dataclass(frozen=True)
class TurnFigures:
    turn: int  # 1-based; 0: the cold prompt as long as the last turn
    prompt_tokens: int
    cached_tokens: int
    added_tokens: int  # new text tokens this turn appended (0 for turn 1 and the cold prompt)
    answer_tokens: int  # the previous answer's tokens as resent in this prompt (re-tokenized)
    ttft_ms: float | None
    output_tokens: int
    error: str | None = None

    @property
    def computed_tokens(self) -> int:
        return self.prompt_tokens - self.cached_tokens


@dataclass
class TurnsReport:
    model: str
    device: str
    machine: str
    commit: str
    date: str
    command: str
    parameters: dict[str, Any]
    turns: list[TurnFigures] = field(default_factory=list)
    cold: TurnFigures | None = None

    @property
    def stem(self) -> str:
        return f"{self.date[:10]}-{self.model}-{self.device}-turns"


class Conversation:
    """Seeded text of ordinary words, measured in the server's own tokens."""

    def __init__(self, endpoint: Endpoint, seed: int):
        self.endpoint, self.rng = endpoint, random.Random(seed)

    def count(self, text: str) -> int:
        return self.endpoint.post_json("/v1/tokenize", {"prompt": text})["count"]

    def words(self, num_tokens: int) -> str:
        """Text of at least num_tokens tokens (a word's tokens more at most), starting with a
        space: words are added in batches sized by the tokens a word has taken so far."""
        text, num_words, count = "", 0, 0
        while count < num_tokens:
            # NOTE: a first small batch measures the tokenizer (a synthetic one spends ~5 a word)
            per_word = count / num_words if num_words else num_tokens / SAMPLE_WORDS
            batch = max(1, int((num_tokens - count) / max(per_word, 1.0) * 0.9))
            text += "".join(" " + self.rng.choice(PROMPT_WORDS) for _ in range(batch))
            num_words, count = num_words + batch, self.count(text)
        return text


def run_turns(endpoint: Endpoint, num_turns: int, first_tokens: int, turn_tokens: int,
              max_tokens: int, seed: int) -> tuple[list[TurnFigures], TurnFigures]:
    """The conversation's turns, then the cold prompt as long as the last turn."""
    talk = Conversation(endpoint, seed)
    messages, added, turns = [user(talk.words(first_tokens))], (0, 0), []
    for turn in range(1, num_turns + 1):
        timing = stream_chat(endpoint, messages, max_tokens)
        turns.append(figures(turn, timing, *added))
        new = talk.words(turn_tokens)
        added = (talk.count(new), talk.count(timing.text) if timing.text else 0)
        messages += [{"role": "assistant", "content": timing.text}, user(new)]
    cold = Conversation(endpoint, seed + 1).words(max(turns[-1].prompt_tokens, 1))
    return turns, figures(0, stream_chat(endpoint, [user(cold)], max_tokens), 0, 0)


def user(text: str) -> dict[str, str]:
    return {"role": "user", "content": text.lstrip()}


def figures(turn: int, timing: Any, added: int, answer: int) -> TurnFigures:
    return TurnFigures(turn, timing.prompt_tokens, timing.cached_tokens, added, answer,
                       1000 * timing.ttft_s if timing.token_times else None,
                       timing.output_tokens, timing.error)


# ---- report --------------------------------------------------------------------------------------
def write_turns_report(report: TurnsReport, out_dir: Path) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = free_stem(out_dir, report.stem, report.date)
    md, js = out_dir / f"{stem}.md", out_dir / f"{stem}.json"
    data = asdict(report) | {"kind": "turns"}
    js.write_text(json.dumps(data, indent=2) + "\n")
    md.write_text(turns_markdown(report))
    return [md, js]


TURNS_HEADER = ("turn", "prompt tokens", "cached", "computed", "new", "answer resent",
                "computed / new", "TTFT ms", "TTFT / cold")


def turn_cells(turn: TurnFigures, cold_ms: float | None) -> tuple[str, ...]:
    ratio = f"{turn.computed_tokens / turn.added_tokens:.2f}" if turn.added_tokens else "—"
    ttft = "—" if turn.ttft_ms is None else f"{turn.ttft_ms:,.0f}"
    vs_cold = f"{turn.ttft_ms / cold_ms:.1%}" if turn.ttft_ms and cold_ms else "—"
    name = "cold, same length" if turn.turn == 0 else str(turn.turn)
    return (name, f"{turn.prompt_tokens:,}", f"{turn.cached_tokens:,}",
            f"{turn.computed_tokens:,}", f"{turn.added_tokens:,}" if turn.added_tokens else "—",
            f"{turn.answer_tokens:,}" if turn.added_tokens else "—", ratio, ttft, vs_cold)


def turns_markdown(report: TurnsReport) -> str:
    cold_ms = report.cold.ttft_ms if report.cold else None
    shown = [*report.turns, *([report.cold] if report.cold else [])]
    rows = [turn_cells(t, cold_ms) for t in shown]
    errors = [f"- turn {t.turn}: {t.error}" for t in report.turns if t.error]
    lines = [f"# {report.model}: a {len(report.turns)}-turn conversation through the server "
             f"({report.device})", "",
             f"{report.date} · commit {report.commit} · {report.machine}", "",
             f"`{report.command}`", "",
             "Each turn resends the history as chat messages: the earlier turns, the last answer "
             f"and a user message of {report.parameters['turn_tokens']} new tokens. computed = "
             "prompt − cached "
             "(the server's usage); new = the new text's tokens; answer resent = the previous "
             "answer's tokens as the server tokenizes its text again (cached only where that "
             "gives back the tokens it generated). The last row is a fresh prompt as long as the "
             "last turn: the cold TTFT.", "",
             "| " + " | ".join(TURNS_HEADER) + " |",
             "|" + "---|" * len(TURNS_HEADER),
             *("| " + " | ".join(cells) + " |" for cells in rows), *errors, ""]
    return "\n".join(lines)
