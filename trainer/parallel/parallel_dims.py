"""Parallel degrees, their arithmetic against the world size, and every named device mesh.

Build code asks for a mesh by name (`parallel_dims.mesh("fsdp")`) and never slices one
itself. The world mesh has five axes, outermost first:

    pp, dp_replicate, dp_shard, cp, tp

Context-parallel ranks hold other chunks of the same sequences: they read the same data
(the "dp" mesh leaves them out) but join FSDP's shard group (`dp_shard x cp`), whose
averaging of gradients then also averages the cp ranks' per-chunk losses, as the peers do.

Expert parallelism borrows its ranks from data parallelism (as in torchtitan): for
the routed experts the FSDP shard axis `dp_shard` is seen as `dp_shard_mod_ep x ep`,
so dense weights are sharded over all of dp_shard while experts are split over `ep`
and FSDP-sharded over the remaining `dp_shard_mod_ep`. Under tensor parallelism each
tp rank routes its own slice of the sequence through whole (not tp-sharded) experts,
so the routed experts and the router are FSDP-sharded over `dp_shard x tp` instead,
whose reduce-scatter also sums the tp ranks' gradients. Axes of size 1 cost nothing
and keep one code path (dp_shard exists even on one GPU, so FSDP2 always owns the
master weights and mixed precision).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from trainer.errors import ConfigError

# Mesh axis names.
PP, DP_REPLICATE, DP_SHARD_MOD_EP, EP, TP, CP = "pp", "dp_replicate", "dp_shard_mod_ep", "ep", "tp", "cp"
DP_SHARD, DP = "dp_shard", "dp"

# What each named mesh is for (the names `mesh()` accepts).
MESH_NAMES = {
    "pp": "pipeline stages",
    "dp": "data loading (every data-parallel rank; cp ranks of one dp rank read the same data)",
    "dp_cp": "loss averaging for the log and validation: every data-parallel and context-parallel rank",
    "fsdp": "FSDP2/HSDP of dense weights: dp_shard x cp, or (dp_replicate, dp_shard x cp)",
    "expert_fsdp": "FSDP2/HSDP of routed experts (and, under tp, routers): (dp_shard x cp) / ep with ep, dp_shard x tp "
                   "with tp, each with dp_replicate first under HSDP",
    "stage": "every rank of a pipeline stage (data, context and tensor parallel): MoE token counts are summed over it",
    "cp": "context parallel: the ranks holding the other chunks of this rank's sequences",
    "ep": "expert parallel all-to-all (only with ep > 1)",
    "tp": "tensor parallel",
}


@dataclass
class ParallelDims:
    """Degrees of every parallelism. Construct with `resolve(...)` to fill dp_shard=-1 and validate."""

    dp_replicate: int
    dp_shard: int
    tp: int
    ep: int
    pp: int
    world_size: int
    cp: int = 1
    _meshes: dict[str, DeviceMesh] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        # Invariants only: `resolve` is where user-facing degrees are checked.
        assert self.dp_replicate * self.dp_shard * self.cp * self.tp * self.pp == self.world_size, self
        assert (self.dp_shard * self.cp) % self.ep == 0, self

    @classmethod
    def resolve(cls, *, dp_replicate: int, dp_shard: int, tp: int, ep: int, pp: int, world_size: int,
                cp: int = 1) -> ParallelDims:
        """Fill dp_shard=-1 from the world size and check that the degrees fit it; ConfigError otherwise."""
        for name, value in (("dp_replicate", dp_replicate), ("tp", tp), ("ep", ep), ("pp", pp), ("cp", cp)):
            if value < 1:
                raise ConfigError(f"distributed.{name}={value} must be >= 1")
        if dp_shard == 0 or dp_shard < -1:
            raise ConfigError(f"distributed.dp_shard={dp_shard} must be >= 1, or -1 for the rest of the world size")
        others = dp_replicate * cp * tp * pp
        if dp_shard == -1:
            if world_size % others:
                raise ConfigError(
                    f"world size {world_size} is not divisible by dp_replicate*cp*tp*pp = "
                    f"{dp_replicate}*{cp}*{tp}*{pp} = {others}, so distributed.dp_shard=-1 cannot fill it"
                )
            dp_shard = world_size // others
        if others * dp_shard != world_size:
            raise ConfigError(
                f"parallel degrees do not multiply to the world size: dp_replicate*dp_shard*cp*tp*pp = "
                f"{dp_replicate}*{dp_shard}*{cp}*{tp}*{pp} = {others * dp_shard}, but WORLD_SIZE={world_size} "
                "(set distributed.dp_shard=-1 to use the rest)"
            )
        if cp > 1 and tp > 1:
            raise ConfigError(
                f"distributed.cp={cp} with distributed.tp={tp}: context parallel together with tensor parallel is not "
                "supported (docs/distributed.md#context-parallel says what it would take); set one of them to 1"
            )
        if ep > 1:
            if tp > 1:
                raise ConfigError(
                    f"distributed.ep={ep} with distributed.tp={tp}: expert parallel together with tensor parallel "
                    "is not supported; set one of them to 1"
                )
            if (dp_shard * cp) % ep:
                raise ConfigError(
                    f"distributed.ep={ep} must divide distributed.dp_shard x distributed.cp = {dp_shard} x {cp}: "
                    "expert-parallel ranks are carved out of the FSDP shard group (experts are split over ep and "
                    "sharded over the rest)"
                )
        return cls(dp_replicate=dp_replicate, dp_shard=dp_shard, tp=tp, ep=ep, pp=pp, world_size=world_size, cp=cp)

    @property
    def dp(self) -> int:
        """Data-parallel degree: ranks that read different data."""
        return self.dp_replicate * self.dp_shard

    @property
    def fsdp_shard(self) -> int:
        """Ranks FSDP shards a weight over: dp_shard x cp."""
        return self.dp_shard * self.cp

    @property
    def dp_shard_mod_ep(self) -> int:
        return self.dp_shard * self.cp // self.ep

    @property
    def expert_fsdp(self) -> int:
        """Ranks of the `expert_fsdp` mesh (FSDP2's group for the routed experts); at 1 (ep covers dp_shard x cp, no
        replicas, no tp) FSDP2 leaves the experts alone where their weights need no cast (trainer.parallel.fsdp)."""
        if self.tp > 1:
            return self.dp_replicate * self.dp_shard * self.tp
        return self.dp_replicate * (self.dp_shard_mod_ep if self.ep > 1 else self.fsdp_shard)

    @property
    def layout(self) -> dict[str, int]:
        """Every degree by name and the world size: what checkpoint.json and the event log record."""
        return {"dp_replicate": self.dp_replicate, "dp_shard": self.dp_shard, "tp": self.tp, "ep": self.ep,
                "pp": self.pp, "cp": self.cp, "world_size": self.world_size}

    @property
    def summary(self) -> str:
        parts = [f"dp_replicate={self.dp_replicate}", f"dp_shard={self.dp_shard}", f"tp={self.tp}"]
        parts += [f"{name}={getattr(self, name)}" for name in ("cp", "ep", "pp") if getattr(self, name) > 1]
        return f"{', '.join(parts)} (world size {self.world_size})"

    def build_meshes(self, device_type: str) -> None:
        """Create the world mesh and every named mesh (collective: all ranks call it); once per ParallelDims
        (the phases of a precision schedule share one, and so its process groups)."""
        if self._meshes:
            return
        dims = [(PP, self.pp), (DP_REPLICATE, self.dp_replicate), (DP_SHARD, self.dp_shard), (CP, self.cp),
                (TP, self.tp)]
        world = init_device_mesh(device_type, tuple(d for _, d in dims), mesh_dim_names=tuple(n for n, _ in dims))
        hsdp = self.dp_replicate > 1
        self._meshes = {
            "pp": world[PP],
            # Flattened meshes are kept here: slicing them back out of the world mesh is deprecated.
            "dp": world[(DP_REPLICATE, DP_SHARD)]._flatten(DP),
            "dp_cp": world[(DP_REPLICATE, DP_SHARD, CP)]._flatten("dp_cp"),
            "stage": world[(DP_REPLICATE, DP_SHARD, CP, TP)]._flatten("stage"),
            "cp": world[CP],
            "tp": world[TP],
        }
        if self.cp > 1:
            # FSDP over dp_shard x cp as one axis: a mesh of its own over the same ranks (a 2-D HSDP mesh
            # cannot take an axis flattened out of the world mesh without slicing it back, deprecated).
            shard = init_device_mesh(device_type, (self.pp, self.dp_replicate, self.dp_shard * self.cp, self.tp),
                                     mesh_dim_names=(PP, DP_REPLICATE, "dp_shard_cp", TP))
            self._meshes["fsdp"] = shard[(DP_REPLICATE, "dp_shard_cp")] if hsdp else shard["dp_shard_cp"]
        else:
            self._meshes["fsdp"] = world[(DP_REPLICATE, DP_SHARD)] if hsdp else world[DP_SHARD]
        self._build_expert_meshes(device_type, world, hsdp)

    def _build_expert_meshes(self, device_type: str, world: DeviceMesh, hsdp: bool) -> None:
        if self.tp > 1:
            # Experts and routers see tokens of this rank's sequence slice only: FSDP over dp_shard x tp sums
            # their gradients over tp. A mesh of its own (same ranks, dp_shard x tp as one axis), not a slice
            # of a flattened axis of the world mesh (deprecated).
            experts = init_device_mesh(device_type, (self.pp, self.dp_replicate, self.dp_shard * self.tp),
                                       mesh_dim_names=(PP, DP_REPLICATE, "dp_shard_tp"))
            self._meshes["expert_fsdp"] = experts[(DP_REPLICATE, "dp_shard_tp")] if hsdp else experts["dp_shard_tp"]
        elif self.ep > 1 and self.cp > 1:
            # dp_shard x cp seen as (dp_shard_mod_ep, ep): ep takes consecutive ranks of that product.
            sparse = init_device_mesh(device_type, (self.pp, self.dp_replicate, self.dp_shard_mod_ep, self.ep),
                                      mesh_dim_names=(PP, DP_REPLICATE, DP_SHARD_MOD_EP, EP))
            self._meshes["ep"] = sparse[EP]
            self._meshes["expert_fsdp"] = sparse[(DP_REPLICATE, DP_SHARD_MOD_EP)] if hsdp else sparse[DP_SHARD_MOD_EP]
        elif self.ep > 1:
            # Experts see dp_shard as (dp_shard_mod_ep, ep): same ranks, split in two axes.
            # The axis by index: torch 2.11's _unflatten refuses every axis given by name (an inverted check).
            axis = world.mesh_dim_names.index(DP_SHARD)
            sparse = world._unflatten(axis, (self.dp_shard_mod_ep, self.ep), (DP_SHARD_MOD_EP, EP))
            self._meshes["ep"] = sparse[EP]
            self._meshes["expert_fsdp"] = sparse[(DP_REPLICATE, DP_SHARD_MOD_EP)] if hsdp else sparse[DP_SHARD_MOD_EP]
        else:
            self._meshes["expert_fsdp"] = self._meshes["fsdp"]

    def mesh(self, name: str) -> DeviceMesh:
        """A named mesh (see MESH_NAMES); `build_meshes` must have run."""
        assert name in MESH_NAMES, f"unknown mesh {name!r}; one of {sorted(MESH_NAMES)}"
        assert self._meshes, "ParallelDims.build_meshes() has not run"
        assert name != "ep" or self.ep > 1, "there is no ep mesh with distributed.ep=1"
        return self._meshes[name]
