"""What the chunked Gated DeltaNet kernels' f16 operands do to a model's logits, without a GPU:
the CPU model's prefill with its delta rule replaced by a float32 emulation of the CUDA
kernels' chunked algorithm (gated_delta_chunked: [K; Q]·Kᵀ, T = (I + A)⁻¹ in float32, [W | U] =
T·[β e^G K | β V], V' = U − W·S, the outputs and the state update), each product's operands
rounded to f16 as the kernels stage them, or not, product by product.

    python bench/probes/gdn_rounding_emulation.py [--model GGUF] [--tokens 300,700]
        [--round kq,wy_t,wy_k,wy_v,state,wq,pv,update] [--split-v]

--round names the products whose operands are rounded (default: all, as one f16 plane an operand
would); --split-v stages β V as two planes (hi + what f16 lost), as the kernels do. Per layer
call: the outputs' and the state's relative error against the CPU model's exact delta rule; per
prompt: the largest logit difference (and over the largest logit) and the rows whose top-1
changes, with their margins. The prompt is the tiny fixture's long prompt repeated, as the CUDA
model test sends it: keys repeat within a chunk.
"""
from __future__ import annotations

import argparse
import math
from pathlib import Path

import numpy as np

import sparkinfer_cli.model.gated_delta_net as gdn
from sparkinfer_cli.kernels.cpu.gated_delta import _k_head_of_v_head
from sparkinfer_cli.model.batch import SequenceBatch
from sparkinfer_cli.model.loader import load_model

TINY = Path(__file__).parents[2] / "tests" / "fixtures" / "tiny" / "qwen35moe"
PRODUCTS = ("kq", "wy_t", "wy_k", "wy_v", "state", "wq", "pv", "update")
CHUNK = 32  # gated_delta_chunked.CHUNK
BLOCK_SIZE = 16


def _f16(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16).astype(np.float32)


def _keep(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float32)


def emulated_delta_rule(rounded: set[str], split_v: bool):
    """gated_delta_recurrent's signature and result, computed chunk by chunk as the CUDA kernels
    do, with the named products' operands rounded to f16."""
    r = {name: _f16 if name in rounded else _keep for name in PRODUCTS}

    def delta_rule(q, k, v, g, beta, state, head_map):
        T, n_k, dk = q.shape
        n_v, dv = v.shape[1], v.shape[2]
        kh = _k_head_of_v_head(n_v, n_k, 0 if head_map == "mod" else n_v // n_k)
        out = np.empty((T, n_v, dv), np.float32)
        lower, strict = np.tril(np.ones((CHUNK, CHUNK))), np.tril(np.ones((CHUNK, CHUNK)), -1)
        for h in range(n_v):
            s = state[h].T.copy()  # Sᵀ (dv, dk), float32 as the accumulators hold it
            for lo in range(0, T, CHUNK):
                n = min(CHUNK, T - lo)
                K, Q, V = (np.zeros((CHUNK, d), np.float32) for d in (dk, dk, dv))
                gates = np.zeros((2, CHUNK), np.float32)
                K[:n], Q[:n], V[:n] = k[lo:lo + n, kh[h]], q[lo:lo + n, kh[h]], v[lo:lo + n, h]
                Q /= np.float32(math.sqrt(dk))
                gates[:, :n] = g[lo:lo + n, h], beta[lo:lo + n, h]
                G = np.cumsum(gates[0]).astype(np.float32)  # rows past n: G_last
                b = gates[1][:, None]
                kq = r["kq"](np.concatenate([K, Q])) @ r["kq"](K).T
                decay = np.exp(G[:, None] - G[None, :]) * lower
                t = np.linalg.inv(np.eye(CHUNK) + kq[:CHUNK] * decay * b * strict)
                t = r["wy_t"](t.astype(np.float32))
                w = t @ r["wy_k"](b * np.exp(G)[:, None] * K)
                u = t @ r["wy_v"](b * V)
                if split_v:
                    u += t @ r["wy_v"](b * V - r["wy_v"](b * V))
                st = r["state"](s)
                new_v = u - r["wq"](w) @ st.T
                o = np.exp(G)[:, None] * (r["wq"](Q) @ st.T) + r["pv"](kq[CHUNK:] * decay) @ \
                    r["pv"](new_v)
                out[lo:lo + n, h] = o[:n]
                k_tilde = K * np.exp(G[-1] - G)[:, None]
                s = np.exp(G[-1]) * s + r["update"](new_v).T @ r["update"](k_tilde)
            state[h] = s.T
        return out
    return delta_rule


def _prefill(model, ids: np.ndarray) -> np.ndarray:
    cache = model.create_cache(-(-len(ids) // BLOCK_SIZE), BLOCK_SIZE, 1)
    batch = SequenceBatch.single(ids, 0, np.arange(cache.num_blocks), 0, all_logits=True)
    return model.forward(batch, cache)  # (T, V)


def _top1_margin(logits: np.ndarray) -> np.ndarray:
    top2 = np.sort(logits, axis=-1)[:, -2:]
    return top2[:, 1] - top2[:, 0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=TINY / "qwen35moe-Q8_0.gguf")
    ap.add_argument("--tokens", default="300,700")
    ap.add_argument("--round", default=",".join(PRODUCTS))
    ap.add_argument("--split-v", action="store_true")
    args = ap.parse_args()
    rounded = {name for name in args.round.split(",") if name}
    if rounded - set(PRODUCTS):
        raise SystemExit(f"--round: unknown products {sorted(rounded - set(PRODUCTS))}")
    exact, emulated = gdn.gated_delta_recurrent, emulated_delta_rule(rounded, args.split_v)

    def compared(q, k, v, g, beta, state, head_map):
        kept = state.copy()
        ref = exact(q, k, v, g, beta, kept, head_map)
        got = emulated(q, k, v, g, beta, state, head_map)
        print(f"  layer call of {len(q)} rows: outputs {_rel(got, ref):.2e}, "
              f"state {_rel(state, kept):.2e}")
        return got

    prompt = np.load(TINY / "qwen35moe.goldens.npz")["prompt_long"]
    for n in map(int, args.tokens.split(",")):
        ids = np.resize(prompt, n).astype(np.int32)
        gdn.gated_delta_recurrent = exact
        ref = _prefill(load_model(args.model), ids)
        gdn.gated_delta_recurrent = compared
        got = _prefill(load_model(args.model), ids)
        diff, flips = np.abs(got - ref).max(), got.argmax(1) != ref.argmax(1)
        print(f"{n} tokens: largest logit difference {diff:.4f} ({diff / np.abs(ref).max():.2%} "
              f"of the largest logit); top-1 changed in {flips.sum()} rows, margins "
              f"{np.round(_top1_margin(ref)[flips].astype(float), 3).tolist()}")
    gdn.gated_delta_recurrent = exact


def _rel(got: np.ndarray, ref: np.ndarray) -> float:
    return float(np.linalg.norm(got - ref) / np.linalg.norm(ref))


if __name__ == "__main__":
    main()
