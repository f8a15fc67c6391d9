"""env.py parsing, ServerConfig.from_env, build_engine_config: seed variables reach their fields."""

from __future__ import annotations

import json

import pytest

from sparkinfer_cli import env
from sparkinfer_cli.server.config import ServerConfig, build_engine_config

SEED_VARIABLES = {  # the seed README's Env tables
    "SPARKINFER_ROOT", "CTX", "SPARKINFER_KV_INT8", "SPARKINFER_TOKENIZER_URL",
    "SPARKINFER_SERVER_PREFIX_TOKEN_FILE", "SPARKINFER_SERVER_PREFIX_TOKEN_IDS",
    "SPARKINFER_PREFILL_BATCHED", "SPARKINFER_MAX_OUTPUT_TOKENS", "SPARKINFER_MAX_QUEUE_DEPTH",
    "SPARKINFER_REQUEST_TIMEOUT_S", "SPARKINFER_READ_TIMEOUT_S", "SPARKINFER_WRITE_TIMEOUT_S",
    "SPARKINFER_BATCH_TOKENS", "SPARKINFER_SCHED_POLICY", "SPARKINFER_PREFILL_CHUNK_TOKENS",
    "SPARKINFER_PREFILL_MIX_MAX", "SPARKINFER_SHUTDOWN_GRACE_S", "SPARKINFER_API_KEY", "HOST",
}


def test_every_seed_variable_is_declared() -> None:
    assert SEED_VARIABLES <= {v.name for v in env.ALL_VARS}


@pytest.mark.parametrize("var, raw, expected", [
    (env.SPARKINFER_PREFILL_BATCHED, "0", False),
    (env.SPARKINFER_PREFILL_BATCHED, "Yes", True),
    (env.SPARKINFER_KV_INT8, "", None),
    (env.SPARKINFER_SCHED_POLICY, " Chunked ", "chunked"),
    (env.SPARKINFER_SERVER_PREFIX_TOKEN_IDS, "1, 2,3,", (1, 2, 3)),
    (env.SPARKINFER_REQUEST_TIMEOUT_S, "2.5", 2.5),
    (env.PORT, "9000", 9000),
    (env.CTX, "0", 0),
])
def test_values_parse(var: env.EnvVar, raw: str, expected) -> None:
    assert var.get({var.name: raw}) == expected


@pytest.mark.parametrize("var, raw", [
    (env.SPARKINFER_PREFILL_BATCHED, "maybe"), (env.SPARKINFER_SCHED_POLICY, "fifo"),
    (env.SPARKINFER_BATCH_TOKENS, "0"), (env.SPARKINFER_MAX_QUEUE_DEPTH, "-1"),
    (env.SPARKINFER_REQUEST_TIMEOUT_S, "nan"), (env.PORT, "70000"), (env.CTX, "lots"),
    (env.SPARKINFER_SERVER_PREFIX_TOKEN_IDS, "1,-2"),
    (env.SPARKINFER_STEP_TRACE, "/no/such/folder/steps.jsonl"),
])
def test_bad_values_name_the_variable(var: env.EnvVar, raw: str) -> None:
    with pytest.raises(env.EnvError, match=var.name):
        var.get({var.name: raw})


def test_a_step_trace_goes_to_a_file_in_an_existing_folder(tmp_path) -> None:
    path = tmp_path / "steps.jsonl"
    var = env.SPARKINFER_STEP_TRACE
    assert var.get({var.name: str(path)}) == str(path) and not path.exists()
    assert var.get({}) == ""


