"""GPT-OSS's own pieces (trainer/models/gpt_oss.py, sink_attention.py) against plain references: the sink attention's
two paths, document masking with the window, the biased clamped experts on the grouped GEMM against a per-expert loop
in float64. Parity with transformers: tests/unit/test_hf_gpt_oss.py."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.nn.attention.flex_attention import create_block_mask

from trainer.hf import ExportError
from trainer.hf.gpt_oss import check_exportable
from trainer.models import build_model, param_counts
from trainer.models.counts import num_params_for, num_tensors, param_count
from trainer.models.documents import attention_mask, document_ids
from trainer.models.gpt_oss import FLAVORS, ClampedSwiGLU, GptOssExperts
from trainer.models.sink_attention import dense_window_mask, sink_attention
from trainer.parallel.float8.blockwise import BlockwiseFloat8Linear


def _reference(q, k, v, sinks, allowed):
    """Per query: softmax over its allowed keys and the sink, in float64, the sink's share dropped."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1).double(), v.repeat_interleave(rep, 1).double()
    scores = (q.double() @ k.transpose(-2, -1)) / q.shape[-1] ** 0.5
    scores = scores.masked_fill(~allowed, float("-inf"))
    weights = scores.exp() / (scores.exp().sum(-1, keepdim=True) + sinks.double().exp().view(1, -1, 1, 1))
    return (weights @ v).float()


def _qkv(seq=40, heads=4, kv=2, dim=16):
    gen = torch.Generator().manual_seed(0)
    return (torch.randn(2, heads, seq, dim, generator=gen), torch.randn(2, kv, seq, dim, generator=gen),
            torch.randn(2, kv, seq, dim, generator=gen), torch.randn(heads, generator=gen))


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_sink_attention_dense_and_flex_paths_equal_the_reference():
    q, k, v, sinks = _qkv()
    for window in (0, 8):
        allowed = dense_window_mask(40, window, q.device)
        expected = _reference(q, k, v, sinks, allowed)
        assert torch.allclose(sink_attention(q, k, v, sinks, window=window, mask=None), expected, atol=1e-5)
        # The GPU's path (FlexAttention and its logsumexp), forward on a CPU: a BlockMask of documents.
        docs = torch.tensor([[0] * 25 + [1] * 15, [0] * 40])
        dense = attention_mask(docs)  # a CPU's document mask: dense boolean
        same_doc = create_block_mask(lambda b, h, qi, kvi: (kvi <= qi) & (docs[b, qi] == docs[b, kvi]), 2, None, 40,
                                     40, device="cpu")
        expected = _reference(q, k, v, sinks, allowed & dense)
        assert torch.allclose(sink_attention(q, k, v, sinks, window=window, mask=dense), expected, atol=1e-5)
        assert torch.allclose(sink_attention(q, k, v, sinks, window=window, mask=same_doc), expected, atol=1e-5)


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_context_parallel_chunks_attend_as_the_whole_sequence():
    """A cp rank's two query chunks (of 2 x cp) against the whole sequence's keys give those rows of the whole
    sequence's attention, window and sinks included; the GPU's FlexAttention path (forward on a CPU) too."""
    from trainer.models.sink_attention import block_mask_for, chunk_sink_attention, flex_sink_attention

    q, k, v, sinks = _qkv(seq=48)
    for window in (0, 8):
        whole = sink_attention(q, k, v, sinks, window=window, mask=None)
        for chunks in ((0, 3), (1, 2)):  # cp=2's two ranks, chunks of 12
            rows = torch.cat([torch.arange(j * 12, (j + 1) * 12) for j in chunks])
            local = chunk_sink_attention(q[:, :, rows], k, v, sinks, window=window, chunks=chunks)
            assert torch.allclose(local, whole[:, :, rows], atol=1e-5)
        # The GPU's path for the same chunk (FlexAttention, forward on a CPU): chunk 2 of 4, its keys before it.
        flex_mask = block_mask_for(None, 12, 36, window, q.device, q_offset=24)
        expected = _reference(q[:, :, 24:36], k[:, :, :36], v[:, :, :36], sinks,
                              dense_window_mask(12, window, q.device, kv_len=36, q_offset=24))
        got = flex_sink_attention(q[:, :, 24:36], k[:, :, :36], v[:, :, :36], sinks, flex_mask)
        assert torch.allclose(got, expected, atol=1e-5)
        assert torch.allclose(got, whole[:, :, 24:36], atol=1e-5)


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_a_cp_ranks_queries_under_a_document_mask_attend_as_the_whole_row():
    """Context parallel with document masking: a rank's two query chunks at their global positions, against the
    whole rows' keys, under causal and same document and (sliding layers) the window at those positions, with the
    sink in the denominator: against a mask written out per (query, key) pair in Python and the float64 softmax,
    and the rows of the whole sequence's attention; the dense (CPU) path and the BlockMask (GPU) path alike.
    Documents cross the chunk boundaries (chunks of 12) and are longer than the window (5)."""
    from trainer.models.documents import block_mask
    from trainer.parallel.context_parallel import ContextParallel

    q, k, v, sinks = _qkv(seq=48)
    docs = document_ids(torch.tensor([[7] * 9 + [1] + [7] * 20 + [1] + [7] * 17, [7] * 47 + [1]]), eos_id=1)[0]
    assert docs[0].tolist() == [0] * 10 + [1] * 21 + [2] * 17
    for window in (0, 5):
        whole = sink_attention(q, k, v, sinks, window=window, mask=attention_mask(docs))
        for rank in (0, 1):
            positions = ContextParallel(group=None, rank=rank, size=2).positions(24, q.device)
            allowed = torch.tensor([[[kv <= p and docs[b, kv] == docs[b, p] and (not window or p - kv < window)
                                      for kv in range(48)] for p in positions.tolist()] for b in range(2)])
            expected = _reference(q[:, :, positions], k, v, sinks, allowed[:, None])
            for mask in (attention_mask(docs, positions), block_mask(docs, positions)):
                got = sink_attention(q[:, :, positions], k, v, sinks, window=window, mask=mask, positions=positions)
                assert torch.allclose(got, expected, atol=1e-5), (window, rank, type(mask))
                assert torch.allclose(got, whole[:, :, positions], atol=1e-5)


