"""Forward time of one tensor-parallel rank, from a single-GPU cost model.

A rank of ``N`` runs every token of the batch through ``1/N`` of each weight matrix and
``1/N`` of the attention heads, so the single-GPU time's FLOP and byte work divides by
``N``; the per-iteration fixed cost (kernel launches, sampling) does not. Each layer then
adds two all-reduces of the batch's hidden states (after attention, after the MLP), and
the LM head an all-gather of the sampled rows' logits::

    t_N = fixed + (t_1 - fixed) / N
        + 2 * layers * allreduce(tokens * hidden * dtype_bytes)
        + allgather(rows * vocab / N * dtype_bytes)

    allreduce(b) = latency + 2 (N - 1) / N * b / bus_bandwidth      (ring)
    allgather(b) = latency + (N - 1) * b / bus_bandwidth

The link defaults are an assumption, not a measurement: NVLink 4 (H200) at 360 GB/s of
NCCL bus bandwidth and 12 us per collective. Under attention DP (MLP replicated here) each
rank's forward is the single-GPU model's time for its own batch; no wrapper is needed.
"""

from __future__ import annotations

from dataclasses import dataclass

from benchmarks.replay.cost_model import CostModel, ForwardShape, GpuSpec, ModelShape


@dataclass(frozen=True, slots=True)
class LinkSpec:
    bus_bandwidth: float = 360e9  # bytes/s an all-reduce moves per GPU (NCCL "busbw")
    latency_s: float = 12e-6  # per collective

    def __post_init__(self) -> None:
        if self.bus_bandwidth <= 0 or self.latency_s < 0:
            raise ValueError(f"LinkSpec needs a positive bandwidth and a non-negative latency, got {self}")


@dataclass(frozen=True, slots=True)
class TensorParallelCostModel:
    base: CostModel
    tp_size: int
    model: ModelShape = ModelShape()
    link: LinkSpec = LinkSpec()
    fixed_s: float = GpuSpec().overhead_s

    def __post_init__(self) -> None:
        if self.tp_size < 1:
            raise ValueError(f"tp_size must be >= 1, got {self.tp_size}")

    def forward_time_s(self, shape: ForwardShape) -> float:
        single = self.base.forward_time_s(shape)
        n = self.tp_size
        if n == 1:
            return single
        fixed = min(self.fixed_s, single)
        m, link = self.model, self.link
        rows = len(shape.contexts) + sum(new for new, _ in shape.decodes)
        hidden_bytes = shape.num_tokens * m.hidden_size * m.dtype_bytes
        allreduce = link.latency_s + 2 * (n - 1) / n * hidden_bytes / link.bus_bandwidth
        allgather = link.latency_s + (n - 1) * rows * (m.vocab_size / n) * m.dtype_bytes / link.bus_bandwidth
        return fixed + (single - fixed) / n + 2 * m.num_layers * allreduce + allgather

    def describe(self) -> dict:
        return {"type": "TensorParallelCostModel", "tp_size": self.tp_size, "fixed_s": self.fixed_s,
                "link": {"bus_bandwidth": self.link.bus_bandwidth, "latency_s": self.link.latency_s},
                "base": type(self.base).__name__}
