"""trainer/checkpoint/staging.py: async saves stage into host buffers kept for the run, also under torch 2.11's
DefaultStager, which empties its stager after every stage (the second save of a run died with KeyError); the buffers
are allocated in the background (touched, then pinned one by one), and a save that races that allocation waits for it."""

from __future__ import annotations

import gc
import threading

import pytest
import torch
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

from trainer.checkpoint import staging
from trainer.checkpoint.staging import RunStager


@pytest.fixture
def torch_2_11_stager(monkeypatch):
    """DefaultStager._stage as torch 2.11 has it: its StateDictStager closed after each stage."""
    staged_once = DefaultStager._stage

    def stage_and_close(self, state_dict, **kwargs):
        staged = staged_once(self, state_dict, **kwargs)
        self._state_dict_stager.close()
        return staged

    monkeypatch.setattr(DefaultStager, "_stage", stage_and_close)


def state() -> dict:
    return {"model": {"w": torch.randn(64, 32), "b": torch.zeros(32)}, "optimizer": {"step": torch.tensor(3.0)}}


def test_the_emulated_torch_2_11_stager_fails_a_second_stage(torch_2_11_stager) -> None:
    plain = DefaultStager(StagingOptions(use_pinned_memory=False, use_shared_memory=False, use_async_staging=False,
                                         use_non_blocking_copy=False))
    sd = state()
    plain.stage(sd)
    with pytest.raises(KeyError, match="<class 'type'>"):  # what killed the run at its second save on the H200
        plain.stage(sd)


def test_every_save_stages_the_current_values_into_the_first_saves_buffers(torch_2_11_stager) -> None:
    stager = RunStager(pinned=False)
    sd = state()
    first = stager.stage(sd)
    host = {k: v.untyped_storage().data_ptr() for k, v in first["model"].items()}
    for step in range(2):  # training moves the weights in place between saves
        sd["model"]["w"].add_(1.0)
        sd["optimizer"]["step"].add_(1.0)
        again = stager.stage(sd)
        assert torch.equal(again["model"]["w"], sd["model"]["w"]) and again["model"]["w"] is not sd["model"]["w"]
        assert again["optimizer"]["step"].item() == 4.0 + step
        assert {k: v.untyped_storage().data_ptr() for k, v in again["model"].items()} == host
    stager.close()


def test_prestaged_buffers_serve_the_first_save_with_its_values(caplog) -> None:
    """The buffers allocated in the background after the first step are the ones the first save copies into, and
    that save holds the values of its own step."""
    stager = RunStager(pinned=False)
    sd = state()
    with caplog.at_level("INFO", logger="trainer.checkpoint"):
        stager.prestage(sd)
        stager._prestage.join()
    assert "checkpoint: host buffers for 0.0 GiB allocated in the background after the first step in" in caplog.text
    cached = {id(k): v.data_ptr() for k, v in stager._state_dict_stager._cached_storage_mapping.items()}
    assert len(cached) == 3  # w, b and the step: every storage of the state, each once
    sd["model"]["w"].mul_(2.0)  # training goes on before the first save
    first = stager.stage(sd)
    assert torch.equal(first["model"]["w"], sd["model"]["w"])
    assert first["model"]["w"].untyped_storage().data_ptr() == cached[id(sd["model"]["w"].untyped_storage())]
    stager.close()


def test_the_first_save_racing_the_background_allocation_waits_for_it(monkeypatch) -> None:
    """A save that comes while the buffers are still being allocated (a short checkpoint.interval) waits for them,
    allocates none twice, and stages its own values."""
    stager = RunStager(pinned=False)
    sd = {"model": {f"w{i}": torch.randn(256, 64) for i in range(8)}}
    started, go_on, allocated = threading.Event(), threading.Event(), []
    real_touch = staging._touch

    def slow_touch(host):  # the first buffer's pages take long to touch: the save starts meanwhile
        allocated.append(host.nbytes())
        if len(allocated) == 1:
            started.set()
            go_on.wait(10)
        real_touch(host)

    monkeypatch.setattr(staging, "_touch", slow_touch)
    stager.prestage(sd)
    assert started.wait(10)
    for t in sd["model"].values():
        t.add_(1.0)  # the step the save is of
    threading.Timer(0.2, go_on.set).start()
    staged = stager.stage(sd)
    assert all(torch.equal(staged["model"][k], sd["model"][k]) for k in sd["model"])
    assert len(allocated) == 8  # each buffer once, by the background thread
    stager.close()