def test_document_masking_composes_with_the_window():
    """A packed row of two documents gives each document's logits as if it were alone (window and all)."""
    args = replace(FLAVORS["debug_gpt_oss"], n_layers=2, sliding_window=6, max_seq_len=64)
    with torch.device("meta"):
        model = build_model(args)
    model.to_empty(device="cpu")
    model.init_weights(seed=0)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():  # the sinks and biases random: the pretraining init leaves the biases 0
        for name, p in model.named_parameters():
            if name.endswith(("sinks", "bias", "b13", "b2")):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
    eos = 1
    first, second = torch.randint(2, 512, (1, 20), generator=gen), torch.randint(2, 512, (1, 14), generator=gen)
    first[0, -1] = eos
    model.eval()
    with torch.no_grad():
        alone = torch.cat([model.logits(first), model.logits(second)], dim=1)
        model.set_document_masking(eos)
        packed = model.logits(torch.cat([first, second], dim=1))
    assert document_ids(torch.cat([first, second], dim=1), eos)[1][0, 20] == 0
    assert torch.allclose(packed, alone, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])  # a per-expert loop; the CPU grouped GEMM
def test_biased_clamped_experts_match_a_per_expert_loop_with_gradients(dtype):
    """Against a float64 loop: the grouped GEMM leaves the rows past the last group unwritten, whose contents must
    reach no bias gradient (a first version summed them into the last expert's: NaN at step 1 of a run)."""
    torch.manual_seed(0)
    dim, hidden, n_experts, k = 8, 12, 4, 2  # rows of 16-byte multiples in fp32, as the grouped GEMM needs
    experts = GptOssExperts(dim, hidden, n_experts, glu=ClampedSwiGLU(alpha=1.702, limit=1.0)).double()
    with torch.no_grad():
        for p in experts.parameters():
            p.normal_(0, 1.0)  # large enough that the clamp binds
    x = torch.randn(10, dim, dtype=torch.float64, requires_grad=True)
    run = GptOssExperts(dim, hidden, n_experts, glu=experts.glu).to(dtype)
    run.load_state_dict(experts.state_dict())
    tolerance = 1e-9 if dtype == torch.float64 else 1e-4
    idx = torch.randint(0, n_experts, (10, k))
    experts_flat = idx.reshape(-1)
    order = torch.argsort(experts_flat, stable=True)
    inverse = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel()))
    counts = torch.bincount(experts_flat, minlength=n_experts)
    out = run(x.to(dtype), counts, order, inverse, k).double()
    ref = []
    for a in order.tolist():
        e, row = experts_flat[a], x[a // k]
        gate_up = experts.w13[e] @ row + experts.b13[e]
        gate, up = gate_up[:hidden].clamp(max=1.0), gate_up[hidden:].clamp(-1.0, 1.0)
        ref.append(experts.w2[e] @ ((up + 1) * gate * torch.sigmoid(1.702 * gate)) + experts.b2[e])
    ref = torch.stack(ref)
    assert torch.allclose(out, ref, atol=tolerance)
    grads = torch.autograd.grad(out.square().sum(), [x, *run.parameters()])
    expected = torch.autograd.grad(ref.square().sum(), [x, *experts.parameters()])
    for a, b in zip(grads, expected):
        assert torch.allclose(a.double(), b, atol=tolerance * b.abs().max().item()), (a, b)


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "blockwise"])
def test_fp8_converts_the_biased_attention_projections_and_keeps_the_router(recipe):
    """FP8 (emulated on a CPU): the q/k/v/o projections convert with their biases (torchao's Float8Linear and our
    blockwise Linear add them in high precision), the router and the experts stay bf16; the loss stays near the
    unconverted model's and the biases get gradients."""
    import copy

    from trainer.parallel.float8 import Float8Options, apply_float8

    args = replace(FLAVORS["debug_gpt_oss"], n_layers=2, max_seq_len=64)
    with torch.device("meta"):
        model = build_model(args)
    model.to_empty(device="cpu")
    model.init_weights(seed=0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("_proj.bias", "sinks")):
                p.normal_(0, 0.5)
    reference = copy.deepcopy(model)
    bias = model.layers["0"].attention.q_proj.bias
    report = apply_float8(model, Float8Options(recipe=recipe, emulate=True), device=torch.device("cpu"))
    projections = ("q", "k", "v", "o") if recipe != "blockwise" else ("q", "o")  # k, v: 64 wide, not 128
    expected = {f"layers.{i}.attention.{p}_proj" for i in range(2) for p in projections} | {"output_head.proj"}
    assert set(report.linears.converted) == expected
    assert report.linears.excluded["layers.1.moe.router.gate"] == "MoE router"
    assert model.layers["0"].attention.q_proj.bias is bias  # the same Parameter, converted in place or moved
    tokens = torch.randint(0, args.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))
    ours, theirs = model.logits(tokens), reference.logits(tokens)
    assert ((ours - theirs).norm() / theirs.norm()).item() < 0.1
    ours.square().mean().backward()
    assert all(model.layers[i].attention.q_proj.bias.grad.abs().sum() > 0 for i in ("0", "1"))


