"""A FakeEngine with ContinuousBatchEngine's interface, a character tokenizer, a Qwen-like template.

The fake model "answers" with a scripted reply chosen from the prompt text, one character per
token, so every test knows the exact output. KV blocks are accounted like the real engine's
(prompt + max_tokens per request), so /v1/capacity and /metrics can be checked for leaks.
"""

from __future__ import annotations

import json
import math
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from sparkinfer_cli.engine.config import EngineStoppedError, QueueFullError, RequestTooLargeError
from sparkinfer_cli.engine.engine import EngineStats, RequestEvent
from sparkinfer_cli.engine.sampler import TokenLogprob

GATE_S = 60.0  # the longest a gated prefill waits (a test that forgets to open the gate)
THINK_REPLY = "<think>\nThe user wants a greeting.\n</think>\n\nHello there!"
JSON_TOOL_REPLY = ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
                   '</tool_call>')
XML_TOOL_REPLY = ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
                  "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>")
LONG_REPLY = "lorem ipsum " * 200


def last_user_text(prompt: str) -> str:
    start = prompt.rfind("<|im_start|>user\n")
    return prompt[start + len("<|im_start|>user\n"):].split("<|im_end|>")[0]


def scripted_reply(prompt: str, params: Any) -> str:
    """Reply chosen by a keyword in the last user message; otherwise an echo of it."""
    if prompt.endswith('"arguments": '):  # tool_choice named get_weather (JSON format)
        return '{"city": "Oslo"}}\n</tool_call>'
    if prompt.endswith("<tool_call>\n"):  # tool_choice required
        return '{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>'
    user = last_user_text(prompt)
    for keyword, reply in (("[think]", THINK_REPLY), ("[tool]", JSON_TOOL_REPLY),
                           ("[xmltool]", XML_TOOL_REPLY), ("[long]", LONG_REPLY),
                           ("[empty]", "")):
        if keyword in user:
            return reply
    if "<tool_response>" in prompt.rsplit("<|im_start|>assistant", 1)[-1] or \
            prompt.rstrip().endswith("</tool_response><|im_end|>\n<|im_start|>assistant"):
        return "It is sunny in Paris."
    seed = f" #{params.seed}" if params.temperature > 0 and params.seed is not None else ""
    return f"You said: {user}{seed}"


class CharTokenizer:
    """One token per Unicode code point; vocabulary = all code points."""

    vocab_size = 0x110000
    max_token_bytes = 4  # a code point's UTF-8 length at most
    bos_id = None
    eos_id = 0
    eog_ids = frozenset({0})

    def encode(self, text: str, parse_special: bool = True) -> list[int]:
        return [ord(c) for c in text]

    def decode(self, ids: list[int], skip_special: bool = False) -> str:
        return "".join(chr(i) for i in ids)

    def token_bytes(self, token_id: int) -> bytes:
        return chr(token_id).encode("utf-8", errors="replace")

    def id_of(self, text: str) -> int | None:
        return ord(text) if len(text) == 1 else None


class QwenLikeTemplate:
    """ChatML with Qwen's <think>/<tool_call> conventions; opens_thinking emulates Qwen3.5+."""

    source = "chatml with <think> and <tool_call>"

    def __init__(self, opens_thinking: bool = False):
        self.opens_thinking = opens_thinking

    def render(self, messages: list[dict], tools: list[dict] | None = None,
               add_generation_prompt: bool = True, **kwargs: Any) -> str:
        if kwargs.get("fail"):
            raise ValueError("template raised: fail was requested")
        parts = []
        if tools:
            parts.append("<|im_start|>system\n# Tools\n" + "\n".join(json.dumps(t) for t in tools)
                         + "<|im_end|>\n")
        parts += [self._message(m) for m in messages]
        if add_generation_prompt:
            parts.append("<|im_start|>assistant\n" + self._thinking_prefix(kwargs))
        return "".join(parts)

    def _thinking_prefix(self, kwargs: dict[str, Any]) -> str:
        if kwargs.get("enable_thinking") is False:
            return "<think>\n\n</think>\n\n"
        return "<think>\n" if self.opens_thinking else ""

    @staticmethod
    def _message(message: dict) -> str:
        content = message["content"]
        if message["role"] == "tool":
            return f"<|im_start|>user\n<tool_response>\n{content}\n</tool_response><|im_end|>\n"
        for call in message.get("tool_calls", []):
            arguments = call["function"]["arguments"]
            assert isinstance(arguments, dict), "tool arguments must reach the template as objects"
            content += ("<tool_call>\n" + json.dumps({"name": call["function"]["name"],
                                                      "arguments": arguments}) + "\n</tool_call>")
        return f"<|im_start|>{message['role']}\n{content}<|im_end|>\n"


