"""Mixed forwards replayed piecewise: CUDA graphs of everything but attention, one set per padded
token count.

A forward with context chunks cannot replay a whole-forward graph the way a decode step does
(``cuda_graph_runner``): its attention depends on the chunks' lengths and cached prefixes. But
attention is 2 of a layer's ~20 kernels; the rest (norms, projections, RoPE, the MLP, residual
adds) only sees a (T, hidden) batch of rows, whatever requests they belong to. Launched one by
one from Python, a 12B model's eager mixed forward takes the host about 1 ms per layer, so a
small one is bound by the host (on the H200: 42 ms to launch a 90-token chunk with 10 decodes
whose kernels need ~12 ms; ``benchmarks/results/h200/serving/README.md``, the Triton context kernel's run).

So each layer is cut around its attention (``DecoderLayer.attention_inputs`` / ``finish``) and
the pieces between two attentions are captured, per padded token count N::

    piece 0       embed + RoPE tables + layer 0's attention inputs         -> q, k, v
    (eager)       layer 0's attention over the plan, the first T rows      -> y
    piece 1       layer 0's finish + layer 1's attention inputs            -> q, k, v
    ...
    piece L       layer L-1's finish + the final norm                      -> hidden

The pieces read and write static buffers (ids, positions, the residual stream, q, k, v, y,
hidden), so a forward copies its T ids and positions in, replays L+1 graphs with the eager
attentions between them, and reads ``hidden[:T]``. Rows T..N-1 are padding: they only ever meet
their own row (no op in a piece mixes rows) and the attention never sees them, so they touch no
KV and their values are dropped. Graphs are captured by :meth:`PiecewiseGraphRunner.capture_all`
(the engine's warm-up) or at a size's first use; all share one memory pool (one forward at a
time, and nothing a piece allocates outlives it).

On the CPU the runner runs the same pieces eagerly (no graphs): the tests check there that the
pieces and the padding give the model's own forward.
"""

from __future__ import annotations

import bisect
import logging
from dataclasses import dataclass, field
from typing import Sequence

import torch

from tensorrt_llm._torch.attention_backend.backend import AttentionPlan
from tensorrt_llm._torch.models.modeling_llama import LlamaForCausalLM
from tensorrt_llm._torch.pyexecutor.engine.cuda_graph_runner import garbage_collection_paused

__all__ = ["PiecewiseGraphRunner"]

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class _Pieces:
    """The static buffers and graphs of one padded token count."""

    num_tokens: int
    ids: torch.Tensor  # (N,) int64
    positions: torch.Tensor  # (N,) int64
    x: torch.Tensor  # (N, hidden): the residual stream between pieces
    cos: torch.Tensor  # (N, head_dim/2)
    sin: torch.Tensor
    q: torch.Tensor  # (N, n_head, head_dim)
    k: torch.Tensor  # (N, n_kv_head, head_dim)
    v: torch.Tensor
    y: torch.Tensor  # (N, n_head, head_dim): the eager attention's output
    hidden: torch.Tensor  # (N, hidden): the final norm's
    graphs: list[torch.cuda.CUDAGraph] = field(default_factory=list)


