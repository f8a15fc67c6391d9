"""`sparkinfer inspect`: what a GGUF file holds and how much memory serving it takes.

build_report() returns plain JSON-serialisable data (the CLI's --json prints it as is);
render_report() draws the same data as rich tables. A well-formed file the engine cannot use
(missing key, unsupported architecture, tensors or tokenizer that do not fit) still gets a report:
what cannot be derived is None and the reason is in report["engine_error"] and its warnings. A
malformed one (hostile counts or values) is a GGUFError.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from sparkinfer_cli.app.preflight import check_loadable
from sparkinfer_cli.gguf.reader import GGUFError, GGUFFile, UnusableModelError
from sparkinfer_cli.kv_budget import kv_bytes_per_value, kv_cache_type, state_pool_bytes
from sparkinfer_cli.model.config import ModelConfig
from sparkinfer_cli.tokenizer.tokenizer import check_metadata_types
from sparkinfer_cli.units import format_bytes, format_count


def build_report(gguf: GGUFFile, ctx: int | None = None, device: str = "cuda") -> dict[str, Any]:
    """device: whose KV cache the memory estimate counts (kv_budget.kv_cache_type). Raises
    GGUFError for a malformed file (hostile counts, impossible values), which has nothing
    trustworthy to report."""
    if ctx is not None and ctx < 1:
        raise ValueError(f"ctx must be at least 1, got {ctx}")
    warnings: list[str] = []
    config, engine_error = _config_and_engine_error(gguf)
    if engine_error:
        warnings.append(f"the engine cannot use this file: {engine_error}")
    if gguf.get(f"{gguf.get('general.architecture')}.context_length") is None:
        warnings.append("metadata has no context_length"
                        + (f"; assuming {config.context_length}" if config else ""))
    return {
        "file": {"path": str(gguf.path.resolve()), "size_bytes": gguf.n_bytes,
                 "tensors": len(gguf.tensors), "metadata_keys": len(gguf.metadata)},
        "model": model_section(gguf, config),
        "quantization": quant_histogram(gguf),
        "tokenizer": tokenizer_section(gguf),
        "chat_template": _chat_template_section(gguf),
        "memory": memory_section(gguf, config, ctx, device),
        "warnings": warnings,
        "engine_error": engine_error,  # why generate / serve would refuse the file, or None
    }


def _config_and_engine_error(gguf: GGUFFile) -> tuple[ModelConfig | None, str | None]:
    """The config when the metadata yields one, and the first reason the engine cannot run the
    file: unsupported or missing metadata, a tensor table, tokenizer or template that does not
    fit it."""
    check_metadata_types(gguf)  # a malformed tokenizer is refused, as malformed metadata is
    try:
        config = ModelConfig.from_gguf(gguf)
    except UnusableModelError as exc:
        return None, str(exc)
    try:
        check_loadable(gguf)
    except GGUFError as exc:
        return config, str(exc)
    return config, None


# ---- sections ----------------------------------------------------------------------------------
def model_section(gguf: GGUFFile, config: ModelConfig | None) -> dict[str, Any]:
    arch = gguf.get("general.architecture")
    file_type = gguf.typed("general.file_type", int)
    section = {
        "architecture": arch,
        "name": gguf.get("general.name"),
        "size_label": gguf.get("general.size_label"),
        "file_type": _file_type_name(file_type) if file_type is not None else None,
        "parameters": sum(t.n_elements for t in gguf.tensors.values()),
        "context_length": gguf.get(f"{arch}.context_length"),
        "mtp_head": mtp_head(gguf),
    }
    section.update(_structure_from_config(config) if config else _structure_from_metadata(gguf))
    return section


def mtp_head(gguf: GGUFFile) -> dict[str, int] | None:
    """The multi-token-prediction layers a file carries beside its trunk, as llama.cpp's
    converter writes them (`{arch}.nextn_predict_layers`, `blk.N.nextn.*` tensors): a draft
    source for speculative decoding (--spec-type mtp, Qwen3.5 / Qwen3.6 files). None without."""
    layers = gguf.typed(f"{gguf.get('general.architecture')}.nextn_predict_layers", int) or 0
    tensors = sum(".nextn." in name for name in gguf.tensors)
    return {"layers": layers, "tensors": tensors} if layers or tensors else None


def _structure_from_config(c: ModelConfig) -> dict[str, Any]:
    return {
        "layers": c.n_layer,
        "attention_layers": len(c.attention_layers),
        "recurrent_layers": len(c.recurrent_layer_ids),  # Gated-DeltaNet
        "embedding_length": c.n_embd,
        "feed_forward_length": c.n_ff or None,
        "heads": c.n_head, "kv_heads": c.n_head_kv, "head_dim": c.head_dim,
        "vocab_size": c.n_vocab,
        "experts": {"count": c.n_expert, "used": c.n_expert_used, "expert_ff": c.n_ff_exp,
                    "shared_ff": c.n_ff_shexp or None} if c.is_moe else None,
    }


def _structure_from_metadata(gguf: GGUFFile) -> dict[str, Any]:
    """What the metadata declares, for files ModelConfig cannot read."""
    arch = gguf.get("general.architecture")

    def key(suffix: str) -> Any:
        return gguf.get(f"{arch}.{suffix}")

    count = key("expert_count")
    return {
        "layers": key("block_count"), "attention_layers": None, "recurrent_layers": None,
        "embedding_length": key("embedding_length"),
        "feed_forward_length": key("feed_forward_length"),
        "heads": key("attention.head_count"), "kv_heads": key("attention.head_count_kv"),
        "head_dim": key("attention.key_length"),
        "vocab_size": len(gguf.get("tokenizer.ggml.tokens") or []) or None,
        "experts": {"count": count, "used": key("expert_used_count"),
                    "expert_ff": key("expert_feed_forward_length"),
                    "shared_ff": key("expert_shared_feed_forward_length")} if count else None,
    }


def _file_type_name(file_type: int) -> str:
    """llama.cpp's name of the file's main quant mix, e.g. Q4_K_M."""
    from gguf import LlamaFileType  # here, not at the top: importing gguf takes ~0.5 s

    try:
        return LlamaFileType(file_type).name.removeprefix("MOSTLY_")
    except ValueError:
        return f"unknown file type {file_type}"


def quant_histogram(gguf: GGUFFile) -> list[dict[str, Any]]:
    """Per ggml type: tensors, elements and bytes; the heaviest type first."""
    rows: dict[str, dict[str, Any]] = defaultdict(
        lambda: {"type": "", "tensors": 0, "elements": 0, "bytes": 0})
    for t in gguf.tensors.values():
        row = rows[t.type_name]
        row["type"] = t.type_name
        row["tensors"] += 1
        row["elements"] += t.n_elements
        row["bytes"] += t.n_bytes
    return sorted(rows.values(), key=lambda r: (-r["bytes"], r["type"]))


def tokenizer_section(gguf: GGUFFile) -> dict[str, Any]:
    tokens = gguf.typed_list("tokenizer.ggml.tokens", str) or []
    bos = gguf.typed("tokenizer.ggml.bos_token_id", int)
    eos = gguf.typed("tokenizer.ggml.eos_token_id", int)

    def text(token_id: int | None) -> str | None:
        return tokens[token_id] if token_id is not None and 0 <= token_id < len(tokens) else None

    return {"model": gguf.get("tokenizer.ggml.model"), "pre": gguf.get("tokenizer.ggml.pre"),
            "vocab_size": len(tokens), "bos_id": bos, "bos_token": text(bos),
            "eos_id": eos, "eos_token": text(eos)}


def _chat_template_section(gguf: GGUFFile) -> dict[str, Any]:
    template = gguf.typed("tokenizer.chat_template", str)
    return {"present": isinstance(template, str), "length": len(template or "")}


def memory_section(gguf: GGUFFile, config: ModelConfig | None, ctx: int | None,
                   device: str) -> dict[str, Any]:
    """Weights + the device's KV cache for `ctx` tokens (default: the trained context) + the
    state slots of a hybrid model."""
    weights = sum(t.n_bytes for t in gguf.tensors.values())
    kv_type = kv_cache_type(device)
    if config is None:
        return {"ctx": ctx, "weights_bytes": weights, "kv_cache_type": kv_type,
                "kv_bytes_per_token": None, "kv_cache_bytes": None,
                "recurrent_state_bytes": None, "total_bytes": weights}
    ctx = config.context_length if ctx is None else ctx
    per_token = config.kv_bytes_per_token(kv_bytes_per_value(device))
    state = config.recurrent_state_bytes() if config.is_hybrid else 0
    state_pool = state_pool_bytes(config)
    return {"ctx": ctx, "weights_bytes": weights, "kv_cache_type": kv_type,
            "kv_bytes_per_token": per_token,
            "kv_cache_bytes": per_token * ctx, "recurrent_state_bytes": state,
            "state_pool_bytes": state_pool,
            "total_bytes": weights + per_token * ctx + state_pool}


# ---- rendering ---------------------------------------------------------------------------------
def render_report(report: dict[str, Any], console: Console) -> None:
    f, m = report["file"], report["model"]
    console.print(f"[bold]{escape(f['path'])}[/]  {format_bytes(f['size_bytes'])}, "
                  f"{f['tensors']} tensors, {f['metadata_keys']} metadata keys")
    console.print(_key_value_table("Model", _model_rows(m)))
    console.print(_quant_table(report["quantization"]))
    console.print(_key_value_table("Tokenizer", _tokenizer_rows(report)))
    console.print(_key_value_table("Memory", _memory_rows(report["memory"])))
    for warning in report["warnings"]:
        console.print(f"[yellow]warning:[/] {escape(warning)}")


def _key_value_table(title: str, rows: list[tuple[str, str]]) -> Table:
    table = Table(title=title, title_justify="left", show_header=False, box=None, padding=(0, 2))
    table.add_column(style="cyan")
    table.add_column()
    for name, value in rows:
        table.add_row(name, value)
    return table


def _model_rows(m: dict[str, Any]) -> list[tuple[str, str]]:
    rows = [("architecture", _text(m["architecture"])), ("name", _text(m["name"])),
            ("file type", _text(m["file_type"])),
            ("parameters", f"{format_count(m['parameters'])} ({m['parameters']:,})"),
            ("context length", _text(m["context_length"])), ("layers", _layers_text(m)),
            ("embedding", _text(m["embedding_length"])),
            ("feed forward", _text(m["feed_forward_length"])),
            ("heads / kv heads / head dim",
             f"{_text(m['heads'])} / {_text(m['kv_heads'])} / {_text(m['head_dim'])}"),
            ("vocabulary", _text(m["vocab_size"]))]
    if e := m["experts"]:
        rows.append(("experts", f"{_text(e['count'])} ({_text(e['used'])} used), expert ff "
                                f"{_text(e['expert_ff'])}, shared ff {_text(e['shared_ff'])}"))
    mtp = m["mtp_head"]
    rows.append(("MTP head", "none" if mtp is None else
                 f"{mtp['layers']} layer(s), {mtp['tensors']} tensors (--spec-type mtp drafts "
                 "with it)"))
    return rows


def _layers_text(m: dict[str, Any]) -> str:
    if not m["recurrent_layers"]:
        return _text(m["layers"])
    return (f"{m['layers']} ({m['attention_layers']} attention, "
            f"{m['recurrent_layers']} Gated-DeltaNet)")


def _quant_table(rows: list[dict[str, Any]]) -> Table:
    total = sum(r["bytes"] for r in rows) or 1
    table = Table(title="Tensor types", title_justify="left", box=None, padding=(0, 2))
    for name in ("type", "tensors", "elements", "bytes", "share"):
        table.add_column(name, justify="left" if name == "type" else "right")
    for r in rows:
        table.add_row(r["type"], str(r["tensors"]), format_count(r["elements"]),
                      format_bytes(r["bytes"]), f"{100 * r['bytes'] / total:.1f}%")
    return table


def _tokenizer_rows(report: dict[str, Any]) -> list[tuple[str, str]]:
    t, c = report["tokenizer"], report["chat_template"]
    return [("model / pre", f"{_text(t['model'])} / {_text(t['pre'])}"),
            ("vocabulary", str(t["vocab_size"])),
            ("bos", _special_token_text(t["bos_id"], t["bos_token"])),
            ("eos", _special_token_text(t["eos_id"], t["eos_token"])),
            ("chat template", f"yes ({c['length']:,} chars)" if c["present"] else "no")]


def _special_token_text(token_id: int | None, text: str | None) -> str:
    return f"{token_id} {escape(repr(text))}" if text else "-"


def _memory_rows(mem: dict[str, Any]) -> list[tuple[str, str]]:
    rows = [("weights", format_bytes(mem["weights_bytes"]))]
    if mem["kv_cache_bytes"] is not None:
        rows.append((f"KV cache, {mem['ctx']:,} tokens ({mem['kv_cache_type']})",
                     f"{format_bytes(mem['kv_cache_bytes'])} "
                     f"({format_bytes(mem['kv_bytes_per_token'])}/token)"))
    if mem["recurrent_state_bytes"]:
        rows.append(("recurrent state / sequence", format_bytes(mem["recurrent_state_bytes"])))
        rows.append(("state slots (sequences + prefix-cache snapshots)",
                     format_bytes(mem["state_pool_bytes"])))
    rows.append(("total", format_bytes(mem["total_bytes"])))
    return rows


def _text(value: Any) -> str:
    """A metadata value as a table cell (escaped: a file's strings are not rich markup)."""
    return "-" if value is None else escape(str(value))
