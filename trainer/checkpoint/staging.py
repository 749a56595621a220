"""Async checkpoints' staging: one stager for the run, whose host copies of the state every save reuses.

`checkpoint.async_mode` copies this rank's shards to host memory (pinned with `async_with_pinned_mem`) while
training waits, then writes them in the background. The host buffers are allocated once, in a background thread
after step 1 (`prestage`), when every state tensor exists (AdamW makes its moments at its first step); every save
then only copies into them (16 GB: 0.37 s on an H200 host).

How they are allocated decides what training pays for them. DCP's stager allocates each buffer untouched and pins
it with `cudaHostRegister`, which then faults in every page while it holds the CUDA driver's lock, and copies the
state into it: steps 2-10 of a run took 8.4 s longer while 16 GB were allocated so in the background
(docs/benchmarks/2026-11-26-h200-whole-8b-checkpoint-stall-long-context.md). Here every page is first touched by
plain CPU threads, outside the driver, and only then registered, one buffer at a time (the largest buffer of the whole
8B over 2 GPUs is 0.5 GB), as PyTorch's own pinned allocator does with `pinned_use_cuda_host_register` ("minimize the
cost for the cuda global lock", c10's CUDA CachingHostAllocator); nothing is copied (the first save copies its own
step's values). The log line says how long each part took.
"""

from __future__ import annotations

import ctypes
import logging
import threading
import time
import weakref
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.tensor import DTensor

logger = logging.getLogger("trainer.checkpoint")

TOUCH_CHUNK_BYTES = 64 * 2**20  # the pages of a buffer are touched in pieces of this size, by TOUCH_THREADS threads
TOUCH_THREADS = 4


class RunStager(DefaultStager):
    """DCP's DefaultStager, staging synchronously into host buffers it keeps until `close()`, allocated by
    `allocate` (in the background by `prestage`, or by the save that finds one missing).

    torch 2.11's DefaultStager._stage empties its StateDictStager after every stage (a leak fix for a stager made per
    save): the host buffers were dropped, and the stager's next stage raised `KeyError: <class 'type'>`, so an async
    run died at its second save (1x H200, 2026-11-26). torch 2.13 keeps them until close(); this does so on both.
    """

    def __init__(self, *, pinned: bool):
        super().__init__(StagingOptions(use_pinned_memory=pinned, use_shared_memory=False, use_async_staging=False,
                                        use_non_blocking_copy=False))
        self._prestage: threading.Thread | None = None
        self._prestage_error: BaseException | None = None

    def _stage(self, state_dict: Any, **kwargs: Any) -> Any:
        self._join_prestage()
        self.allocate(state_dict)  # what the background allocation did not (it failed, or found another tensor)
        return self._state_dict_stager.stage(state_dict, non_blocking=False)

    def allocate(self, state_dict: Any) -> tuple[int, float, float]:
        """A host buffer (pinned if this stager pins) for each tensor storage of `state_dict` that has none yet, where
        DCP's stager looks for it. Returns (bytes allocated, seconds touching their pages, seconds pinning them)."""
        stager = self._state_dict_stager
        cache = stager._cached_storage_mapping  # storage -> its host copy, which every stage copies into
        nbytes, touching, pinning = 0, 0.0, 0.0
        for storage in _storages(state_dict):
            if storage in cache:
                continue
            start = time.perf_counter()
            host = torch.UntypedStorage(storage.nbytes(), device="cpu")
            _touch(host)
            touched = time.perf_counter()
            if stager.pin_memory and host.nbytes() >= stager.pin_memory_min_bytes:  # as DCP's stager decides
                _pin(host)
            pinning += time.perf_counter() - touched
            touching += touched - start
            nbytes += host.nbytes()
            cache[storage] = host
        return nbytes, touching, pinning

    def prestage(self, state_dict: Any) -> None:
        """`allocate` in a background thread, while training goes on; the next stage waits for it to finish."""
        device = torch.cuda.current_device() if torch.cuda.is_available() else None

        def allocate() -> None:
            start = time.perf_counter()
            try:
                if device is not None:
                    torch.cuda.set_device(device)  # else this thread would open a context on GPU 0
                nbytes, touching, pinning = self.allocate(state_dict)
                pinned = f", pinned in {pinning:.1f} s" if self._state_dict_stager.pin_memory else ""
                logger.info("checkpoint: host buffers for %.1f GiB allocated in the background after the first step in "
                            "%.1f s (pages touched in %.1f s%s; every save copies into them)", nbytes / 2**30,
                            time.perf_counter() - start, touching, pinned)
            except BaseException as e:  # reported by the next stage, which allocates the rest itself then
                self._prestage_error = e

        self._prestage = threading.Thread(target=allocate, name="checkpoint-prestage", daemon=True)
        self._prestage.start()

    def close(self) -> None:
        self._join_prestage()
        super().close()

    def _join_prestage(self) -> None:
        if self._prestage is None:
            return
        start = time.perf_counter()
        self._prestage.join()
        self._prestage = None
        if (waited := time.perf_counter() - start) > 0.05:
            logger.info("checkpoint: this save waited %.2f s for the host buffers being allocated in the background",
                        waited)
        if self._prestage_error is not None:
            logger.warning("checkpoint: allocating the host buffers in the background failed (%s: %s); this save "
                           "allocates them", type(self._prestage_error).__name__, self._prestage_error)
            self._prestage_error = None


