"""Process group and device: CUDA + NCCL when a GPU is there, else CPU + gloo; the plain tensor under a DTensor.

`plain_tensor` is the one rule for reaching the tensor under torchao's fp8 all-gather wrapper and a DTensor (what an
optimizer updates in place, what a checkpoint saves); `Layout` where a local tensor sits in its global one.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed._functional_collectives import all_reduce, wait_tensor
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset


@dataclass(frozen=True)
class DistEnv:
    rank: int
    local_rank: int
    world_size: int
    device: torch.device


def world_size_from_env() -> int:
    """WORLD_SIZE as torchrun sets it; 1 for a plain `python` launch."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def init_distributed(*, timeout_seconds: int) -> DistEnv:
    """Join (or, without torchrun, create) the process group and pick the device.

    A plain `python scripts/train.py` gets a 1-process group on an in-memory
    store, so every code path (FSDP2, DCP, collectives) is the same as under torchrun.
    """
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    world_size = world_size_from_env()
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        # gloo alongside NCCL for CPU-side collectives (checkpoint planning, barriers on CPU tensors).
        backend = "cuda:nccl,cpu:gloo"
    else:
        device = torch.device("cpu")
        backend = "gloo"
        if "OMP_NUM_THREADS" not in os.environ:
            # CPU runs are the debug shapes: one intra-op thread per process is 1-5x faster than
            # the default (threads fighting over a few cores, and the ranks fighting each other).
            torch.set_num_threads(1)
    timeout = timedelta(seconds=timeout_seconds)
    if not dist.is_initialized():
        if "MASTER_ADDR" in os.environ:
            dist.init_process_group(backend, timeout=timeout, device_id=device if device.type == "cuda" else None)
        else:
            assert world_size == 1, "WORLD_SIZE > 1 without MASTER_ADDR: launch with torchrun"
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    return DistEnv(rank=rank, local_rank=local_rank, world_size=world_size, device=device)


def destroy_distributed(*, barrier: bool = True) -> None:
    """Tear down the process group. The barrier (skipped on error paths, where a peer
    may be gone) keeps a rank from destroying gloo while a peer still talks to it,
    which otherwise aborts at exit ("terminate called without an active exception")."""
    if dist.is_initialized():
        if barrier and dist.get_world_size() > 1:
            dist.barrier()
            if dist.get_backend() == "gloo":
                # A rank leaves the barrier while a peer may still be reading its last message; closing
                # the sockets at that moment resets the peer's connection and aborts it at exit. Seen
                # on loaded 2-core machines: give the peers a moment to finish reading.
                time.sleep(0.2)
        dist.destroy_process_group()


def set_determinism(*, seed: int, deterministic: bool) -> None:
    torch.manual_seed(seed)
    if deterministic:
        # cuBLAS needs a fixed workspace to be deterministic.
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False


def describe_device(device: torch.device) -> str:
    """The device for the startup line; says so when a CUDA build of torch sees no GPU."""
    if device.type != "cpu":
        return str(device)
    note = f"; torch is built for CUDA {torch.version.cuda} but sees no GPU" if torch.version.cuda else ""
    return f"cpu ({torch.get_num_threads()} intra-op threads per process{note})"


class _AllReduceSumIdentityBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        return wait_tensor(all_reduce(x.contiguous(), "sum", group))

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


def all_reduce_sum_identity_backward(x: torch.Tensor, group) -> torch.Tensor:
    """The sum of `x` over `group`, whose backward hands each rank the incoming gradient unchanged (Megatron's
    reduce-from-model-parallel-region): for a value every rank of the group then holds and uses once, such
    as a statistic over a sequence split across the group, each rank's own part gets its gradient once."""
    return _AllReduceSumIdentityBackward.apply(x, group)


def _unwrap_float8(t: torch.Tensor) -> torch.Tensor:
    """`t` without torchao's float8 all-gather wrapper (`WeightWithDynamicFloat8CastTensor`), same storage.

    Checked by duck type (a tensor subclass holding `_tensor`), so nothing here imports torchao."""
    if type(t) not in (torch.Tensor, torch.nn.Parameter) and isinstance(getattr(t, "_tensor", None), torch.Tensor):
        return t._tensor
    return t


def plain_tensor(t: torch.Tensor, *, local: bool = False) -> torch.Tensor:
    """`t` unwrapped from torchao's fp8 all-gather wrapper; with local=True also a DTensor's local shard.

    local=True is what an optimizer updates in place. Not DTensor.to_local(): that is an autograd function call,
    which per tensor and per step was most of the optimizer's host time (the GPU waited on it). Not the wrapper:
    once FP8 scales are precomputed it holds a scale tensor that torchao's __tensor_flatten__ tests for truth,
    which compiled code cannot do (the compiled update failed from step 2 under fp8 + FSDP2 + bf16 master weights).
    local=False keeps a DTensor a DTensor (checkpoints save global tensors), with its local tensor unwrapped.
    """
    if not isinstance(t, DTensor):
        return _unwrap_float8(t)
    inner = _unwrap_float8(t._local_tensor)
    if local:
        return inner
    if inner is t._local_tensor:
        return t
    return DTensor.from_local(inner, t.device_mesh, t.placements, run_check=False, shape=t.shape, stride=t.stride())


@dataclass(frozen=True)
class Layout:
    """Where a local tensor's elements sit in its global tensor: what the rounding's random bits are keyed by."""

    offsets: tuple[int, ...]
    """The local block's offset in the global tensor, per dim."""
    global_shape: tuple[int, ...]

    @property
    def strides(self) -> tuple[int, ...]:
        """The global tensor's contiguous strides."""
        strides = [1] * len(self.global_shape)
        for d in range(len(strides) - 2, -1, -1):
            strides[d] = strides[d + 1] * self.global_shape[d + 1]
        return tuple(strides)

    @classmethod
    def of(cls, p: torch.Tensor) -> Layout:
        """p's layout: a DTensor's local block, or all of a plain tensor."""
        shape = tuple(p.shape)
        if not isinstance(p, DTensor):
            return cls((0,) * len(shape), shape)
        _, offsets = compute_local_shape_and_global_offset(shape, p.device_mesh, p.placements)
        return cls(tuple(offsets), shape)
