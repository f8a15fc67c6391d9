"""OpenAI request shapes: validated request dataclasses and errors (responses.py builds replies).

Parsing is strict about types (a bool is not an int, numbers are finite) and lenient about fields
it does not use (unknown keys are ignored, as OpenAI adds fields often). Every rejection is an
`ApiError` carrying the OpenAI error object, so bad input never becomes a 500.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import ujson

from sparkinfer_cli.engine.sampling_params import SamplingParams
from sparkinfer_cli.server.tool_calls import arguments_for_template

ROLES = ("system", "developer", "user", "assistant", "tool")
TOOL_CHOICES = ("none", "auto", "required")
RESERVED_TEMPLATE_KWARGS = ("messages", "tools", "add_generation_prompt", "documents")
MAX_STOP_STRINGS = 16
MAX_TOP_LOGPROBS = 20
_TOKEN_ID_KEY = re.compile(r"\s*[0-9]{1,10}\s*")  # ASCII digits only: int() also takes "²", "١"
_SURROGATE = re.compile("[\ud800-\udfff]")  # left after parsing only where unpaired


class ApiError(Exception):
    """An HTTP error with an OpenAI error object: {"error": {message, type, param, code}}."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 headers: Mapping[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.type = status, message, type
        self.param, self.code, self.headers = param, code, dict(headers or {})

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


def invalid(message: str, param: str | None = None, code: str = "invalid_value") -> ApiError:
    return ApiError(400, message, param=param, code=code)


# ---------------------------------------------------------------- typed field access


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return (_is_int(value) or isinstance(value, float)) and math.isfinite(value)


def _is_bool(value: Any) -> bool:
    return isinstance(value, bool)


def _is_str(value: Any) -> bool:
    return isinstance(value, str)


def _is_object(value: Any) -> bool:
    return isinstance(value, dict)


_TYPE_NAMES: dict[Callable[[Any], bool], str] = {
    _is_int: "an integer", _is_number: "a finite number", _is_bool: "a boolean",
    _is_str: "a string", _is_object: "an object",
}


def _field(body: Mapping[str, Any], name: str, is_type: Callable[[Any], bool], default: Any = None,
           *, param: str | None = None) -> Any:
    """body[name] checked with is_type; a missing key or JSON null gives the default."""
    value = body.get(name)
    if value is None:
        return default
    if not is_type(value):
        raise invalid(f"'{param or name}' must be {_TYPE_NAMES[is_type]}", param or name,
                      "invalid_type")
    return value


def _int_in(body: Mapping[str, Any], name: str, default: int | None, low: int,
            high: int | None = None) -> int | None:
    value = _field(body, name, _is_int, default)
    if value is not None and (value < low or (high is not None and value > high)):
        bound = f"in [{low}, {high}]" if high is not None else f">= {low}"
        raise invalid(f"'{name}' must be {bound}, got {value}", name)
    return value


def _require_object(body: Any, what: str = "the request body") -> dict[str, Any]:
    if not isinstance(body, dict):
        raise invalid(f"{what} must be a JSON object", None, "invalid_type")
    return body


def parse_json_body(raw: bytes) -> dict[str, Any]:
    if not raw:
        raise invalid("the request body is empty; expected a JSON object", None, "invalid_json")
    try:
        # strict: json.loads would let UTF-8-encoded surrogates through ("surrogatepass")
        text = raw.decode(json.detect_encoding(raw))
        # NOTE: ujson nests 1,024 levels wherever it runs; json.loads only as deep as the
        # recursion limit allows below the handler's own frames (~940 in a Sanic handler)
        body = ujson.loads(text)
    except ValueError as exc:  # UnicodeDecodeError and ujson.JSONDecodeError are ValueErrors
        raise invalid(f"the request body is not valid JSON: {exc}", None, "invalid_json") from None
    if "\\u" in text and _has_lone_surrogate(body):  # only escapes are left to make one
        raise invalid("the request body holds a lone UTF-16 surrogate escape (\\ud800-\\udfff "
                      "without its pair), which is not text", None, "invalid_json")
    return _require_object(body)


def _has_lone_surrogate(body: Any) -> bool:
    """Whether a key or string in the parsed body holds an unpaired UTF-16 surrogate, which no
    tokenizer takes; walked without recursion, as bodies nest up to 1,024 levels."""
    pending = [body]
    while pending:
        value = pending.pop()
        if isinstance(value, dict):
            pending += value.keys()
            pending += value.values()
        elif isinstance(value, list):
            pending += value
        elif isinstance(value, str) and _SURROGATE.search(value):
            return True
    return False