def _storages(tree: Any) -> list[torch.UntypedStorage]:
    """The storages of a nested dict's plain tensors (a DTensor's local shard), each once, in order: what DCP's stager
    copies. A tensor subclass is left to the stager (it allocates its buffer itself, at the first save)."""
    found: dict[int, torch.UntypedStorage] = {}

    def walk(value: Any) -> None:
        if isinstance(value, dict):
            for v in value.values():
                walk(v)
        elif isinstance(value, torch.Tensor):
            local = value.to_local() if isinstance(value, DTensor) else value  # DCP's stager copies the local shard
            if type(local) is torch.Tensor and local.data_ptr() != 0:
                storage = local.untyped_storage()  # one Python object per storage: the stager's cache key
                found.setdefault(id(storage), storage)

    with torch.no_grad():  # to_local() is then the shard itself
        walk(tree)
    return list(found.values())


def _touch(host: torch.UntypedStorage) -> None:
    """Fault in every page of a new buffer now, from plain CPU threads: ctypes.memset releases the GIL and, unlike a
    torch fill_, starts no intra-op threads of its own beside training's."""
    base, n = host.data_ptr(), host.nbytes()
    starts = range(0, n, TOUCH_CHUNK_BYTES)
    if len(starts) <= 1:
        ctypes.memset(base, 0, n)
        return
    with ThreadPoolExecutor(min(TOUCH_THREADS, len(starts)), thread_name_prefix="checkpoint-touch") as pool:
        list(pool.map(lambda start: ctypes.memset(base + start, 0, min(TOUCH_CHUNK_BYTES, n - start)), starts))


def _pin(host: torch.UntypedStorage) -> None:
    """Register a host buffer with CUDA (page-locked: the copies into it run at the link's speed), unregistered when
    it is freed; as DCP's stager pins (cudaHostRegisterPortable)."""
    error = int(torch.cuda.cudart().cudaHostRegister(host.data_ptr(), host.nbytes(), 1))
    if error != 0:
        raise RuntimeError(f"pinning {host.nbytes():,} bytes of host memory failed with CUDA error {error}")
    finalizer = weakref.finalize(host, _unpin, host.data_ptr())
    finalizer.atexit = False  # never after the CUDA context is gone


def _unpin(data_ptr: int) -> None:
    torch.cuda.cudart().cudaHostUnregister(data_ptr)