class PiecewiseGraphRunner:
    """Runs a model's forward over a plan as pieces (module docstring): graphs on CUDA, eagerly elsewhere."""

    def __init__(self, model: LlamaForCausalLM, *, num_tokens: Sequence[int]) -> None:
        if not num_tokens:
            raise ValueError("PiecewiseGraphRunner needs at least one token count")
        self.model = model
        self.num_tokens = sorted(set(num_tokens))
        self.device = model.device
        self.use_graphs = self.device.type == "cuda"
        self._pieces: dict[int, _Pieces] = {}
        self._pool = None
        self.num_replays = 0

    def size_for(self, num_tokens: int) -> int | None:
        """The padded token count that serves a forward of ``num_tokens`` rows, or None (eager)."""
        i = bisect.bisect_left(self.num_tokens, num_tokens)
        return self.num_tokens[i] if num_tokens and i < len(self.num_tokens) else None

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        plan: AttentionPlan,
        k_cache: list[torch.Tensor],
        v_cache: list[torch.Tensor],
    ) -> torch.Tensor:
        """``LlamaForCausalLM.forward_with_plan``, piecewise: (T,) ids and positions on the model's
        device -> hidden (T, hidden), a view of a static buffer valid until the next forward of the
        same size (the caller's next ops on the stream read it first). T must have a size."""
        T = input_ids.shape[0]
        size = self.size_for(T)
        if size is None:
            raise ValueError(f"no piecewise size serves a forward of {T} tokens (sizes {self.num_tokens})")
        p = self._pieces.get(size) or self._capture(size)
        p.ids[:T].copy_(input_ids)
        p.positions[:T].copy_(position_ids)
        layers = self.model.model.layers
        for i in range(len(layers) + 1):
            if self.use_graphs:
                p.graphs[i].replay()
            else:
                self._piece(p, i)
            if i < len(layers):
                kv = plan.layer(k_cache[i], v_cache[i], i)
                p.y[:T].copy_(layers[i].attend(p.q[:T], p.k[:T], p.v[:T], p.cos[:T], p.sin[:T], kv))
        self.num_replays += 1
        return p.hidden[:T]

    # ---- pieces and their capture -------------------------------------------------------------
    def _piece(self, p: _Pieces, i: int) -> None:
        """Piece ``i`` (module docstring) on the static buffers."""
        model = self.model.model
        layers = model.layers
        if i == 0:
            x, cos, sin = model.embed(p.ids, p.positions)
            p.cos.copy_(cos)
            p.sin.copy_(sin)
        else:
            x = layers[i - 1].finish(p.x, p.y)
        p.x.copy_(x)
        if i < len(layers):
            q, k, v = layers[i].attention_inputs(p.x, p.cos, p.sin)
            p.q.copy_(q)
            p.k.copy_(k)
            p.v.copy_(v)
        else:
            p.hidden.copy_(model.norm(p.x))

    def capture_all(self) -> None:
        """Capture every size now (largest first, so smaller ones reuse its pool memory)."""
        with garbage_collection_paused():  # one collection for all of them
            for size in reversed(self.num_tokens):
                if size not in self._pieces:
                    self._capture(size)

    def _capture(self, size: int) -> _Pieces:
        config, attn = self.model.config, self.model.model.layers[0].self_attn
        dtype, device = config.torch_dtype, self.device

        def buffer(*shape, dtype=dtype):
            return torch.zeros(shape, dtype=dtype, device=device)

        p = _Pieces(size, buffer(size, dtype=torch.int64), buffer(size, dtype=torch.int64),
                    buffer(size, config.hidden_size), buffer(size, config.head_dim // 2),
                    buffer(size, config.head_dim // 2), buffer(size, attn.n_head, attn.head_dim),
                    buffer(size, attn.n_kv_head, attn.head_dim), buffer(size, attn.n_kv_head, attn.head_dim),
                    buffer(size, attn.n_head, attn.head_dim), buffer(size, config.hidden_size))
        if self.use_graphs:
            pieces = range(len(self.model.model.layers) + 1)
            with torch.inference_mode():
                side = torch.cuda.Stream(device)
                side.wait_stream(torch.cuda.current_stream(device))
                with torch.cuda.stream(side):  # warm-up: Triton compiles, cuBLAS picks its kernels
                    for _ in range(2):
                        for i in pieces:
                            self._piece(p, i)
                torch.cuda.current_stream(device).wait_stream(side)
                if self._pool is None:
                    self._pool = torch.cuda.graph_pool_handle()
                with garbage_collection_paused():  # no finaliser may run inside a capture (cuda_graph_runner)
                    for i in pieces:
                        graph = torch.cuda.CUDAGraph()
                        with torch.cuda.graph(graph, pool=self._pool):
                            self._piece(p, i)
                        p.graphs.append(graph)
            logger.info("captured %d piecewise CUDA graphs for mixed forwards of up to %d tokens", len(p.graphs), size)
        self._pieces[size] = p
        return p
