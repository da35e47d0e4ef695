"""``Mapping``: which rank this process is and how the model and the requests are split.

Upstream's names. Only tensor parallelism and attention data parallelism exist here (no
pipeline, context or expert parallelism): ``world_size == tp_size``.

============================  ===============================================================
``tp_size`` ranks, plain TP   every rank holds a slice of each layer (attention heads, MLP
                              columns) and all ranks run the same batch: one executor
                              decision, ``tp_size`` shards of the arithmetic
``enable_attention_dp``       every rank owns its own requests, scheduler, KV cache and
                              ``max_num_tokens``; attention runs locally on each rank's
                              batch; here the MLP is replicated too (upstream may shard it)
============================  ===============================================================
"""

from __future__ import annotations

from dataclasses import dataclass


def _check_int(name: str, value: object, minimum: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"Mapping.{name} must be an int >= {minimum}, got {value!r}")


@dataclass(frozen=True, slots=True)
class Mapping:
    world_size: int = 1
    rank: int = 0
    tp_size: int = 1
    enable_attention_dp: bool = False

    def __post_init__(self) -> None:
        _check_int("world_size", self.world_size, 1)
        _check_int("tp_size", self.tp_size, 1)
        _check_int("rank", self.rank, 0)
        if self.world_size != self.tp_size:
            raise ValueError(
                f"Mapping: world_size ({self.world_size}) must equal tp_size ({self.tp_size});"
                " only tensor parallelism (with or without attention DP) is implemented"
            )
        if self.rank >= self.world_size:
            raise ValueError(f"Mapping.rank ({self.rank}) must be below world_size ({self.world_size})")

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp_size

    @property
    def tp_group(self) -> list[int]:
        return list(range(self.tp_size))

    def has_tp(self) -> bool:
        return self.tp_size > 1

    @property
    def attn_tp_size(self) -> int:
        """Ranks one attention layer is split over: 1 under attention DP (each rank owns its batch)."""
        return 1 if self.enable_attention_dp else self.tp_size

    @property
    def attn_tp_rank(self) -> int:
        return 0 if self.enable_attention_dp else self.tp_rank

    @property
    def mlp_tp_size(self) -> int:
        """Ranks the MLP (and LM head) is split over. Under attention DP each rank's batch is its
        own, so the MLP is replicated: sharding it would need the ranks' tokens gathered first."""
        return 1 if self.enable_attention_dp else self.tp_size

    @property
    def mlp_tp_rank(self) -> int:
        return 0 if self.enable_attention_dp else self.tp_rank

    @property
    def is_first_rank(self) -> bool:
        return self.rank == 0

    def for_rank(self, rank: int) -> "Mapping":
        """The same layout seen from ``rank``."""
        return Mapping(self.world_size, rank, self.tp_size, self.enable_attention_dp)