MOE_CONFIG = str(Path(__file__).resolve().parents[2] / "configs" / "train" / "debug_moe.toml")


@pytest.mark.parametrize("world_size, args, message", [
    (1, ["--train.mixed_precision=fp8", "--float8.moe_experts=rowwise", "--float8.emulate=true"],
     "float8.moe_experts='rowwise': the FP8 grouped GEMM takes no expert biases or clamped SwiGLU"),
    (1, ["--moe.n_shared_experts=1"], "moe.n_shared_experts=1 with model.flavor='debug_gpt_oss' (GPT-OSS): every "
                                      "GPT-OSS block is routed experts only"),
    # The keys that make blocks dense (MoEArgs.is_moe_layer): GptOssTransformer routes in every block.
    (1, ["--moe.n_dense_layers=1"], "moe.n_dense_layers=1 with model.flavor='debug_gpt_oss' (GPT-OSS): every GPT-OSS "
                                    "block is routed experts only; set moe.n_dense_layers=0"),
    (1, ["--moe.sparse_step=2"], "moe.sparse_step=2 with model.flavor='debug_gpt_oss' (GPT-OSS): every GPT-OSS "
                                 "block is routed experts only; set moe.sparse_step=1"),
    (1, ["--moe.dense_layers=1,3"], "moe.dense_layers=[1, 3] with model.flavor='debug_gpt_oss' (GPT-OSS): every "
                                    "GPT-OSS block is routed experts only; set moe.dense_layers=[]"),
    (1, ["--moe.route_norm=false", "--checkpoint.model_only=true"],
     "checkpoint.model_only=true: score_func='softmax', route_norm=False"),
])
def test_what_gpt_oss_does_not_run_is_refused_in_one_line(world_size, args, message):
    from trainer.config import load_job_config
    from trainer.errors import ConfigError
    from trainer.validate import validate_job

    with pytest.raises(ConfigError) as e:
        validate_job(load_job_config(["--config", MOE_CONFIG, "--model.flavor=debug_gpt_oss", *args]),
                     world_size=world_size)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_ep_and_fsdp_layouts_validate():
    from trainer.config import load_job_config
    from trainer.validate import validate_job

    job = validate_job(load_job_config(["--config", MOE_CONFIG, "--model.flavor=debug_gpt_oss",
                                        "--distributed.ep=2"]), world_size=2)
    assert job.model_args.rope_yarn is not None and job.model_args.sliding_window == 16


