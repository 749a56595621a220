"""train.loss_chunk_tokens: the chunked head + loss equals the plain one and holds one chunk of logits at a time."""

from __future__ import annotations

import dataclasses
import math
import re
import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from trainer.loss import LossFn, chunked_cross_entropy
from trainer.models import FLAVORS, Llama
from trainer.models.layers import clean_fqn
from trainer.parallel.float8 import Float8Options, apply_float8

DEBUG = FLAVORS["debug"]


def debug_model(args=DEBUG) -> Llama:
    model = Llama(args)
    model.init_weights(seed=0)
    return model


def batch(args=DEBUG, *, batch_size: int = 2, seq_len: int = 64, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(0, args.vocab_size, (batch_size, seq_len), generator=g),
            torch.randint(0, args.vocab_size, (batch_size, seq_len), generator=g))


def loss_and_grads(model: Llama, tokens: torch.Tensor, labels: torch.Tensor, *, chunk_tokens: int = 0,
                   loss_fn: LossFn | None = None) -> tuple[torch.Tensor, dict]:
    """The trainer's loss path: loss_fn(model(tokens), labels), the model's own head, plain or chunked."""
    loss_fn = loss_fn or LossFn(model.norm, model.output_head, chunk_tokens=chunk_tokens)
    model.zero_grad(set_to_none=True)
    loss = loss_fn(model(tokens), labels)
    loss.backward()
    return loss.detach(), {clean_fqn(name): p.grad.float().clone() for name, p in model.named_parameters()}


def assert_grads_equal(grads: dict, ref: dict, *, rtol: float) -> None:
    assert grads.keys() == ref.keys()
    for name in ref:
        # Relative to the tensor's largest entry: fp32 sums in another order differ by ~1e-7 of that.
        err = ((grads[name] - ref[name]).abs().max() / ref[name].abs().max()).item()
        assert err < rtol, (name, err)


# 2 x 64 = 128 tokens: 32 divides them, 37 leaves a last chunk of 17, 128 and 500 are one chunk.
@pytest.mark.parametrize("chunk_tokens", [32, 37, 128, 500])
def test_chunked_loss_and_gradients_equal_plain(chunk_tokens: int) -> None:
    model = debug_model()
    tokens, labels = batch()
    ref_loss, ref_grads = loss_and_grads(model, tokens, labels)
    loss, grads = loss_and_grads(model, tokens, labels, chunk_tokens=chunk_tokens)
    assert loss.item() == pytest.approx(ref_loss.item(), rel=1e-6)
    assert_grads_equal(grads, ref_grads, rtol=1e-5)


def test_moe_model_chunked_loss_equals_plain() -> None:
    # MoE models share the loss function; their aux loss (injected in each MoE layer's backward) must not change.
    from trainer.models import build_model

    model = build_model(FLAVORS["debug_moe"])
    model.init_weights(seed=0)
    tokens, labels = batch(FLAVORS["debug_moe"])
    ref_loss, ref_grads = loss_and_grads(model, tokens, labels)
    loss, grads = loss_and_grads(model, tokens, labels, chunk_tokens=37)
    assert loss.item() == pytest.approx(ref_loss.item(), rel=1e-6)
    assert_grads_equal(grads, ref_grads, rtol=1e-5)


def test_chunks_are_the_ones_asked_for(monkeypatch) -> None:
    model = debug_model()
    loss_fn = LossFn(model.norm, model.output_head, chunk_tokens=37)
    sizes = []
    inner = loss_fn.chunk_loss
    monkeypatch.setattr(loss_fn, "chunk_loss", lambda h, labels: (sizes.append(h.shape[0]), inner(h, labels))[1])
    tokens, labels = batch()
    loss_fn(model(tokens), labels)
    assert sizes == [37, 37, 37, 17]


