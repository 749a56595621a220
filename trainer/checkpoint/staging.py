"""Async checkpoints' staging: one stager for the run, whose host copies of the state every save reuses.

`checkpoint.async_mode` copies this rank's shards to host memory (pinned with `async_with_pinned_mem`) while
training waits, then writes them in the background. The host buffers are allocated (and pinned) once: in a
background thread after the first step (`prestage`), so no save pays for it (16 GB took 11.4 s on an H200 host
when the first save allocated them); every save then only copies into them (16 GB: 0.37 s).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import torch
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

logger = logging.getLogger("trainer.checkpoint")


class RunStager(DefaultStager):
    """DCP's DefaultStager, staging synchronously into host buffers it keeps until `close()`.

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
        return self._state_dict_stager.stage(state_dict, non_blocking=False)

    def prestage(self, state_dict: Any) -> None:
        """Allocate (and pin) the host buffers of `state_dict`'s tensors in a background thread, while training goes
        on. What it copies is thrown away (training moves on meanwhile); the next `stage` waits for it to finish."""
        device = torch.cuda.current_device() if torch.cuda.is_available() else None
        nbytes = sum(t.numel() * t.element_size() for t in _tensors(state_dict))

        def allocate() -> None:
            start = time.perf_counter()
            try:
                if device is not None:
                    torch.cuda.set_device(device)  # else this thread would open a context on GPU 0
                self._stage(state_dict)
                logger.info("checkpoint: host buffers for %.1f GiB allocated in the background in %.1f s (every save "
                            "copies into them)", nbytes / 2**30, time.perf_counter() - start)
            except BaseException as e:  # reported by the next stage, which allocates them itself then
                self._prestage_error = e

        self._prestage = threading.Thread(target=allocate, name="checkpoint-prestage", daemon=True)
        self._prestage.start()

    def stage(self, state_dict: Any, **kwargs: Any) -> Any:
        self._join_prestage()
        return super().stage(state_dict, **kwargs)

    def close(self) -> None:
        self._join_prestage()
        super().close()

    def _join_prestage(self) -> None:
        if self._prestage is None:
            return
        self._prestage.join()
        self._prestage = None
        if self._prestage_error is not None:
            logger.warning("checkpoint: allocating the host buffers in the background failed (%s: %s); this save "
                           "allocates them", type(self._prestage_error).__name__, self._prestage_error)
            self._prestage_error = None


def _tensors(tree: Any) -> list[torch.Tensor]:
    """The (local) tensors of a nested dict."""
    if isinstance(tree, torch.Tensor):
        return [tree.to_local() if hasattr(tree, "to_local") else tree]
    if isinstance(tree, dict):
        return [t for v in tree.values() for t in _tensors(v)]
    return []