def test_prefix_tokens_from_file_or_ids(tmp_path) -> None:
    path = tmp_path / "prefix.json"
    path.write_text(json.dumps([5, 6, 7]))
    assert env.prefix_token_ids({"SPARKINFER_SERVER_PREFIX_TOKEN_FILE": str(path)}) == (5, 6, 7)
    relative = {"SPARKINFER_SERVER_PREFIX_TOKEN_FILE": "prefix.json",
                "SPARKINFER_ROOT": str(tmp_path)}  # relative paths start at SPARKINFER_ROOT
    assert env.prefix_token_ids(relative) == (5, 6, 7)
    assert env.prefix_token_ids({"SPARKINFER_SERVER_PREFIX_TOKEN_IDS": "9,8"}) == (9, 8)
    with pytest.raises(env.EnvError, match="not both"):
        env.prefix_token_ids({"SPARKINFER_SERVER_PREFIX_TOKEN_FILE": str(path),
                              "SPARKINFER_SERVER_PREFIX_TOKEN_IDS": "1"})
    path.write_text('{"ids": [1]}')
    with pytest.raises(env.EnvError, match="JSON list"):
        env.prefix_token_ids({"SPARKINFER_SERVER_PREFIX_TOKEN_FILE": str(path)})


def test_server_config_from_env_then_overrides() -> None:
    environ = {"HOST": "0.0.0.0", "PORT": "9001", "SPARKINFER_API_KEY": "k",
               "SPARKINFER_MAX_OUTPUT_TOKENS": "77", "SPARKINFER_REQUEST_TIMEOUT_S": "3",
               "SPARKINFER_SHUTDOWN_GRACE_S": "4", "SPARKINFER_READ_TIMEOUT_S": "5",
               "SPARKINFER_WRITE_TIMEOUT_S": "6"}
    config = ServerConfig.from_env(environ, port=9002, api_key=None)
    assert (config.host, config.port, config.api_key) == ("0.0.0.0", 9002, "k")
    assert (config.max_output_tokens, config.request_timeout_s, config.shutdown_grace_s) == \
        (77, 3.0, 4.0)
    assert (config.read_timeout_s, config.write_timeout_s) == (5.0, 6.0)
    with pytest.raises(ValueError, match="api_key"):
        ServerConfig(api_key="")


def test_engine_config_from_env_and_ctx_rules() -> None:
    environ = {"CTX": "8192", "SPARKINFER_BATCH_TOKENS": "32",
               "SPARKINFER_SCHED_POLICY": "priority",
               "SPARKINFER_PREFILL_CHUNK_TOKENS": "128", "SPARKINFER_PREFILL_MIX_MAX": "0",
               "SPARKINFER_PREFILL_BATCHED": "0", "SPARKINFER_MAX_QUEUE_DEPTH": "3",
               "SPARKINFER_MAX_OUTPUT_TOKENS": "100", "SPARKINFER_REQUEST_TIMEOUT_S": "9",
               "SPARKINFER_SERVER_PREFIX_TOKEN_IDS": "1,2", "SPARKINFER_DECODE_STEPS": "3"}
    config = build_engine_config(None, 32768, environ)
    assert (config.ctx, config.max_batch_tokens, config.sched_policy) == (8192, 32, "priority")
    assert (config.prefill_chunk_tokens, config.prefill_mix_max, config.prefill_batched) == \
        (128, 0, False)
    assert (config.max_queue_depth, config.max_output_tokens, config.request_timeout_s) == \
        (3, 100, 9.0)
    assert config.prefix_token_ids == (1, 2) and config.decode_steps == 3
    assert build_engine_config(None, 32768, {}).decode_steps == 8
    assert build_engine_config(1024, 32768, environ).ctx == 1024  # --ctx beats CTX
    assert build_engine_config(0, 32768, {}).ctx == 32768  # 0 = the model's own context
    assert build_engine_config(None, 32768, {}).ctx == 32768  # unset: the model's own context


def test_spec_tokens_reach_the_engine_and_bad_values_name_the_variable() -> None:
    assert build_engine_config(None, 4096, {"SPARKINFER_SPEC_TOKENS": "4"}).spec_tokens == 4
    assert build_engine_config(None, 4096, {}).spec_tokens == 0
    with pytest.raises(env.EnvError, match="SPARKINFER_SPEC_TOKENS"):
        build_engine_config(None, 4096, {"SPARKINFER_SPEC_TOKENS": "9"})
