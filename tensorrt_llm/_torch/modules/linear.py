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

On the CPU a layer may multiply through a *linear method* chosen at load (upstream's
``quant_method``; ``linear_methods``): its weight packed in float16 for fbgemm (the
``float16-weights`` dtype, :meth:`Linear.pack_float16`), or a GGUF file's
block-quantized weight kept in 4-bit codes for torch's int4 kernel. The method holds the weight
in its own form; ``weight`` then stays as loaded (shared with a checkpoint's cache, or the tied
embedding) or, for a quantized weight, is None: the dense values are never held. The forward
has one branch: the method if there is one, else ``F.linear``.
"""

from __future__ import annotations

import enum

import torch
import torch.nn.functional as F
from torch import nn

from tensorrt_llm._torch.modules import collectives
from tensorrt_llm._torch.modules.linear_methods import Float16PackedMethod, LinearMethod


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
        # How forward multiplies when the weight is kept in a format of its own (linear_methods); None: F.linear.
        self.quant_method: LinearMethod | None = None

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
        self.use_method(Float16PackedMethod(self.weight))

    def use_method(self, method: LinearMethod, *, keep_weight: bool = True) -> None:
        """Multiply through ``method`` from now on. ``keep_weight=False``: the layer holds no dense
        weight (``weight`` becomes None), as for a quantized one whose dense values were never made."""
        self.quant_method = method
        if not keep_weight:
            self.weight = None

    @property
    def packed_float16(self) -> bool:
        return isinstance(self.quant_method, Float16PackedMethod)

    @property
    def weight_bytes(self) -> int:
        """Bytes of weight a forward reads: the method's stored form, else ``weight``'s."""
        if self.quant_method is not None:
            return self.quant_method.weight_bytes
        return self.weight.numel() * self.weight.element_size()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        row = self.tensor_parallel_mode is TensorParallelMode.ROW
        bias = None if row else self.bias  # a row layer adds its bias once, after the all-reduce
        if self.quant_method is not None:
            y = self.quant_method.apply(x)  # (T, local out), in the method's dtype
            if bias is not None:
                y = y + bias
        elif self.weight is not None:
            y = F.linear(x, self.weight, bias)  # (T, local out) or (T, out) partial sum
        else:
            raise RuntimeError("this layer's quantized weight is held by its attention's or MLP's stacked method"
                               " (linear_formats): call that module")
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
