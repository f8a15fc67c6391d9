"""`sparkinfer chat` (or `generate -i`): a conversation in the terminal, as llama-cli's and
`ollama run`'s. Each turn's prompt is the whole conversation through the chat template; the
engine's prefix cache finds the earlier turns' KV, so a turn computes only what it adds."""

from __future__ import annotations

from typing import TYPE_CHECKING

from rich.console import Console
from rich.markup import escape

from sparkinfer_cli.app.generate import GenerationStats, chat_prompt

if TYPE_CHECKING:
    from sparkinfer_cli.app.run import GenerateRequest, Loaded
    from sparkinfer_cli.tokenizer.tokenizer import Tokenizer

HELP = "Ctrl-C stops an answer; /clear forgets the conversation; /bye or Ctrl-D ends the chat."
BYE = ("/bye", "/exit", "/quit")


class Conversation:
    """The messages so far, rendered to prompts that fit in `limit` tokens with the answer: the
    oldest turns are dropped when they no longer do (llama-cli's context shift, at turn level)."""

    def __init__(self, tokenizer: Tokenizer, system: str | None, enable_thinking: bool,
                 limit: int):
        self.tokenizer, self.enable_thinking, self.limit = tokenizer, enable_thinking, limit
        self.system = [{"role": "system", "content": system}] if system else []
        self.turns: list[dict] = []

    def ask(self, text: str, max_tokens: int) -> list[int]:
        """The prompt ids for the user's `text` after the conversation; ValueError when the
        message alone leaves no room for `max_tokens`."""
        self.turns.append({"role": "user", "content": text})
        while True:
            ids = chat_prompt(self.tokenizer, self.system + self.turns, self.enable_thinking)
            if len(ids) + max_tokens <= self.limit:
                return ids
            if len(self.turns) == 1:
                self.turns.clear()
                raise ValueError(f"this message ({len(ids):,} tokens) and --max-tokens "
                                 f"{max_tokens:,} do not fit in --ctx {self.limit:,}")
            del self.turns[:2]  # the oldest question and its answer

    def answered(self, text: str) -> None:
        self.turns.append({"role": "assistant", "content": text})

    def clear(self) -> None:
        self.turns.clear()


def run_chat(req: GenerateRequest, loaded: Loaded, err: Console) -> int:
    """Reads messages from stdin until /bye or end of input (exit 0) or Ctrl-C at the prompt
    (130); each answer streams to stdout, its speeds to stderr."""
    from sparkinfer_cli.app.run import EXIT_INTERRUPTED

    conversation = Conversation(loaded.tokenizer, req.system, req.enable_thinking,
                                loaded.session.max_tokens)
    err.print(f"[dim]{HELP}[/]", highlight=False)
    pending = req.prompt
    while True:
        try:
            text = pending if pending is not None else input(">>> ")
        except EOFError:
            return 0
        except KeyboardInterrupt:
            return EXIT_INTERRUPTED
        pending = None
        if text.strip() in BYE:
            return 0
        if text.strip() == "/clear":
            conversation.clear()
        elif text.strip():
            _turn(conversation, text, req, loaded, err)


def _turn(conversation: Conversation, text: str, req: GenerateRequest, loaded: Loaded,
          err: Console) -> None:
    from sparkinfer_cli.app.run import report_speeds, stream_answer

    try:
        ids = conversation.ask(text, req.params.max_tokens)
    except ValueError as exc:
        err.print(f"[red]{escape(str(exc))}[/]")
        return
    stats = GenerationStats()
    answer, finished = stream_answer(loaded.session.stream(ids, req.params, stats))
    conversation.answered(answer)
    if finished:
        report_speeds(err, loaded.name, stats)
    else:
        err.print("\n[yellow]stopped[/]")