# ---------------------------------------------------------------- sampling (chat and completions)


@dataclass(frozen=True)
class SamplingFields:
    temperature: float
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    logit_bias: dict[int, float] = field(default_factory=dict)
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False  # vLLM's extensions, which load generators use for full-length outputs
    min_tokens: int = 0

    def to_params(self, max_tokens: int, choice_index: int, top_logprobs: int | None,
                  prompt_logprobs: int | None = None) -> SamplingParams:
        """SamplingParams for one choice; the choices of a seeded request get seed + index."""
        seed = None if self.seed is None else (self.seed + choice_index) % 2**64
        try:
            return SamplingParams(
                max_tokens=max_tokens, temperature=self.temperature, top_k=self.top_k,
                top_p=self.top_p, min_p=self.min_p, repetition_penalty=self.repetition_penalty,
                presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
                logit_bias=self.logit_bias, seed=seed, stop=self.stop, ignore_eos=self.ignore_eos,
                min_tokens=self.min_tokens, logprobs=top_logprobs is not None,
                top_logprobs=top_logprobs or 0, prompt_logprobs=prompt_logprobs)
        except ValueError as exc:
            raise invalid(str(exc)) from None


def parse_sampling(body: Mapping[str, Any], default_temperature: float, vocab_size: int,
                   max_tokens: int | None) -> SamplingFields:
    """max_tokens: the requested one (None: not given), which min_tokens may not exceed."""
    top_k = _field(body, "top_k", _is_int, 0)
    return SamplingFields(
        temperature=_field(body, "temperature", _is_number, default_temperature),
        top_p=_field(body, "top_p", _is_number, 1.0),
        top_k=0 if top_k == -1 else top_k,  # vLLM spells "off" as -1
        min_p=_field(body, "min_p", _is_number, 0.0),
        presence_penalty=_field(body, "presence_penalty", _is_number, 0.0),
        frequency_penalty=_field(body, "frequency_penalty", _is_number, 0.0),
        repetition_penalty=_field(body, "repetition_penalty", _is_number, 1.0),
        seed=_field(body, "seed", _is_int),
        logit_bias=_parse_logit_bias(body.get("logit_bias"), vocab_size),
        stop=_parse_stop(body.get("stop")),
        ignore_eos=_field(body, "ignore_eos", _is_bool, False),
        min_tokens=_int_in(body, "min_tokens", 0, 0, max_tokens) or 0,
    )


def _parse_logit_bias(value: Any, vocab_size: int) -> dict[int, float]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise invalid("'logit_bias' must be an object mapping token ids to biases", "logit_bias",
                      "invalid_type")
    bias: dict[int, float] = {}
    for key, amount in value.items():
        token_id = int(key) if _TOKEN_ID_KEY.fullmatch(key) else -1
        if not 0 <= token_id < vocab_size:
            raise invalid(f"logit_bias key {key[:24]!r} is not a token id in [0, {vocab_size})",
                          "logit_bias")
        if not _is_number(amount) or not -100 <= amount <= 100:
            raise invalid(f"logit_bias[{key!r}] must be a number in [-100, 100]", "logit_bias")
        bias[token_id] = float(amount)
    return bias


def _parse_stop(value: Any) -> tuple[str, ...]:
    stops = [value] if isinstance(value, str) else value
    if stops is None:
        return ()
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise invalid("'stop' must be a string or a list of strings", "stop", "invalid_type")
    if len(stops) > MAX_STOP_STRINGS:
        raise invalid(f"'stop' may hold at most {MAX_STOP_STRINGS} strings", "stop")
    return tuple(s for s in stops if s)


def _parse_max_tokens(body: Mapping[str, Any]) -> int | None:
    newer = body.get("max_completion_tokens") is not None  # max_tokens is its deprecated alias
    name = "max_completion_tokens" if newer else "max_tokens"
    return _int_in(body, name, None, 1)


def _parse_include_usage(body: Mapping[str, Any], stream: bool) -> bool:
    options = _field(body, "stream_options", _is_object)
    if options is not None and not stream:
        raise invalid("'stream_options' is only allowed when 'stream' is enabled",
                      "stream_options")
    return _field(options or {}, "include_usage", _is_bool, False,
                  param="stream_options.include_usage")


# ---------------------------------------------------------------- chat completions


