"""Model shapes, names, FLOPs, and logits against an independent float64 implementation."""

from __future__ import annotations

import dataclasses

import math
import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F

from tests.helpers import REPO
from trainer.loss import LossFn
from trainer.models.counts import num_params_for, param_count
from trainer.models import FLAVORS, Llama, build_model, flops_per_token, model_args_for, num_params
from trainer.models.llama import ModelArgs, RopeScaling, rope_inv_freq
from trainer.parallel.compile import apply_compile


def test_module_names_are_the_contract() -> None:
    with torch.device("meta"):
        model = Llama(FLAVORS["debug"])
    names = {n for n, _ in model.named_modules()}
    for i in range(FLAVORS["debug"].n_layers):
        for sub in ("attention.q_proj", "attention.k_proj", "attention.v_proj", "attention.o_proj",
                    "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj", "attention_norm", "mlp_norm"):
            assert f"layers.{i}.{sub}" in names
    assert {"tok_embeddings", "norm", "output_head.proj"} <= names
    # Only learned weights are in the state dict (rope cache is derived).
    assert all(k.endswith("weight") for k in model.state_dict())


@pytest.mark.parametrize(
    "flavor, params_b, ffn",
    [("1b", 1.498, 8192), ("3b", 3.607, 8192), ("8b", 8.030, 14336), ("70b", 70.554, 28672), ("405b", 405.853, 53248)],
)
def test_published_llama3_shapes(flavor: str, params_b: float, ffn: int) -> None:
    args = FLAVORS[flavor]
    assert args.ffn_dim == ffn
    with torch.device("meta"):  # never allocates
        model = Llama(args)
    # Untied embeddings: 8B is the published 8.03B, 1B/3B are the published counts plus an untied head.
    assert num_params(model) / 1e9 == pytest.approx(params_b, abs=1e-3)
    assert args.vocab_size == 128256 and args.n_kv_heads == 8


@pytest.mark.parametrize("flavor", sorted(FLAVORS))
def test_param_count_matches_the_built_model(flavor: str) -> None:
    """Validation sizes a model from its shapes (param_count: parameters and the MoE expert biases a checkpoint
    stores) before building it: exact for every family."""
    args = model_args_for(flavor, n_layers=3)
    with torch.device("meta"):
        model = build_model(args)
    biases = sum(b.numel() for name, b in model.named_buffers() if name.endswith("expert_bias"))
    assert param_count(args) == num_params(model) + biases


@pytest.mark.parametrize("flavor", sorted(FLAVORS))
@pytest.mark.parametrize("n_layers", [0, 3])  # 0: the flavor's own depth (MoE flavors' dense layers included)
def test_the_logged_parameter_counts_equal_the_built_models(flavor: str, n_layers: int) -> None:
    """The startup line's counts come from the shapes (num_params_for: under pp no rank builds the whole model):
    exactly num_params of the whole model, with and without the embedding table."""
    args = model_args_for(flavor, n_layers=n_layers)
    with torch.device("meta"):
        model = build_model(args)
    assert num_params_for(args) == (num_params(model), num_params(model, exclude_embeddings=True))


def test_flops_per_token_counts_every_matmul() -> None:
    args = FLAVORS["debug"]
    model = Llama(args)
    seq = 64
    n_matmul = sum(p.numel() for n, p in model.named_parameters() if p.ndim == 2 and "tok_embeddings" not in n)
    n_norm = sum(p.numel() for n, p in model.named_parameters() if p.ndim == 1)
    expected = 6 * (n_matmul + n_norm) + 12 * args.n_layers * args.n_heads * args.head_dim * seq
    assert flops_per_token(args, seq) == expected
    # 8B: 6N dominates and the attention term is 12*L*H*Dh*S.
    big = FLAVORS["8b"]
    attn = 12 * 32 * 32 * 128 * 4096
    assert flops_per_token(big, 4096) - flops_per_token(big, 0) == attn


def test_overrides_and_bad_flavor() -> None:
    args = model_args_for("8b", n_layers=8, vocab_size=1024, max_seq_len=16384)
    assert (args.n_layers, args.vocab_size, args.max_seq_len) == (8, 1024, 16384)
    with pytest.raises(ValueError, match="model.flavor='9b' is not one of"):
        model_args_for("9b")


