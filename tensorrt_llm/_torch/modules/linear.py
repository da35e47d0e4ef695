"""``Linear``: a projection with an optional bias, optionally one rank's shard of a tensor-parallel layer.

Upstream's two modes (Megatron's column / row split), for ``y = x @ W.T + b`` with ``W`` of
shape ``(out_features, in_features)``::

    COLUMN  rank r holds rows [a_r, b_r) of W      -> y[:, a_r:b_r], a slice of the outputs
            and b[a_r:b_r] (its outputs' biases)
            (gather_output: every rank then holds all of y, by an all-gather)
    ROW     rank r holds columns [a_r, b_r) of W   -> a partial sum of all of y from the
            inputs x[:, a_r:b_r]; the all-reduce adds the ranks' partial sums, and every
            rank then adds the whole b (held whole on every rank, added once)

A column layer followed by a row layer needs one collective for the pair: the column
layer's output slice is exactly the row layer's input slice.

On the CPU a layer may keep its weight packed in float16 (:meth:`Linear.pack_float16`, the
``float16-weights`` dtype): fbgemm's fp16 GEMM reads half the bytes and widens them to float32
in registers, so activations and accumulation stay float32. A decode step reads every weight
once, so it reads half as much, and fbgemm's kernel also outruns the float32 GEMM at batch 16-64
on this project's AVX2 machine (``benchmarks/model/decode_speed.py`` measures both).
"""

from __future__ import annotations

import enum

import torch
import torch.nn.functional as F
from torch import nn

from tensorrt_llm._torch.modules import collectives


class TensorParallelMode(str, enum.Enum):
    COLUMN = "column"
    ROW = "row"


def split_sizes(total: int, parts: int) -> list[int]:
    """``total`` split in ``parts`` near-equal sizes, the larger ones first."""
    base, extra = divmod(total, parts)
    return [base + (i < extra) for i in range(parts)]


def split_range(total: int, parts: int, index: int) -> tuple[int, int]:
    """The ``[start, stop)`` of part ``index`` of :func:`split_sizes`."""
    sizes = split_sizes(total, parts)
    start = sum(sizes[:index])
    return start, start + sizes[index]


class Linear(nn.Module):
    """``y = x @ W.T`` where ``weight`` is this rank's shard of ``W`` (all of it when unsplit).

    ``shard`` overrides the even split with an explicit ``[start, stop)`` range of the split
    dimension: replicated KV heads need it, when there are more ranks than KV heads and two
    ranks hold the same head. Weights start uninitialised (no page is written until a value
    is loaded); :meth:`shard_weight` (:meth:`shard_parameter` for the bias too) cuts this rank's
    part out of a full tensor, as a view: a memory-mapped checkpoint tensor is then read only
    where this rank's slice lies.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        dtype: torch.dtype,
        tp_size: int = 1,
        tp_rank: int = 0,
        tensor_parallel_mode: TensorParallelMode | None = None,
        gather_output: bool = False,
        shard: tuple[int, int] | None = None,
        bias: bool = False,
    ) -> None:
        super().__init__()
        if gather_output and tensor_parallel_mode is not TensorParallelMode.COLUMN:
            raise ValueError("gather_output applies to a COLUMN layer only")
        if gather_output and shard is not None:
            raise ValueError("a gathered COLUMN layer must use the even split")
        self.in_features, self.out_features = in_features, out_features
        mode = tensor_parallel_mode if tp_size > 1 else None
        self.tensor_parallel_mode, self.tp_size = mode, tp_size if mode is not None else 1
        self.gather_output = gather_output and mode is not None
        split = out_features if mode is TensorParallelMode.COLUMN else in_features
        self.start, self.stop = 0, split
        if mode is not None:
            self.start, self.stop = shard if shard is not None else split_range(split, tp_size, tp_rank)
        if not 0 <= self.start < self.stop <= split:
            raise ValueError(f"Linear: shard [{self.start}, {self.stop}) is not inside [0, {split})")
        self._gather_sizes = split_sizes(out_features, tp_size) if self.gather_output else []
        local = self.stop - self.start
        shape = {
            None: (out_features, in_features),
            TensorParallelMode.COLUMN: (local, in_features),
            TensorParallelMode.ROW: (out_features, local),
        }[mode]
        self.weight = nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)
        # A column shard holds its outputs' biases; otherwise every rank holds all of them.
        bias_len = local if mode is TensorParallelMode.COLUMN else out_features
        if bias:
            self.bias = nn.Parameter(torch.empty(bias_len, dtype=dtype), requires_grad=False)
        else:
            self.register_parameter("bias", None)
        # fbgemm's packed float16 copy of ``weight`` (pack_float16); what forward multiplies by when set.
        self._packed: torch.ScriptObject | None = None

    @property
    def full_shape(self) -> tuple[int, int]:
        return self.out_features, self.in_features

    def full_shape_of(self, name: str) -> tuple[int, ...]:
        """The unsharded shape of parameter ``name`` (``"weight"`` or ``"bias"``)."""
        return self.full_shape if name == "weight" else (self.out_features,)

    def shard_weight(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's part of a full ``(out_features, in_features)`` weight."""
        return self.shard_parameter("weight", full)

    def shard_parameter(self, name: str, full: torch.Tensor) -> torch.Tensor:
        """This rank's part (a view) of the full tensor of parameter ``name`` (``"weight"`` or ``"bias"``)."""
        expected = self.full_shape_of(name)
        if tuple(full.shape) != expected:
            raise ValueError(f"expected a {name} of shape {expected}, got {tuple(full.shape)}")
        if self.tensor_parallel_mode is TensorParallelMode.COLUMN:
            return full[self.start : self.stop]
        if self.tensor_parallel_mode is TensorParallelMode.ROW and name == "weight":
            return full[:, self.start : self.stop]
        return full

    def pack_float16(self) -> None:
        """Multiply by ``weight`` rounded to float16 from now on (fbgemm, CPU, float32 ``weight``).
        ``weight`` itself stays as it is (a checkpoint's cached tensor, shared): it is not read."""
        if self.weight.device.type != "cpu" or self.weight.dtype != torch.float32:
            raise ValueError(f"float16 packing needs a float32 weight on the CPU, got {self.weight.dtype} "
                             f"on {self.weight.device.type}")
        self._packed = torch.ops.quantized.linear_prepack_fp16(self.weight.detach(), None)

    @property
    def packed_float16(self) -> bool:
        return self._packed is not None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        row = self.tensor_parallel_mode is TensorParallelMode.ROW
        bias = None if row else self.bias  # a row layer adds its bias once, after the all-reduce
        if self._packed is not None:
            y = torch.ops.quantized.linear_dynamic_fp16(x, self._packed)  # (T, local out), float32
            if bias is not None:
                y = y + bias
        else:
            y = F.linear(x, self.weight, bias)  # (T, local out) or (T, out) partial sum
        if row:
            y = collectives.allreduce(y)  # (T, out)
            return y if self.bias is None else y + self.bias
        if self.gather_output:
            return collectives.allgather(y, self._gather_sizes)  # (T, out)
        return y

    def extra_repr(self) -> str:
        mode = "" if self.tensor_parallel_mode is None else f", {self.tensor_parallel_mode.value}[{self.start}:{self.stop}]"
        bias = ", bias" if self.bias is not None else ""
        return f"in_features={self.in_features}, out_features={self.out_features}{bias}{mode}"