@dataclass(frozen=True)
class ChatCompletionRequest:
    model: str | None
    messages: list[dict[str, Any]]  # template-ready: content flattened, tool arguments as objects
    stream: bool
    include_usage: bool
    n: int
    max_tokens: int | None
    sampling: SamplingFields
    top_logprobs: int | None  # None = no logprobs; 0 = only the chosen token's
    tools: list[dict[str, Any]] | None  # what the template renders (after tool_choice)
    tool_choice: str  # none | auto | required (a named function is required + forced_tool)
    forced_tool: str | None
    parallel_tool_calls: bool
    template_kwargs: dict[str, Any]
    response_schema: str | None = None  # response_format's JSON schema (JSON text), if any


def parse_chat_request(body: dict[str, Any], *, default_temperature: float, vocab_size: int,
                       max_n: int) -> ChatCompletionRequest:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise invalid("'messages' must be a non-empty list of message objects", "messages",
                      "missing_required_parameter" if messages is None else "invalid_type")
    tools, tool_choice, forced_tool = _parse_tools(_with_legacy_functions(body))
    response_schema = parse_response_format(body.get("response_format"))
    max_tokens = _parse_max_tokens(body)
    stream = _field(body, "stream", _is_bool, False)
    return ChatCompletionRequest(
        model=_field(body, "model", _is_str),
        messages=[_parse_message(i, m) for i, m in enumerate(messages)],
        stream=stream,
        include_usage=_parse_include_usage(body, stream),
        n=_int_in(body, "n", 1, 1, max_n) or 1,
        max_tokens=max_tokens,
        sampling=parse_sampling(body, default_temperature, vocab_size, max_tokens),
        top_logprobs=_parse_chat_logprobs(body),
        tools=tools, tool_choice=tool_choice, forced_tool=forced_tool,
        parallel_tool_calls=_field(body, "parallel_tool_calls", _is_bool, True),
        template_kwargs=_parse_template_kwargs(body),
        response_schema=response_schema,
    )


def _parse_chat_logprobs(body: Mapping[str, Any]) -> int | None:
    wanted = _field(body, "logprobs", _is_bool, False)
    top = _int_in(body, "top_logprobs", None, 0, MAX_TOP_LOGPROBS)
    if top is not None and top > 0 and not wanted:
        raise invalid("'top_logprobs' requires 'logprobs': true", "top_logprobs")
    return (top or 0) if wanted else None


def parse_response_format(value: Any) -> str | None:
    """OpenAI's response_format → the JSON schema (as JSON text) the answer must follow, or None
    for free text: {"type": "text"}, {"type": "json_object"} (any JSON object) or
    {"type": "json_schema", "json_schema": {"name", "schema", "strict"}}."""
    if value is None:
        return None
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return json.dumps({"type": "object"})
    if kind != "json_schema":
        raise invalid("'response_format.type' must be 'text', 'json_object' or 'json_schema'",
                      "response_format")
    spec = value.get("json_schema")
    schema = spec.get("schema", {}) if isinstance(spec, dict) else None
    if not isinstance(schema, dict):
        raise invalid("'response_format.json_schema' must be an object whose 'schema' is a JSON "
                      "schema object", "response_format")
    try:
        return json.dumps(schema)
    except RecursionError:  # the body may nest deeper than json.dumps can go from here
        raise invalid("'response_format.json_schema.schema' is nested too deeply",
                      "response_format") from None


def _parse_template_kwargs(body: Mapping[str, Any]) -> dict[str, Any]:
    kwargs = dict(_field(body, "chat_template_kwargs", _is_object, {}))
    reserved = [k for k in kwargs if k in RESERVED_TEMPLATE_KWARGS]
    if reserved:
        raise invalid(f"chat_template_kwargs may not set {', '.join(reserved)}",
                      "chat_template_kwargs")
    if "enable_thinking" not in kwargs:
        thinking = _field(body, "enable_thinking", _is_bool)
        effort = _field(body, "reasoning_effort", _is_str)
        if thinking is None and effort == "none":
            thinking = False
        if thinking is not None:
            kwargs["enable_thinking"] = thinking
    return kwargs


def _parse_message(index: int, message: Any) -> dict[str, Any]:
    where = f"messages[{index}]"
    if not isinstance(message, dict):
        raise invalid(f"{where} must be an object", where, "invalid_type")
    role = message.get("role")
    if role not in ROLES:
        raise invalid(f"{where}.role must be one of {', '.join(ROLES)}", f"{where}.role")
    is_assistant = role == "assistant"
    out: dict[str, Any] = {
        "role": "system" if role == "developer" else role,
        "content": _flatten_content(message.get("content"), f"{where}.content", is_assistant),
    }
    name = _field(message, "name", _is_str, param=f"{where}.name")
    if name is not None:
        out["name"] = name
    if is_assistant:
        _add_assistant_fields(out, message, where)
    if role == "tool":
        out["tool_call_id"] = _field(message, "tool_call_id", _is_str,
                                     param=f"{where}.tool_call_id")
    return out