@dataclass
class _FakeRequest:
    request_id: str
    prompt_ids: list[int]
    params: Any
    on_event: Callable[[RequestEvent], None]
    reply: str
    num_blocks: int
    submitted_at: float = field(default_factory=time.monotonic)
    scheduled_at: float | None = None
    first_token_at: float | None = None
    num_output: int = 0


class FakeEngine:
    keeps_state_snapshots = False  # a hybrid model's prefix cache is the real engine's concern

    def __init__(self, reply: Callable[[str, Any], str] = scripted_reply, *, ctx: int = 4096,
                 block_size: int = 16, max_queue_depth: int = 0, max_output_tokens: int = 4096,
                 request_timeout_s: float = 0.0, token_delay_s: float = 0.0,
                 prefill_delay_s: float = 0.0, max_num_seqs: int = 64,
                 prefill_gate: threading.Event | None = None):
        """prefill_gate: a request's first step waits until it is set (a prompt still being
        read), at most GATE_S."""
        self.reply, self.ctx, self.block_size = reply, ctx, block_size
        self.max_queue_depth, self.max_output_tokens = max_queue_depth, max_output_tokens
        self.request_timeout_s, self.token_delay_s = request_timeout_s, token_delay_s
        self.prefill_delay_s, self.max_num_seqs = prefill_delay_s, max_num_seqs
        self.prefill_gate = prefill_gate
        self.total_blocks = ctx // block_size
        self.free_blocks = self.total_blocks
        self.waiting: list[_FakeRequest] = []
        self.running: list[_FakeRequest] = []
        self.aborts: set[str] = set()
        self.aborted: list[str] = []
        self.num_cache_flushes = 0
        self.submitted: list[tuple[str, list[int], Any]] = []
        self.accepting, self.stopping = True, False
        self.lock = threading.Condition()
        self.thread: threading.Thread | None = None
        self._ids = 0

    @property
    def max_context(self) -> int:
        return self.ctx

    def start(self) -> None:
        self.thread = threading.Thread(target=self._loop, daemon=True, name="fake-engine")
        self.thread.start()

    def shutdown(self, wait: bool = True) -> None:
        with self.lock:
            self.accepting, self.stopping = False, True
            self.lock.notify_all()
        if wait and self.thread is not None:
            self.thread.join()

    def stats(self) -> EngineStats:
        with self.lock:
            return EngineStats(len(self.running), len(self.waiting), self.free_blocks,
                               self.total_blocks, self.max_queue_depth, self.accepting,
                               block_size=self.block_size, max_num_seqs=self.max_num_seqs)

    def check_grammar(self, grammar: str) -> str:
        return grammar  # the fake's replies are scripted: no grammar holds them

    def flush_prefix_cache(self) -> Future[int]:
        """The fake keeps no prefix cache: a flush frees nothing, and is counted."""
        with self.lock:
            if self.stopping:
                raise EngineStoppedError("the fake engine is stopped")
            self.num_cache_flushes += 1
        flushed: Future[int] = Future()
        flushed.set_result(0)
        return flushed

    def submit(self, prompt_ids: list[int], params: Any, on_event: Callable[[RequestEvent], None],
               *, priority: int = 0, request_id: str | None = None) -> str:
        max_tokens = min(params.max_tokens, self.max_output_tokens)
        with self.lock:
            if not self.accepting:
                raise EngineStoppedError("the fake engine is stopped")
            if len(prompt_ids) + max_tokens > self.ctx:
                raise RequestTooLargeError(f"{len(prompt_ids)} prompt tokens + max_tokens "
                                           f"{max_tokens} exceed the context limit {self.ctx}")
            if self.max_queue_depth and len(self.waiting) + len(self.running) >= \
                    self.max_queue_depth:
                raise QueueFullError(f"queue full (max_queue_depth={self.max_queue_depth})")
            self._ids += 1
            request_id = request_id or f"fake-{self._ids}"
            text = "".join(chr(i) for i in prompt_ids)
            blocks = math.ceil((len(prompt_ids) + max_tokens) / self.block_size)
            self.waiting.append(_FakeRequest(request_id, list(prompt_ids), params, on_event,
                                             self.reply(text, params), blocks))
            self.submitted.append((request_id, list(prompt_ids), params))
            self.lock.notify_all()
        return request_id

    def abort(self, request_id: str) -> None:
        with self.lock:
            self.aborts.add(request_id)
            self.lock.notify_all()

    def abort_waiting(self) -> None:
        with self.lock:
            for request in list(self.waiting):
                self._finish(request, "abort")

    # ---- engine thread
    def _loop(self) -> None:
        while True:
            with self.lock:
                while not (self.waiting or self.running):
                    if self.stopping:
                        return
                    self.lock.wait()
                self._admit()
                self._apply_aborts_and_deadlines()
                batch = list(self.running)
                if not batch:  # everything waits for KV blocks: poll, like the real engine
                    self.lock.wait(0.01)
            if batch:
                time.sleep(self.token_delay_s)
            for request in batch:
                self._step(request)

    def _admit(self) -> None:
        while self.waiting and len(self.running) < self.max_num_seqs and \
                self.waiting[0].num_blocks <= self.free_blocks:
            request = self.waiting.pop(0)
            self.free_blocks -= request.num_blocks
            request.scheduled_at = time.monotonic()
            self.running.append(request)

    def _apply_aborts_and_deadlines(self) -> None:
        now = time.monotonic()
        for request in self.waiting + self.running:
            if request.request_id in self.aborts:
                self._finish(request, "abort")
                self.aborted.append(request.request_id)
            elif self.request_timeout_s and now - request.submitted_at >= self.request_timeout_s:
                self._finish(request, "timeout")
        self.aborts.clear()

    def _finish(self, request: _FakeRequest, reason: str, token_ids: list[int] | None = None,
                text: str = "") -> None:
        if request in self.running:
            self.running.remove(request)
            self.free_blocks += request.num_blocks
        elif request in self.waiting:
            self.waiting.remove(request)
        self._emit(request, token_ids or [], text, reason)

    def _step(self, request: _FakeRequest) -> None:
        if request.first_token_at is None:
            if self.prefill_gate is not None:
                self.prefill_gate.wait(GATE_S)
            time.sleep(self.prefill_delay_s)
            request.first_token_at = time.monotonic()
        output, stop_at = self._planned_output(request)
        token = output[request.num_output] if request.num_output < len(output) else ""
        request.num_output += 1
        max_tokens = min(request.params.max_tokens, self.max_output_tokens)
        with self.lock:
            if request not in self.running:
                return
            if request.num_output > len(output):  # the reply is over: EOS (no text)
                self._finish(request, "stop", [0])
            elif request.num_output == len(output) and stop_at is not None:
                self._finish(request, "stop", [ord(token)], token)
            elif request.num_output >= max_tokens:
                self._finish(request, "length", [ord(token)], token)
            else:
                self._emit(request, [ord(token)], token, None)

    @staticmethod
    def _planned_output(request: _FakeRequest) -> tuple[str, int | None]:
        """The reply cut before the first stop string (the stop string itself is never sent)."""
        cuts = [i for s in request.params.stop if (i := request.reply.find(s)) >= 0]
        return (request.reply[:min(cuts)], min(cuts)) if cuts else (request.reply, None)

    def _emit(self, request: _FakeRequest, token_ids: list[int], text: str,
              reason: str | None) -> None:
        logprobs = [TokenLogprob(t, -0.25, [(t, -0.25), (ord("?"), -2.5), (ord("!"), -3.0)])
                    for t in token_ids] if request.params.logprobs else []
        event = RequestEvent(request.request_id, token_ids, text, reason, logprobs,
                             len(request.prompt_ids), request.num_output, request.submitted_at,
                             request.scheduled_at, request.first_token_at,
                             time.monotonic() if reason else None)
        request.on_event(event)