def test_llama3_rope_scaling_matches_formula() -> None:
    # Transformers' llama3 rope: low frequencies / factor, high kept, smooth in between.
    args = ModelArgs(dim=4096, n_layers=1, n_heads=32, n_kv_heads=8, vocab_size=16, rope_scaling=RopeScaling(factor=8.0))
    base = 1.0 / (500000.0 ** (torch.arange(0, 128, 2, dtype=torch.float64) / 128))
    got = rope_inv_freq(args).double()
    for f, g in zip(base.tolist(), got.tolist()):
        wavelen = 2 * math.pi / f
        if wavelen < 8192 / 4:
            want = f
        elif wavelen > 8192 / 1:
            want = f / 8
        else:
            smooth = (8192 / wavelen - 1) / (4 - 1)
            want = (1 - smooth) * f / 8 + smooth * f
        assert g == pytest.approx(want, rel=1e-6)


def test_rope_table_bytes_are_the_table_rope_cache_builds() -> None:
    """The family's RoPE table size (the memory plan's row, a load's host-memory check) is its table's bytes."""
    from trainer.models.layers import rope_cache, rope_table_bytes

    # Qwen3's head_dim (128 at dim 1,024 x 16 heads) is set apart from dim // n_heads
    for args in (FLAVORS["debug"], FLAVORS["8b"], dataclasses.replace(FLAVORS["debug"], explicit_head_dim=48)):
        table = rope_cache(args, 300)
        assert rope_table_bytes(args, 300) == table.numel() * table.element_size()