def test_ignored_labels_are_left_out_of_the_mean_as_plain_cross_entropy_does() -> None:
    # Our data never has them; a masked label (-100, F.cross_entropy's ignore_index) must still count the same.
    model = debug_model()
    tokens, labels = batch()
    labels[0, :40] = -100
    ref_loss, ref_grads = loss_and_grads(model, tokens, labels)
    loss, grads = loss_and_grads(model, tokens, labels, chunk_tokens=37)
    assert loss.item() == pytest.approx(ref_loss.item(), rel=1e-6)
    assert_grads_equal(grads, ref_grads, rtol=1e-5)


def test_chunked_cross_entropy_against_float64_reference() -> None:
    g = torch.Generator().manual_seed(0)
    h = torch.randn(3, 50, 16, generator=g, dtype=torch.float64)
    w = torch.randn(40, 16, generator=g, dtype=torch.float64)
    labels = torch.randint(0, 40, (3, 50), generator=g)
    loss = chunked_cross_entropy(lambda x, y: torch.nn.functional.cross_entropy(x @ w.T, y, reduction="sum"), h, labels,
                                 chunk_tokens=16)
    ref = torch.nn.functional.cross_entropy((h @ w.T).flatten(0, 1), labels.flatten(), reduction="sum")
    assert loss.item() == pytest.approx(ref.item(), rel=1e-12)


class PeakLiveBytes(TorchDispatchMode):
    """Peak bytes of the storages that tensors made inside the mode keep alive (CPU, deterministic)."""

    def __init__(self) -> None:
        super().__init__()
        self.storages: dict[int, list[int]] = {}  # data_ptr -> [live tensors on it, bytes]
        self.live = self.peak = 0

    def _release(self, ptr: int) -> None:
        entry = self.storages[ptr]
        entry[0] -= 1
        if entry[0] == 0:
            self.live -= entry[1]
            del self.storages[ptr]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                ptr = storage.data_ptr()
                if ptr not in self.storages:
                    self.storages[ptr] = [0, storage.nbytes()]
                    self.live += storage.nbytes()
                self.storages[ptr][0] += 1
                # Fires when the tensor itself is freed (C++ references included), not just its Python name.
                weakref.finalize(t, self._release, ptr)
        self.peak = max(self.peak, self.live)
        return out


def test_chunked_loss_lowers_peak_memory_by_the_logits() -> None:
    # One block and a vocabulary large next to dim, so the logits dominate as at 8B x vocab 128256.
    args = dataclasses.replace(DEBUG, vocab_size=8192, n_layers=1)
    model = debug_model(args)
    tokens, labels = batch(args, seq_len=256)
    logits_bytes = tokens.numel() * args.vocab_size * 4  # fp32, 16 MiB
    peaks = {}
    for chunk_tokens in (0, 128, 64):
        loss_fn = LossFn(model.norm, model.output_head, chunk_tokens=chunk_tokens)
        with PeakLiveBytes() as mode:
            loss_fn(model(tokens), labels).backward()
        peaks[chunk_tokens] = mode.peak
    # Plain holds fp32 logits, their log-softmax and their gradient at once; 64-token chunks free
    # at least two whole logits' worth, and smaller chunks free more.
    assert peaks[0] - peaks[64] > 2 * logits_bytes, peaks
    assert peaks[64] < peaks[128] < peaks[0], peaks


ALLOC = re.compile(r"^\s*(buf\d+) = empty_strided_cpu\(\(([\d, ]*)\), \([\d, ]*\), torch\.(\w+)\)")
REUSE = re.compile(r"^\s*(buf\d+) = (\w+); del \w+\s+# reuse")
DEL = re.compile(r"^\s*del (buf\d+)\s*$")


def peak_buffer_bytes(code: str) -> int:
    """Peak bytes of the buffers one inductor CPU wrapper allocates (its inputs and reuses of them not counted)."""
    live: dict[str, int] = {}
    current = peak = 0
    for line in code.splitlines():
        if m := ALLOC.match(line):
            live[m.group(1)] = math.prod(int(x) for x in m.group(2).split(",") if x.strip()) * getattr(
                torch, m.group(3)).itemsize
            current += live[m.group(1)]
            peak = max(peak, current)
        elif m := REUSE.match(line):
            live[m.group(1)] = live.pop(m.group(2), 0)
        elif m := DEL.match(line):
            current -= live.pop(m.group(1), 0)
    return peak