def _flatten_content(content: Any, where: str, may_be_null: bool) -> str:
    """A string or a list of text parts → one string (text parts joined by newlines)."""
    if isinstance(content, str):
        return content
    if content is None and may_be_null:
        return ""
    if not isinstance(content, list):
        raise invalid(f"{where} must be a string or a list of content parts", where, "invalid_type")
    texts = []
    for i, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        text = part.get("text", part.get("refusal")) if isinstance(part, dict) else None
        if kind not in ("text", "refusal", "input_text") or not isinstance(text, str):
            raise invalid(f"{where}[{i}] must be a text part "
                          "{\"type\": \"text\", \"text\": ...}; this model accepts text only",
                          f"{where}[{i}]")
        texts.append(text)
    return "\n".join(texts)


def _add_assistant_fields(out: dict[str, Any], message: Mapping[str, Any], where: str) -> None:
    reasoning = message.get("reasoning_content", message.get("reasoning"))
    if reasoning is not None:
        out["reasoning_content"] = _flatten_content(reasoning, f"{where}.reasoning_content", True)
    calls = message.get("tool_calls")
    if calls is not None:
        if not isinstance(calls, list):
            raise invalid(f"{where}.tool_calls must be a list", f"{where}.tool_calls",
                          "invalid_type")
        out["tool_calls"] = [_parse_history_call(c, f"{where}.tool_calls[{i}]")
                             for i, c in enumerate(calls)]


def _parse_history_call(call: Any, where: str) -> dict[str, Any]:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise invalid(f"{where} must be {{\"type\": \"function\", \"function\": {{\"name\", "
                      "\"arguments\"}}}}", where, "invalid_type")
    arguments = function.get("arguments", {})
    if not isinstance(arguments, (str, dict)):
        raise invalid(f"{where}.function.arguments must be a JSON string", where, "invalid_type")
    out = {"type": "function",
           "function": {"name": function["name"], "arguments": arguments_for_template(arguments)}}
    if isinstance(call.get("id"), str):
        out["id"] = call["id"]
    return out


def _with_legacy_functions(body: Mapping[str, Any]) -> Mapping[str, Any]:
    """The body with OpenAI's deprecated `functions` / `function_call` as `tools` / `tool_choice`
    (when the request has no `tools`): {"name": f} becomes a named function choice."""
    functions = body.get("functions")
    if functions is None or body.get("tools") is not None:
        return body
    if not isinstance(functions, list):
        raise invalid("'functions' must be a list of function definitions", "functions",
                      "invalid_type")
    call = body.get("function_call")
    choice = {"type": "function", "function": call} if isinstance(call, dict) else call
    return {**body, "tools": [{"type": "function", "function": f} for f in functions],
            "tool_choice": choice}


def _parse_tools(body: Mapping[str, Any]) -> tuple[list[dict[str, Any]] | None, str, str | None]:
    """(tools the template renders, tool_choice mode, forced function name); a named choice
    renders only that tool."""
    tools = body.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise invalid("'tools' must be a list of function tools", "tools", "invalid_type")
    tools = [_check_tool(i, t) for i, t in enumerate(tools or [])]
    choice = body.get("tool_choice")
    if choice is None:  # omitted or JSON null
        choice = "auto" if tools else "none"
    if isinstance(choice, str) and choice in TOOL_CHOICES:
        return (tools if choice != "none" and tools else None), _check_choice(choice, tools), None
    function = choice.get("function") if isinstance(choice, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str):
        raise invalid("'tool_choice' must be none, auto, required or "
                      "{\"type\": \"function\", \"function\": {\"name\": ...}}", "tool_choice")
    named = [t for t in tools if t["function"]["name"] == name]
    if not named:
        raise invalid(f"tool_choice names {name!r}, which is not in 'tools'", "tool_choice")
    return named, "required", name


def _check_choice(choice: str, tools: list[dict[str, Any]]) -> str:
    if choice == "required" and not tools:
        raise invalid("tool_choice 'required' needs a non-empty 'tools' list", "tool_choice")
    return choice


