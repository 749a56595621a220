"""Parallel degrees, their validation against the world size, and the device mesh."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

# Mesh axis names (outermost first). `dp` is dp_replicate x dp_shard flattened.
PP, DP_REPLICATE, DP_SHARD, CP, TP = "pp", "dp_replicate", "dp_shard", "cp", "tp"
DP = "dp"


@dataclass
class ParallelDims:
    dp_replicate: int
    dp_shard: int
    tp: int
    world_size: int
    ep: int = 1
    pp: int = 1
    cp: int = 1

    def __post_init__(self) -> None:
        for name in ("dp_replicate", "tp", "ep", "pp", "cp"):
            if getattr(self, name) < 1:
                raise ValueError(f"distributed.{name}={getattr(self, name)} must be >= 1")
        others = self.dp_replicate * self.tp * self.pp * self.cp
        if self.dp_shard == -1:
            if self.world_size % others:
                raise ValueError(
                    f"world size {self.world_size} is not divisible by dp_replicate*tp*pp*cp = "
                    f"{self.dp_replicate}*{self.tp}*{self.pp}*{self.cp} = {others}, so dp_shard=-1 cannot fill it"
                )
            self.dp_shard = self.world_size // others
        product = others * self.dp_shard
        if product != self.world_size:
            raise ValueError(
                f"parallel degrees do not multiply to the world size: dp_replicate*dp_shard*tp*pp*cp = "
                f"{self.dp_replicate}*{self.dp_shard}*{self.tp}*{self.pp}*{self.cp} = {product}, "
                f"but WORLD_SIZE={self.world_size} (set distributed.dp_shard=-1 to use the rest)"
            )
        for name in ("ep", "pp", "cp"):
            if getattr(self, name) > 1:
                raise ValueError(
                    f"distributed.{name}={getattr(self, name)}: {name.upper()} is not implemented yet; set it to 1"
                )

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    def build_mesh(self, device_type: str) -> tuple[DeviceMesh, DeviceMesh]:
        """The world mesh with every axis, and the flattened `dp` mesh (data loading, loss averaging).

        dp_shard is always present (size 1 on one GPU) so FSDP2 always owns the
        master weights and mixed precision, and the code path does not change
        with the number of devices.
        """
        dims = [(DP_REPLICATE, self.dp_replicate), (DP_SHARD, self.dp_shard), (TP, self.tp)]
        names = tuple(n for n, d in dims)
        mesh = init_device_mesh(device_type, tuple(d for n, d in dims), mesh_dim_names=names)
        dp_mesh = mesh[(DP_REPLICATE, DP_SHARD)]._flatten(DP)
        return mesh, dp_mesh

    @cached_property
    def summary(self) -> str:
        return f"dp_replicate={self.dp_replicate}, dp_shard={self.dp_shard}, tp={self.tp} (world size {self.world_size})"
