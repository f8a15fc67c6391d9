"""Chat templates rendered byte-identically to transformers' apply_chat_template (goldens)."""

from __future__ import annotations

import json
from datetime import datetime

import pytest
from shared_tokenizers import FIXTURES, real_goldens, tokenizer_from_gguf

from sparkinfer_cli.tokenizer.chat_template import ChatTemplate, ChatTemplateError

GOLDENS = json.loads((FIXTURES / "chat" / "chat_template_goldens.json").read_text("utf-8"))
# the goldens were rendered with the npm Qwen3 tokenizer: no BOS, eos <|im_end|>
TEMPLATES = {name: ChatTemplate(t["text"], bos_token=None, eos_token="<|im_end|>")
             for name, t in GOLDENS["templates"].items()}


def _case_id(case: dict) -> str:
    kwargs = ",".join(f"{k}={v}" for k, v in case["kwargs"].items())
    return f"{case['template']}-{case['conversation']}-{kwargs}"


@pytest.mark.parametrize("case", GOLDENS["cases"], ids=_case_id)
def test_golden_rendering(case):
    conversation = GOLDENS["conversations"][case["conversation"]]
    template = TEMPLATES[case["template"]]

    def render() -> str:
        return template.render(conversation["messages"], tools=conversation.get("tools"),
                               **case["kwargs"])

    if case["ok"]:
        assert render() == case["rendered"]
    else:
        with pytest.raises(ChatTemplateError) as err:
            render()
        assert str(err.value) == case["error"]


def test_golden_set_is_complete():
    assert len(GOLDENS["cases"]) == 220
    assert sum(not c["ok"] for c in GOLDENS["cases"]) == 8


def test_gguf_template_renders_the_real_prompts(demo_model_path):
    tok = tokenizer_from_gguf(demo_model_path("qwen2.5-coder-0.5b"))
    template = ChatTemplate.from_tokenizer(tok)
    assert template.source == GOLDENS["templates"]["qwen2.5-coder-gguf"]["text"]
    prompt = real_goldens("qwen25coder")["prompts"][0]  # Qwen's default system prompt is added
    text = template.render([{"role": "user",
                             "content": "Write a Python function to check if a number is prime."}])
    assert text == prompt["text"]
    assert tok.encode(text) == prompt["prompt_ids"]


def test_smollm_template_renders_the_real_prompt(demo_model_path):
    tok = tokenizer_from_gguf(demo_model_path("smollm2-135m"))
    prompt = real_goldens("smollm2")["prompts"][0]
    text = ChatTemplate.from_tokenizer(tok).render(
        [{"role": "user", "content": "What is the capital of France?"}])
    assert text == prompt["text"]


def test_chatml_fallback_without_template():
    template = ChatTemplate(None)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": None}]
    assert template.render(messages, add_generation_prompt=False) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\n<|im_end|>\n")
    assert template.render(messages[:2]).endswith("<|im_start|>user\nHi<|im_end|>\n"
                                                  "<|im_start|>assistant\n")


def test_template_errors_are_clear():
    with pytest.raises(ChatTemplateError, match="syntax error at line 2"):
        ChatTemplate("{% for m in messages %}\n{% endif %}")
    with pytest.raises(ChatTemplateError) as err:
        ChatTemplate("{{ raise_exception('Conversation roles must alternate.') }}").render([])
    assert str(err.value) == "Conversation roles must alternate."
    with pytest.raises(ChatTemplateError, match="No user query found in messages."):
        TEMPLATES["qwen3.5"].render([{"role": "system", "content": "x"}])


def test_environment_features():
    template = ChatTemplate(
        "{{ x | tojson }}|{{ x | tojson(indent=1) | length > 20 }}|{{ strftime_now('%Y') }}|"
        "{% for i in [1, 2, 3] %}{% if i == 2 %}{% continue %}{% endif %}{{ i }}{% endfor %}|"
        "{% generation %}{{ eos_token }}{% endgeneration %}|{{ bos_token is defined }}",
        eos_token="<|im_end|>")
    # tojson keeps non-ASCII and does not HTML-escape, unlike Jinja's built-in filter
    assert template.render([], x={"a": "<é>"}) == (
        f'{{"a": "<é>"}}|False|{datetime.now().year}|13|<|im_end|>|False')


def test_sandbox_refuses_mutation():
    with pytest.raises(ChatTemplateError, match="SecurityError"):
        ChatTemplate("{{ messages.append(1) }}").render([])
