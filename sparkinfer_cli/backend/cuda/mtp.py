"""The MTP (NextN) head of Qwen3.5 / Qwen3.6 files on the GPU; model/mtp.py has the math.

Its one decoder layer runs as a one-layer CudaModel (the same workspaces, graph captures and
layer kernels) whose first input is eh_proj([enorm(embed(token)) | hnorm(hidden)]) instead of an
embedding: eh_proj is uploaded as its two column halves, so the two products sum in the residual
add of the layer's pre-norm and no (N, 2E) concatenation is built. The hidden states come from
the host (the engine keeps them per request) into ws.rows_in; the logits go through the trunk's
output matrix, and the head's own normed state comes back beside them to draft on from.
"""

from __future__ import annotations

import numpy as np

from sparkinfer_cli.backend.cuda.cache import CudaModelCache
from sparkinfer_cli.backend.cuda.model import CudaModel
from sparkinfer_cli.backend.cuda.workspace import Workspace
from sparkinfer_cli.kernels.cuda import embedding, norm
from sparkinfer_cli.model.backend import NextTokenHead
from sparkinfer_cli.model.batch import SequenceBatch
from sparkinfer_cli.model.tensors import MtpTensors


class CudaMtpHead(NextTokenHead[CudaModelCache]):
    def __init__(self, t: MtpTensors, trunk: CudaModel):
        self.passes = _HeadPasses(t, trunk)

    def create_cache(self, num_blocks: int, block_size: int) -> CudaModelCache:
        return self.passes.create_cache(num_blocks, block_size, 0)

    def forward(self, hidden: np.ndarray, batch: SequenceBatch,
                cache: CudaModelCache) -> tuple[np.ndarray, np.ndarray]:
        return self.passes.forward_head(hidden, batch, cache)

    def forward_greedy(self, hidden: np.ndarray, batch: SequenceBatch,
                       cache: CudaModelCache) -> tuple[np.ndarray, np.ndarray]:
        return self.passes.forward_head(hidden, batch, cache, greedy=True)

    def prepare(self, cache: CudaModelCache, max_seqs: int, max_pass_tokens: int) -> None:
        self.passes.prepare(cache, max_seqs, max_pass_tokens)


class _HeadPasses(CudaModel):
    """The head's layer as a one-layer model on the trunk's stream, embedding and output."""

    def __init__(self, t: MtpTensors, trunk: CudaModel):
        config = trunk.config.mtp_head_config()
        self._init_passes(config, trunk.exact, trunk.kv_dtype, trunk.use_graphs, trunk.stream)
        self.embedding, self.token_embd = trunk.embedding, trunk.token_embd
        self.output = trunk.output
        up = self._uploader()
        n_embd = config.n_embd
        self.eh_embedded = up.linear(t.eh_proj.select_columns(0, n_embd, "eh_proj.embedded"),
                                     prefill=True)
        self.eh_hidden = up.linear(t.eh_proj.select_columns(n_embd, 2 * n_embd,
                                                            "eh_proj.hidden"), prefill=True)
        self.enorm, self.hnorm = up.vector(t.enorm), up.vector(t.hnorm)
        self.layers = [self._upload_layer(up, t.layer, 0)]
        self.output_norm = up.vector(t.head_norm)  # the head's logit rows are its hidden state
        self.stream.synchronize()
        self.weight_bytes = up.n_bytes + up.half_bytes

    def forward_head(self, hidden: np.ndarray, batch: SequenceBatch, cache: CudaModelCache,
                     greedy: bool = False) -> tuple[np.ndarray, np.ndarray]:
        """NextTokenHead.forward: (logits, normed state) of each sequence's last new token;
        greedy: (argmax ids picked on the device, normed state)."""
        p = self._pass(batch, cache, greedy=greedy, rows_in=hidden)
        picked = self._host_ids(p) if greedy else self._host_logits(p)
        states = self._final(p.ws, p.logit_rows).f.reshape(p.logit_rows, -1)[:p.n_logits]
        states = states.copy_to_host(stream=self.stream)
        self._finish(p)
        return picked.copy() if greedy else picked, states


    def _capture(self, batch: SequenceBatch, cache: CudaModelCache) -> None:
        self.forward_greedy(batch, cache)  # drafting asks for the ids, not the logits

    def _first_input(self, ws: Workspace, s) -> None:
        """ws.x = the layer's normed input, from the tokens' embeddings (ws.h) and the trunk's
        hidden states (ws.rows_in)."""
        eps = self.config.rms_eps
        if self.token_embd is not None:
            embedding.embed_rows(self.token_embd, ws.token_ids, ws.h.reshape(ws.n_rows, -1),
                                 stream=s)
        embedded, hidden = ws.act("mtp.embedded", self.config.n_embd), \
            ws.act("mtp.hidden", self.config.n_embd)
        norm.rms_norm(ws.h, self.enorm, embedded.f, eps, stream=s, act=embedded.q)
        norm.rms_norm(ws.rows_in, self.hnorm, hidden.f, eps, stream=s, act=hidden.q)
        self.eh_embedded(ws, embedded, ws.h, s)
        self.eh_hidden(ws, hidden, ws.delta, s)
        norm.add_rms_norm(ws.delta, ws.h, self.layers[0].attn_norm, ws.x.f, eps, stream=s,
                          act=ws.x.q)
