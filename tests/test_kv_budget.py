"""The server's memory plan for hybrid models: the recurrent-state slots (one per sequence and
the prefix cache's snapshots) come out of the memory before the KV pool is sized."""

from __future__ import annotations

from pathlib import Path

import pytest

from sparkinfer_cli import kv_budget
from sparkinfer_cli.gguf.reader import GGUFFile
from sparkinfer_cli.model.config import ModelConfig

TINY = Path(__file__).parent / "fixtures" / "tiny"


@pytest.fixture(scope="module")
def hybrid() -> ModelConfig:
    return ModelConfig.from_gguf(GGUFFile(TINY / "qwen35moe" / "qwen35moe-Q8_0.gguf"))


def test_state_slots_follow_the_prefix_cache_settings(hybrid):
    one = hybrid.recurrent_state_bytes()
    assert kv_budget.state_pool_bytes(hybrid, {}) == (64 + 64) * one
    assert kv_budget.state_pool_bytes(hybrid, {"SPARKINFER_PREFIX_CACHE": "0"}) == 64 * one
    assert kv_budget.state_pool_bytes(
        hybrid, {"SPARKINFER_PREFIX_CACHE_SNAPSHOTS": "8",
                 "SPARKINFER_SERVER_PREFIX_TOKEN_IDS": "1,2,3"}) == (64 + 8 + 1) * one
    dense = ModelConfig.from_gguf(GGUFFile(TINY / "qwen3" / "qwen3-Q8_0.gguf"))
    assert kv_budget.state_pool_bytes(dense, {}) == 0


def test_speculation_doubles_the_running_state_slots_as_the_engine_does(hybrid):
    """A sequence that checks drafts keeps a copy of its state: the budget counts the slots the
    engine's KV manager then allocates, from the environment or from serve's flags."""
    from sparkinfer_cli.engine.config import EngineConfig
    from sparkinfer_cli.engine.kv_cache import KVCacheManager

    one = hybrid.recurrent_state_bytes()
    assert kv_budget.state_pool_bytes(hybrid, {"SPARKINFER_SPEC_TOKENS": "4"}) == \
        kv_budget.state_pool_bytes(hybrid, {}, spec_tokens=4) == (2 * 64 + 64) * one
    assert kv_budget.state_pool_bytes(hybrid, {"SPARKINFER_SPEC_TOKENS": "4"},
                                      spec_tokens=0) == (64 + 64) * one
    config = EngineConfig(ctx=4096, spec_tokens=4)
    manager = KVCacheManager.from_config(config, True, draft_slots=True)
    assert manager.num_state_slots == config.num_state_slots(True) == 2 * 64 + 64


def test_every_draft_of_a_step_has_a_state_slot_up_to_the_cuda_check_s_size():
    """A hybrid model keeps the state after each checked row: the running slots hold one a
    draft of every sequence (up to what a CUDA check holds), and at least one a sequence."""
    from sparkinfer_cli.engine.config import MAX_DRAFT_STATES, EngineConfig

    for seqs, spec, drafts in ((1, 3, 3), (4, 3, 12), (6, 4, MAX_DRAFT_STATES), (64, 4, 64)):
        config = EngineConfig(ctx=4096, max_num_seqs=seqs, spec_tokens=spec)
        assert config.num_seq_slots(True, True) == seqs + drafts
        assert config.num_seq_slots(True, False) == seqs and config.num_seq_slots(False, True) == 0


def test_the_kv_pool_is_sized_after_the_state_slots(hybrid, monkeypatch):
    """Memory that holds the asked-for pool beside the weights alone, but not beside the state
    slots too, refuses it; with fewer snapshots it fits again."""
    ctx, weights = 4096, 1 << 20
    pool = ctx * hybrid.kv_bytes_per_token(1) * kv_budget.kv_bytes_per_value("cpu")
    states = kv_budget.state_pool_bytes(hybrid, {})
    memory = weights + 2 * pool + states // 2  # KV may take half of what is left
    monkeypatch.setattr(kv_budget, "available_memory_bytes", lambda device: memory)
    with pytest.raises(ValueError, match="recurrent state"):
        kv_budget.fit_kv_pool(hybrid, ctx, "cpu", weights, {})
    fewer = {"SPARKINFER_PREFIX_CACHE": "0"}  # half the slots
    assert kv_budget.fit_kv_pool(hybrid, ctx, "cpu", weights, fewer).ctx == ctx


