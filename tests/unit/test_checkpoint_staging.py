"""trainer/checkpoint/staging.py: async saves stage into host buffers kept for the run, also under torch 2.11's
DefaultStager, which empties its stager after every stage (the second save of a run died with KeyError)."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

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
    """The buffers allocated in the background after step 1 are the ones the first save copies into, and that save
    holds the values of its own step, not what the background copy read."""
    stager = RunStager(pinned=False)
    sd = state()
    with caplog.at_level("INFO", logger="trainer.checkpoint"):
        stager.prestage(sd)
        stager._prestage.join()
    assert "checkpoint: host buffers for 0.0 GiB allocated in the background" in caplog.text
    cached = {id(k): v.data_ptr() for k, v in stager._state_dict_stager._cached_storage_mapping.items()}
    sd["model"]["w"].mul_(2.0)  # training goes on before the first save
    first = stager.stage(sd)
    assert torch.equal(first["model"]["w"], sd["model"]["w"])
    assert first["model"]["w"].untyped_storage().data_ptr() == cached[id(sd["model"]["w"].untyped_storage())]
    stager.close()


def test_a_failed_prestage_is_a_warning_and_the_save_allocates(monkeypatch, caplog) -> None:
    stager = RunStager(pinned=False)
    calls = []

    def fail_once(state_dict, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise MemoryError("host memory")
        return RunStager._stage(stager, state_dict, **kwargs)

    monkeypatch.setattr(stager, "_stage", fail_once)
    sd = state()
    stager.prestage(sd)
    with caplog.at_level("WARNING", logger="trainer.checkpoint"):
        staged = stager.stage(sd)
    assert "allocating the host buffers in the background failed (MemoryError: host memory); this save allocates" \
        in caplog.text
    assert torch.equal(staged["model"]["w"], sd["model"]["w"])
    stager.close()