def test_a_save_allocates_what_the_background_did_not(caplog) -> None:
    """A tensor that did not exist when the background allocation ran (or a failed one) gets its buffer from the
    save; the buffers already there are reused."""
    stager = RunStager(pinned=False)
    sd = state()
    stager.prestage(sd)
    stager._prestage.join()
    sd["optimizer"]["exp_avg"] = torch.ones(16)
    staged = stager.stage(sd)
    assert torch.equal(staged["optimizer"]["exp_avg"], torch.ones(16))
    assert len(stager._state_dict_stager._cached_storage_mapping) == 4
    stager.close()


def test_a_failed_prestage_is_a_warning_and_the_save_allocates(monkeypatch, caplog) -> None:
    stager = RunStager(pinned=False)
    calls = []
    allocate = stager.allocate

    def fail_once(state_dict):
        calls.append(1)
        if len(calls) == 1:
            raise MemoryError("host memory")
        return allocate(state_dict)

    monkeypatch.setattr(stager, "allocate", fail_once)
    sd = state()
    stager.prestage(sd)
    with caplog.at_level("WARNING", logger="trainer.checkpoint"):
        staged = stager.stage(sd)
    assert "allocating the host buffers in the background failed (MemoryError: host memory); this save allocates" \
        in caplog.text
    assert torch.equal(staged["model"]["w"], sd["model"]["w"])
    stager.close()


def test_pinned_buffers_are_touched_then_registered_one_by_one_and_unregistered_when_freed(monkeypatch) -> None:
    """With pinned memory every buffer's pages are touched before cudaHostRegister (which else faults them in under
    CUDA's lock), one call per buffer, and each is unregistered once the stager lets it go."""
    events = []

    class FakeCudart:
        def cudaHostRegister(self, ptr, size, flags):
            events.append(("register", ptr, size, flags))
            return 0

        def cudaHostUnregister(self, ptr):
            events.append(("unregister", ptr))
            return 0

    real_touch = staging._touch

    def touch(host):
        events.append(("touch", host.data_ptr()))
        real_touch(host)

    monkeypatch.setattr(torch.cuda, "cudart", lambda: FakeCudart())
    monkeypatch.setattr(staging, "_touch", touch)
    stager = RunStager(pinned=False)
    stager._state_dict_stager.pin_memory = True  # there is no CUDA here: the stager pins through the fake cudart
    sd = {"model": {"w": torch.randn(300, 300), "b": torch.zeros(7)}, "step": torch.tensor(1.0)}
    nbytes, _, _ = stager.allocate(sd)
    assert nbytes == 300 * 300 * 4 + 7 * 4 + 4
    registered = [e for e in events if e[0] == "register"]
    assert [e[2] for e in registered] == [300 * 300 * 4, 28]  # the 4-byte step is not pinned (DCP's own rule)
    assert all(flags == 1 for *_, flags in registered)  # cudaHostRegisterPortable, as DCP's stager
    for i, event in enumerate(events):
        if event[0] == "register":
            assert ("touch", event[1]) in events[:i]  # its pages were touched first
    staged = stager.stage(sd)
    assert torch.equal(staged["model"]["w"], sd["model"]["w"])
    del staged
    stager.close()
    gc.collect()
    assert sorted(e[1] for e in events if e[0] == "unregister") == sorted(r[1] for r in registered)
