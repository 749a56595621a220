"""Deterministic, resumable, data-parallel batching over a sample source.

A step of M microbatches per rank consumes the next G = batch_size * dp_degree * M global sample
positions (M = grad_accum_steps, or fewer during train.batch_size_warmup_tokens' ramp:
trainer/data/batch_warmup.py). Position p is sample
permutation(p // num_samples)[p % num_samples], where the permutation of epoch e comes from
np.random.default_rng([seed, e]). Microbatch m of rank r takes the step's positions
[(m * dp_degree + r) * batch_size, (m * dp_degree + r + 1) * batch_size). So the samples of a
step depend only on G, not on how it is split across ranks and microbatches, and resuming
only needs the number of positions consumed.
"""

import glob
import logging
from pathlib import Path

import numpy as np
import torch

from trainer.data.mix import ORDER as MIX_ORDER
from trainer.data.mix import MixtureSource
from trainer.data.shards import DataError
from trainer.data.sources import DefaultTextSource, SampleSource, ShardSource, StdlibTextSource, SyntheticSource
from trainer.data.tokenizer import tokenizer_fingerprint
from trainer.loss import IGNORE_INDEX

logger = logging.getLogger(__name__)

SOURCES = ("default", "stdlib", "synthetic", "shards")


class TokenDataLoader:
    def __init__(self, source: SampleSource, *, seq_len: int, batch_size: int, grad_accum_steps: int, dp_rank: int,
                 dp_degree: int, seed: int, shuffle: bool = True, eod_mask_id: int | None = None):
        # Invariants: trainer.validate checked the config values these come from.
        assert min(seq_len, batch_size, grad_accum_steps, dp_degree) >= 1
        assert 0 <= dp_rank < dp_degree, (dp_rank, dp_degree)
        self.source = source
        self.seq_len, self.batch_size, self.grad_accum_steps = seq_len, batch_size, grad_accum_steps
        self.dp_rank, self.dp_degree = dp_rank, dp_degree
        self.seed, self.shuffle = seed, shuffle
        self.eod_mask_id = eod_mask_id
        self.num_samples = source.num_samples(seq_len)  # raises DataError when no sample fits
        self.global_batch_size = batch_size * dp_degree * grad_accum_steps
        self.consumed_samples = 0
        self._permutation_epoch, self._permutation = None, None
        # Pinned host memory makes the caller's .to(device, non_blocking=True) truly asynchronous.
        self._pin_memory = torch.cuda.is_available()

    def _permutation_for(self, epoch: int) -> np.ndarray:
        # One epoch's permutation is num_samples int64s (800 MB at 1e8 samples); keep only the current one.
        if self._permutation_epoch != epoch:
            self._permutation = np.random.default_rng([self.seed, epoch]).permutation(self.num_samples)
            self._permutation_epoch = epoch
        return self._permutation

    def sample_indices(self, positions: np.ndarray) -> np.ndarray:
        """Map global sample positions to source sample indices."""
        offsets = positions % self.num_samples
        if not (self.shuffle and self.source.permute):
            return offsets
        epochs = positions // self.num_samples
        indices = np.empty_like(positions)
        for epoch in np.unique(epochs):  # a microbatch spans at most a few epochs
            mask = epochs == epoch
            indices[mask] = self._permutation_for(int(epoch))[offsets[mask]]
        return indices

    def _microbatch(self, start: int) -> tuple[torch.Tensor, torch.Tensor]:
        positions = np.arange(start, start + self.batch_size, dtype=np.int64)
        rows = np.stack([self.source.get_sample(int(i), self.seq_len) for i in self.sample_indices(positions)])
        inputs, labels = split_rows(rows, eod_mask_id=self.eod_mask_id)
        if self._pin_memory:
            inputs, labels = inputs.pin_memory(), labels.pin_memory()
        return inputs, labels

    def next_batch(self, microbatches: int | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """This rank's (inputs, labels) pairs of [batch_size, seq_len] for the next step: `microbatches` of them (a
        step of the batch-size warm-up), by default grad_accum_steps."""
        count = self.grad_accum_steps if microbatches is None else microbatches
        assert 1 <= count <= self.grad_accum_steps, (count, self.grad_accum_steps)
        batch = [self._microbatch(self.consumed_samples + (m * self.dp_degree + self.dp_rank) * self.batch_size)
                 for m in range(count)]
        self.consumed_samples += self.batch_size * self.dp_degree * count
        return batch

    def samples_by_source(self) -> dict[str, int]:
        """A mixture's samples drawn from each source so far, over every rank ({} for one source)."""
        if not isinstance(self.source, MixtureSource):
            return {}
        return dict(zip(self.source.names, self.source.samples_drawn(self.consumed_samples)))

    def state_dict(self) -> dict:
        state = {"consumed_samples": self.consumed_samples, "seed": self.seed, "shuffle": self.shuffle,
                 "seq_len": self.seq_len, "global_batch_size": self.global_batch_size,
                 "num_samples": self.num_samples}
        if isinstance(self.source, MixtureSource):
            state["mix"], state["mix_order"] = self.source.identity(), MIX_ORDER
        return state

    def load_state_dict(self, state: dict) -> None:
        mix = self.source.identity() if isinstance(self.source, MixtureSource) else None
        if state.get("mix") != mix:
            def said(m) -> str:
                try:
                    return ", ".join(f"{name} (weight {w}, {n:,} samples)" for name, w, n in m) if m else "one source"
                except (TypeError, ValueError):  # not what state_dict writes
                    return "unreadable"
            raise DataError(f"cannot resume data loader: the checkpoint's data mixture is {said(state.get('mix'))} but "
                            f"this run's is {said(mix)}; resume with the same data.mix, or set "
                            "checkpoint.restart_data=true to start the data over")
        if mix is not None and state.get("mix_order") != MIX_ORDER:
            raise DataError(f"cannot resume data loader: the checkpoint's data mixture was drawn in "
                            f"{str(state.get('mix_order', 'the stride order of earlier versions'))[:80]}, this trainer "
                            f"draws it in {MIX_ORDER} (the same position holds other samples); set "
                            "checkpoint.restart_data=true to start the data over")
        # The global batch size may change on resume: the position is counted in samples.
        # Anything that changes which sample a position maps to would silently repeat or skip data.
        for key in ("seq_len", "num_samples", "seed", "shuffle"):
            if key not in state:
                raise DataError(f"data loader state has no '{key}'; the checkpoint is not from this loader")
            if state[key] != getattr(self, key):
                raise DataError(f"cannot resume data loader: checkpoint has {key}={state[key]!r} but this run has "
                                f"{key}={getattr(self, key)!r}; resume with the same data, seq_len and seed, "
                                "or set checkpoint.restart_data=true to start the data over (a context extension)")
        self.consumed_samples = int(state["consumed_samples"])


class DataPosition:
    """The data loader's part of a checkpoint (trainer/checkpoint/parts.py): its position, or with
    checkpoint.restart_data the start of the data, said in one line (the checkpoint's position is not used)."""

    def __init__(self, loader: TokenDataLoader, *, restart: bool = False):
        self.loader, self.restart = loader, restart

    def state_dict(self) -> dict:
        return self.loader.state_dict()

    def load_state_dict(self, state: dict) -> None:
        if self.restart:
            logger.info("checkpoint.restart_data=true: the data starts over (the checkpoint's data position, %s "
                        "samples in, is not used)", state.get("consumed_samples"))
        else:
            self.loader.load_state_dict(state)


def shard_paths(path: str) -> list[str]:
    """The shard files `path` names: a folder's *.bin files, or a glob's matches (sorted; empty when none)."""
    return sorted(glob.glob(str(Path(path) / "*.bin"))) if Path(path).is_dir() else sorted(glob.glob(path))


def _shard_paths(path: str, key: str = "data.path") -> list[str]:
    paths = shard_paths(path)
    if not paths:
        raise DataError(f"no shard files found at {key}='{path}'; create them with "
                        "python scripts/prepare_data.py --input FILES --output DIR")
    return paths


def build_source(*, source: str, path: str, tokenizer: str, seed: int, vocab_size: int, seq_len: int,
                 split: str = "train", path_key: str = "data.path") -> SampleSource:
    """Open and check the sample source (every shard header, the vocabulary, room for one sample).

    split='validation' is the held-out text of default/stdlib (never in the train split) and a
    different random stream for synthetic; shards are split by folder (validation.path), not here.
    Part of the validation pass (trainer.validate): it reads headers and memory-maps
    shards, never their tokens, so it is cheap enough to run before distributed init.
    """
    assert source in SOURCES, source  # config parsing checked the choice
    if source in ("default", "stdlib"):
        data = (DefaultTextSource if source == "default" else StdlibTextSource)(vocab_size=vocab_size, split=split)
    elif source == "synthetic":
        data = SyntheticSource(vocab_size=vocab_size, seed=seed, split=split)
    else:
        data = ShardSource(_shard_paths(path, path_key), vocab_size=vocab_size,
                           tokenizer_fingerprint=tokenizer_fingerprint(tokenizer))
    data.num_samples(seq_len)  # raises DataError when no sample fits
    return data


def split_rows(rows: np.ndarray, *, eod_mask_id: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Samples [batch, seq_len + 1] -> (inputs, labels) [batch, seq_len]; with eod_mask_id, the label after each
    such input token (the next document's first token) is IGNORE_INDEX (data.eod_mask_loss)."""
    rows = torch.from_numpy(rows)
    inputs, labels = rows[:, :-1].contiguous(), rows[:, 1:].contiguous()
    if eod_mask_id is not None:
        labels[inputs == eod_mask_id] = IGNORE_INDEX
    return inputs, labels


def build_data_loader(source, *, seed: int, shuffle: bool, seq_len: int, batch_size: int, grad_accum_steps: int,
                      dp_rank: int, dp_degree: int, eod_mask_id: int | None = None) -> TokenDataLoader:
    """The data-parallel loader over a source made (and checked) by build_source."""
    loader = TokenDataLoader(source, seq_len=seq_len, batch_size=batch_size, grad_accum_steps=grad_accum_steps,
                             dp_rank=dp_rank, dp_degree=dp_degree, seed=seed, shuffle=shuffle,
                             eod_mask_id=eod_mask_id)
    mix = isinstance(source, MixtureSource)
    logger.info("data: %r, %s of seq_len %d, global batch %d samples/step (rank %d/%d: %d microbatches of %d), "
                "shuffle=%s", source, "samples drawn by weight" if mix else f"{loader.num_samples} samples", seq_len,
                loader.global_batch_size, dp_rank, dp_degree, grad_accum_steps, batch_size,
                shuffle and (source.permute or mix))
    return loader