def _check_tool(index: int, tool: Any) -> dict[str, Any]:
    where = f"tools[{index}]"
    function = tool.get("function") if isinstance(tool, dict) else None
    if not isinstance(function, dict) or tool.get("type", "function") != "function":
        raise invalid(f"{where} must be {{\"type\": \"function\", \"function\": {{...}}}}", where,
                      "invalid_type")
    name = function.get("name")
    if not isinstance(name, str) or not name:
        raise invalid(f"{where}.function.name must be a non-empty string", f"{where}.function.name")
    if not isinstance(function.get("parameters", {}), dict):
        raise invalid(f"{where}.function.parameters must be a JSON Schema object",
                      f"{where}.function.parameters", "invalid_type")
    if not isinstance(function.get("description", ""), str):
        raise invalid(f"{where}.function.description must be a string",
                      f"{where}.function.description", "invalid_type")
    return {"type": "function", "function": function}


# ---------------------------------------------------------------- legacy completions


@dataclass(frozen=True)
class CompletionRequest:
    model: str | None
    prompts: list[str | list[int]]
    stream: bool
    include_usage: bool
    n: int
    max_tokens: int
    sampling: SamplingFields
    top_logprobs: int | None
    echo: bool
    suffix: str | None = None  # fill-in-the-middle: the text after the completion
    response_schema: str | None = None  # response_format's JSON schema (JSON text), if any

    @property
    def prompt_logprobs(self) -> int | None:
        """echo with logprobs returns the prompt tokens' logprobs too (OpenAI's legacy API)."""
        return self.top_logprobs if self.echo else None


def parse_completion_request(body: dict[str, Any], *, default_temperature: float, vocab_size: int,
                             max_n: int) -> CompletionRequest:
    prompts = _parse_prompts(body.get("prompt"), vocab_size)
    n = _int_in(body, "n", 1, 1, max_n) or 1
    if len(prompts) * n > max_n:
        raise invalid(f"prompts × n may be at most {max_n}", "n")
    best_of = _field(body, "best_of", _is_int)
    if best_of is not None and best_of != n:
        raise invalid("'best_of' other than n is not supported", "best_of", "unsupported_value")
    suffix = _field(body, "suffix", _is_str)
    if suffix is not None and not all(isinstance(p, str) for p in prompts):
        raise invalid("'suffix' needs text prompts (the prefix to fill after)", "suffix")
    echo = _field(body, "echo", _is_bool, False)
    if suffix is not None and echo:
        raise invalid("'suffix' and 'echo' cannot be used together", "suffix")
    # NOTE: OpenAI's legacy API takes max_tokens 0 with echo: score the prompt, generate nothing
    max_tokens = _int_in(body, "max_tokens", 16, 0 if echo else 1)
    max_tokens = 16 if max_tokens is None else max_tokens
    stream = _field(body, "stream", _is_bool, False)
    return CompletionRequest(
        model=_field(body, "model", _is_str), prompts=prompts,
        stream=stream, include_usage=_parse_include_usage(body, stream),
        n=n, max_tokens=max_tokens,
        sampling=parse_sampling(body, default_temperature, vocab_size, max_tokens),
        top_logprobs=_int_in(body, "logprobs", None, 0, MAX_TOP_LOGPROBS),
        echo=echo, suffix=suffix,
        response_schema=parse_response_format(body.get("response_format")),
    )


def _parse_prompts(prompt: Any, vocab_size: int) -> list[str | list[int]]:
    """str | [str] | [int] | [[int]] → a list of prompts (text or token ids)."""
    if isinstance(prompt, str):
        return [prompt]
    if isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt):
        return [_check_ids(prompt, vocab_size)]
    if isinstance(prompt, list) and prompt and all(isinstance(p, str) or _is_id_list(p)
                                                   for p in prompt):
        return [p if isinstance(p, str) else _check_ids(p, vocab_size) for p in prompt]
    raise invalid("'prompt' must be a string, a list of strings, a list of token ids or a list of "
                  "token-id lists (non-empty)", "prompt",
                  "missing_required_parameter" if prompt is None else "invalid_type")


def _is_id_list(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(_is_int(t) for t in value)


def _check_ids(ids: list[Any], vocab_size: int) -> list[int]:
    if not all(_is_int(t) and 0 <= t < vocab_size for t in ids):
        raise invalid(f"prompt token ids must be integers in [0, {vocab_size})", "prompt")
    return ids


# ---------------------------------------------------------------- tokenize


def parse_tokenize_request(body: dict[str, Any]) -> str | None:
    """The raw text to tokenize ('content' or 'prompt'), or None for a chat body ('messages')."""
    for key in ("content", "prompt"):
        if key in body:
            return _field(body, key, _is_str, "")
    return None