def test_gpt_oss_keys_apply_to_gpt_oss_flavors_only():
    from trainer.config import load_job_config
    from trainer.errors import ConfigError
    from trainer.validate import validate_job

    job = validate_job(load_job_config(["--config", MOE_CONFIG, "--model.flavor=debug_gpt_oss",
                                        "--gpt_oss.sliding_window=8", "--gpt_oss.full_attention_interval=3",
                                        "--gpt_oss.rope_yarn_factor=8"]), world_size=1)
    args = job.model_args
    assert (args.sliding_window, args.full_attention_interval, args.rope_yarn.factor) == (8, 3, 8.0)
    assert args.rope_yarn.original_max_seq_len == FLAVORS["debug_gpt_oss"].rope_yarn.original_max_seq_len
    with pytest.raises(ConfigError) as e:
        validate_job(load_job_config(["--config", MOE_CONFIG, "--gpt_oss.sliding_window=8"]), world_size=1)
    assert "gpt_oss.sliding_window=8 has no effect: model.flavor='debug_moe' is not GPT-OSS" in str(e.value)


def test_a_checkpoint_gives_a_run_its_windows_and_yarn(tmp_path):
    """checkpoint.initial_load_path: the run's GPT-OSS values are the checkpoint's, not its flavor's ([gpt_oss] of the
    checkpoint's model); a key the config sets replaces the checkpoint's (what the model computes, not a shape)."""
    from trainer.checkpoint import RunInfo, save_model_only
    from trainer.config import load_job_config
    from trainer.model_values import YarnScaling
    from trainer.validate import validate_job

    args = replace(FLAVORS["debug_gpt_oss"], n_layers=2, sliding_window=8, full_attention_interval=3,
                   rope_yarn=YarnScaling(factor=2.0, original_max_seq_len=64, truncate=True), swiglu_limit=5.0)
    with torch.device("meta"):
        model = build_model(args)
    model.to_empty(device="cpu")
    model.init_weights(seed=0)
    weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    save_model_only(tmp_path / "ckpt", weights, run=RunInfo(flavor="imported", model_args=args,
                                                            mixed_precision="fp32"), source="test")
    start = ["--config", MOE_CONFIG, "--model.flavor=debug_gpt_oss", f"--checkpoint.initial_load_path={tmp_path}/ckpt"]
    got = validate_job(load_job_config(start), world_size=1).model_args
    # (head_dim comes back as the value in effect: explicit, the same width)
    assert got == replace(args, explicit_head_dim=args.head_dim, max_seq_len=got.max_seq_len)
    got = validate_job(load_job_config([*start, "--gpt_oss.sliding_window=4"]), world_size=1).model_args
    assert got.sliding_window == 4 and got.rope_yarn == args.rope_yarn