@pytest.fixture
def inductor_caches_off():
    """Inductor's caches off for one test, through its config's own patch: monkeypatch.setattr's undo left
    `force_disable_caches` unreadable, and every later compile in the process failed ("does not exist")."""
    import torch._inductor.config

    with torch._inductor.config.patch(force_disable_caches=True):
        yield


def test_compiled_chunked_loss_matches_and_never_holds_the_whole_logits(tmp_path, monkeypatch,
                                                                        inductor_caches_off) -> None:
    """Compiled as the trainer compiles it (LossFn(compile=True)): same loss and gradients, and no compiled graph's
    buffers reach the whole logits. Compiling the whole chunk loop as one graph fails this: inductor then
    schedules every chunk's recomputed logits side by side in one backward (2x the fp32 logits here)."""
    from torch._inductor.utils import run_and_get_code

    # Cold caches (with inductor_caches_off): every graph is compiled here, so run_and_get_code sees its code.
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    # No blocks (their compile is the slow part and not under test): embeddings -> norm -> head -> loss.
    args = dataclasses.replace(DEBUG, vocab_size=8192, n_layers=0)
    model = debug_model(args)
    tokens, labels = batch(args, batch_size=4, seq_len=256)
    logits_bytes = tokens.numel() * args.vocab_size * 4  # 32 MiB
    ref_loss, ref_grads = loss_and_grads(model, tokens, labels)

    # 1024 tokens: 10 chunks of 96 and one of 64, one static graph each
    loss_fn = LossFn(model.norm, model.output_head, chunk_tokens=96, compile=True)
    (loss, grads), codes = run_and_get_code(loss_and_grads, model, tokens, labels, loss_fn=loss_fn)
    assert len(codes) == 4  # forward and backward of both chunk shapes
    # The parser sees a chunk's fp32 logits (96 x 8192 x 4 bytes = 3 MiB), and never the whole batch's.
    assert 96 * args.vocab_size * 4 <= max(map(peak_buffer_bytes, codes)) < logits_bytes / 2
    assert loss.item() == pytest.approx(ref_loss.item(), rel=1e-6)
    assert_grads_equal(grads, ref_grads, rtol=1e-5)


def fp8_model(*, fp8: bool = True) -> Llama:
    from torchao.float8.float8_linear import Float8Linear

    model = debug_model()
    if fp8:
        apply_float8(model, Float8Options(recipe="tensorwise"), device=torch.device("cpu"))
        assert isinstance(model.output_head.proj, Float8Linear)
    model.to(torch.bfloat16)  # the compute dtype FSDP2 gathers fp8 runs' weights in
    return model


def global_rel_err(grads: dict, ref: dict) -> float:
    diff = torch.cat([(grads[n] - ref[n]).flatten() for n in ref])
    return (diff.norm() / torch.cat([ref[n].flatten() for n in ref]).norm()).item()


def test_fp8_head_chunked_is_as_close_to_bf16_as_plain_fp8() -> None:
    # Each chunk scales its own activations and logit gradients (tensorwise amax per chunk), so
    # chunked fp8 rounds differently from plain fp8: it must be no further from bf16 than plain fp8.
    tokens, labels = batch(batch_size=4)
    bf16_loss, bf16_grads = loss_and_grads(fp8_model(fp8=False), tokens, labels)
    plain_loss, plain_grads = loss_and_grads(fp8_model(), tokens, labels)
    loss, grads = loss_and_grads(fp8_model(), tokens, labels, chunk_tokens=96)  # 256 tokens: 96, 96, 64
    assert loss.item() == pytest.approx(plain_loss.item(), rel=1e-3)
    assert loss.item() == pytest.approx(bf16_loss.item(), rel=1e-3)
    plain_err, chunked_err = global_rel_err(plain_grads, bf16_grads), global_rel_err(grads, bf16_grads)
    assert 0 < chunked_err < 1.15 * plain_err, (chunked_err, plain_err)