def reference_llama(model: Llama, tokens: torch.Tensor) -> torch.Tensor:
    """An independent float64 Llama: explicit per-head loops, complex-number RoPE on half-split pairs."""
    args = model.args
    sd = {k: v.double() for k, v in model.state_dict().items()}
    hd, nh, nkv = args.head_dim, args.n_heads, args.n_kv_heads
    bsz, seq = tokens.shape

    def rms(x, w):
        return x / torch.sqrt((x * x).mean(-1, keepdim=True) + args.norm_eps) * w

    inv = rope_inv_freq(args).double()
    angles = torch.arange(seq, dtype=torch.float64)[:, None] * inv[None, :]  # [seq, hd/2]
    rot = torch.polar(torch.ones_like(angles), angles)

    def rope(x):  # x: [seq, hd]; pairs are (i, i + hd/2) in the rotate-half layout
        z = torch.complex(x[:, : hd // 2], x[:, hd // 2:]) * rot
        return torch.cat([z.real, z.imag], dim=-1)

    h = sd["tok_embeddings.weight"][tokens]
    mask = torch.full((seq, seq), float("-inf"), dtype=torch.float64).triu(1)
    for i in range(args.n_layers):
        p = f"layers.{i}."
        x = rms(h, sd[p + "attention_norm.weight"])
        q = x @ sd[p + "attention.q_proj.weight"].T
        k = x @ sd[p + "attention.k_proj.weight"].T
        v = x @ sd[p + "attention.v_proj.weight"].T
        out = torch.zeros(bsz, seq, nh * hd, dtype=torch.float64)
        for b in range(bsz):
            for head in range(nh):
                kv = head // (nh // nkv)
                qh = rope(q[b, :, head * hd:(head + 1) * hd])
                kh = rope(k[b, :, kv * hd:(kv + 1) * hd])
                vh = v[b, :, kv * hd:(kv + 1) * hd]
                att = torch.softmax(qh @ kh.T / math.sqrt(hd) + mask, dim=-1)
                out[b, :, head * hd:(head + 1) * hd] = att @ vh
        h = h + out @ sd[p + "attention.o_proj.weight"].T
        x = rms(h, sd[p + "mlp_norm.weight"])
        gate = x @ sd[p + "mlp.gate_proj.weight"].T
        up = x @ sd[p + "mlp.up_proj.weight"].T
        h = h + (gate * torch.sigmoid(gate) * up) @ sd[p + "mlp.down_proj.weight"].T
    return rms(h, sd["norm.weight"]) @ sd["output_head.proj.weight"].T


def test_logits_match_independent_float64_reference() -> None:
    args = ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=96, multiple_of=32,
                     rope_theta=10000.0, rope_scaling=RopeScaling(factor=4.0, original_max_seq_len=16), max_seq_len=32)
    model = Llama(args)
    model.init_weights(seed=3)
    with torch.no_grad():  # non-trivial norms, so a wrong norm placement shows
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    tokens = torch.randint(0, args.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    model.double()
    model.rope = model.rope.double()
    ours = model.logits(tokens)
    ref = reference_llama(model, tokens)
    assert ours.shape == (2, 24, 96)
    err = (ours - ref).norm() / ref.norm()
    # Our RMSNorm and rope cache compute in fp32 by design, so agreement is fp32-level.
    assert err < 1e-6, err
    # And the loss path (hidden states -> the trainer's loss function) equals cross-entropy on those logits.
    labels = torch.randint(0, args.vocab_size, (2, 24), generator=torch.Generator().manual_seed(1))
    loss = LossFn(model.norm, model.output_head)(model(tokens), labels)
    assert loss.item() == pytest.approx(F.cross_entropy(ref.flatten(0, 1), labels.flatten()).item(), rel=1e-6)


def test_init_is_deterministic_and_depth_scaled() -> None:
    a, b = Llama(FLAVORS["debug"]), Llama(FLAVORS["debug"])
    a.init_weights(seed=0)
    b.init_weights(seed=0)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    b.init_weights(seed=1)
    assert not torch.equal(a.tok_embeddings.weight, b.tok_embeddings.weight)
    n = FLAVORS["debug"].n_layers
    assert a.layers["0"].attention.o_proj.weight.std().item() == pytest.approx(0.02 / math.sqrt(2 * n), rel=0.15)
    assert a.layers["0"].attention.q_proj.weight.std().item() == pytest.approx(0.02, rel=0.15)
    assert torch.all(a.norm.weight == 1)


def test_blocks_and_loss_compile_without_pointwise_autotuning_and_nothing_else_changes(monkeypatch) -> None:
    """The blocks' graphs and the head-and-loss graph skip inductor's pointwise autotuning (seconds of an fp8 cold
    start on 1x H200, steps at the same speed: docs/benchmarks.md#cold-start), as an option of their own compiles:
    inductor's process-wide default stays on, and the compiled model and loss compute what the eager ones do."""
    model = Llama(FLAVORS["debug"])
    model.init_weights(seed=0)
    tokens = torch.randint(0, FLAVORS["debug"].vocab_size, (2, 16))
    labels = torch.randint(0, FLAVORS["debug"].vocab_size, (2, 16))
    h = torch.randn(2, 16, FLAVORS["debug"].dim)
    eager, eager_loss = model(tokens), LossFn(model.norm, model.output_head)(h, labels)
    compiles, real = [], torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: compiles.append(kw) or real(fn, **kw))
    assert "pointwise kernels not autotuned" in apply_compile(model, context_parallel=False)
    loss_fn = LossFn(model.norm, model.output_head, compile=True)
    assert len(compiles) == len(model.layers) + 1
    assert all(kw["options"] == {"triton.autotune_pointwise": False} for kw in compiles)
    assert torch._inductor.config.triton.autotune_pointwise is True
    torch.testing.assert_close(model(tokens), eager, rtol=1e-5, atol=1e-5)  # fp32: inductor reorders a few sums
    torch.testing.assert_close(loss_fn(h, labels), eager_loss, rtol=1e-5, atol=1e-5)


def test_start_compile_workers_starts_the_pool_inductor_then_finds() -> None:
    """start_compile_workers (at the Trainer's start) starts inductor's own compile-worker pool early on a GPU with
    compile, the one inductor's first graph then finds (docs/benchmarks.md#cold-start): where Triton is installed the
    pool exists after it and inductor's own warm-up creates none; without Triton it starts nothing, as inductor
    would not. In a process of its own: the pool lives until that process exits."""
    code = textwrap.dedent("""
        import torch._inductor.async_compile as ac
        from torch.utils._triton import has_triton_package
        from trainer.parallel.compile import start_compile_workers
        start_compile_workers(compile=False, device_type="cuda")
        start_compile_workers(compile=True, device_type="cpu")
        assert ac.AsyncCompile.process_pool.cache_info().currsize == 0  # nothing without compile or off a GPU
        start_compile_workers(compile=True, device_type="cuda")
        started = ac.AsyncCompile.process_pool.cache_info().currsize
        ac.maybe_warm_pool()  # what inductor's backend runs at its first graph
        print(has_triton_package(), started, ac.AsyncCompile.process_pool.cache_info().misses)
    """)
    env = {**os.environ, "TORCHINDUCTOR_COMPILE_THREADS": "2"}
    env.pop("TORCH_WARM_POOL", None)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300,
                         cwd=REPO)
    assert out.returncode == 0, out.stderr[-2000:]
    triton, started, created = out.stdout.split()
    assert (started, created) == (("1", "1") if triton == "True" else ("0", "0")), out.stdout