def test_flops_count_the_window_on_sliding_layers():
    """Attention FLOPs: the whole sequence on full layers, at most sliding_window keys on sliding ones; the rest is
    6 x the active parameters."""
    from trainer.models import flops_per_token, param_counts

    args = FLAVORS["gpt_oss_20b"]  # 12 sliding layers (window 128), 12 full
    per_key = 12 * args.n_heads * args.head_dim
    assert flops_per_token(args, 0) == 6 * param_counts(args)[1]
    assert flops_per_token(args, 4096) - flops_per_token(args, 0) == per_key * (12 * 4096 + 12 * 128)
    assert flops_per_token(args, 64) - flops_per_token(args, 0) == per_key * 24 * 64  # shorter than the window


@pytest.mark.parametrize("flavor", list(FLAVORS))
def test_closed_form_counts_match_the_built_model(flavor):
    """trainer/models/counts.py's GPT-OSS terms (attention biases and sinks, the router's bias, w13/b13/b2) against a
    built model's parameters and state dict."""
    args = replace(FLAVORS[flavor], n_layers=3)
    with torch.device("meta"):
        model = build_model(args)
    params = sum(p.numel() for p in model.parameters())
    biases = sum(b.numel() for n, b in model.named_buffers() if n.endswith("expert_bias"))
    assert param_count(args) == params + biases
    assert num_params_for(args)[0] == params and num_tensors(args) == len(model.state_dict())
    total, active = param_counts(args)
    unchosen = sum(p.numel() for n, p in model.named_parameters() if ".moe.experts." in n) * (
        1 - args.top_k / args.n_experts)
    assert total == params and active == params - args.vocab_size * args.dim - unchosen


@pytest.mark.parametrize("moe", [dict(n_dense_layers=1), dict(sparse_step=2), dict(dense_layers=(0,))])
def test_an_export_refuses_dense_blocks(moe):
    with pytest.raises(ExportError, match="1 dense blocks|2 dense blocks"):
        check_exportable(replace(FLAVORS["debug_gpt_oss"], **moe))


@pytest.mark.parametrize("roles", [("bf16", "fp8"), ("fp8", "bf16"), ("fp8", "fp8")])
def test_blockwise_linear_adds_the_attention_bias_in_every_role(roles):
    """float8.forward / backward (a bf16 role: BlockwiseRolesMM) keep GPT-OSS's projection bias: a bf16 forward is
    the Linear's output exactly, an FP8 one near it; the bias gets the Linear's gradient."""
    linear = nn.Linear(128, 256)
    with torch.no_grad():
        linear.bias.normal_(0, 1)
    reference = nn.Linear(128, 256)
    reference.load_state_dict(linear.state_dict())
    BlockwiseFloat8Linear.from_linear(linear, emulate=True, roles=roles)
    x = torch.randn(2, 5, 128, generator=torch.Generator().manual_seed(0))
    out, want = linear(x), reference(x)
    if roles[0] == "bf16":
        assert torch.equal(out, want)
    assert ((out - want).norm() / want.norm()).item() < 0.05
    out.sum().backward()
    assert torch.equal(linear.bias.grad, torch.full((256,), 10.0))