def test_a_draft_model_counts_its_weights_and_its_kv(monkeypatch):
    """A pool that fits beside the model alone is refused beside a draft model's weights, and
    the trained context is capped to what fits once the draft's KV shares every token."""
    target = ModelConfig.from_gguf(GGUFFile(TINY / "qwen3moe" / "qwen3moe-Q8_0.gguf"))
    draft = kv_budget.DraftFit(ModelConfig.from_gguf(GGUFFile(TINY / "qwen3" / "qwen3-Q8_0.gguf")),
                               64 << 20)
    ctx, weights = 4096, 1 << 20
    per_value = kv_budget.kv_bytes_per_value("cpu")
    pool = ctx * target.kv_bytes_per_token(1) * per_value
    memory = weights + 2 * pool + (1 << 20)
    monkeypatch.setattr(kv_budget, "available_memory_bytes", lambda device: memory)
    assert kv_budget.fit_kv_pool(target, ctx, "cpu", weights, {}).ctx == ctx
    with pytest.raises(ValueError, match="ask for fewer tokens"):
        kv_budget.fit_kv_pool(target, ctx, "cpu", weights, {}, draft=draft)
    monkeypatch.setattr(kv_budget, "available_memory_bytes",
                        lambda device: memory + draft.weights_bytes)
    capped = kv_budget.fit_kv_pool(target, None, "cpu", weights, {}, draft=draft).ctx
    both = (target.kv_bytes_per_token(1) + draft.config.kv_bytes_per_token(1)) * per_value
    assert capped is not None and capped * both <= pool + (1 << 19) < (capped + 16) * both


def test_an_mtp_head_counts_its_layer_kv_and_a_head_files_weights(tmp_path, monkeypatch):
    """serve's preflight: the head's one attention layer takes a KV entry per pool token beside
    the model's (a pool that fits the model's alone is refused), and a head-only file's bytes
    count as weights; a head inside the model file adds none (the file's bytes hold it)."""
    import dataclasses

    from sparkinfer_cli.app import preflight
    from sparkinfer_cli.gguf.synthetic import PRESETS, write_synthetic
    from sparkinfer_cli.server.config import Speculation

    model = write_synthetic(tmp_path / "model.gguf", "tiny-qwen35moe-mtp")
    head_only = write_synthetic(tmp_path / "head.gguf", dataclasses.replace(
        PRESETS["tiny-qwen35moe-mtp"], head_only=True))
    checked = preflight.check_model_file(model, {})
    inside, beside = preflight.check_mtp(checked, None), preflight.check_mtp(checked, head_only)
    assert inside.weights_bytes == 0 and beside.weights_bytes == GGUFFile(head_only).n_bytes
    assert inside.config.kv_bytes_per_token(1) == \
        checked.config.kv_bytes_per_token(1) // len(checked.config.attention_layers)
    ctx, weights = 4096, GGUFFile(model).n_bytes
    pool = ctx * checked.config.kv_bytes_per_token(1) * kv_budget.kv_bytes_per_value("cpu")
    memory = weights + 2 * pool + kv_budget.state_pool_bytes(checked.config, {}, 3) + 1024
    monkeypatch.setattr(kv_budget, "available_memory_bytes", lambda device: memory)
    assert kv_budget.fit_kv_pool(checked.config, ctx, "cpu", weights, {}, 3).ctx == ctx
    with pytest.raises(ValueError, match="ask for fewer tokens"):
        preflight.check_serve(model, "127.0.0.1", 0, ctx, "cpu", {},
                              speculation=Speculation(3, None, mtp=True))
