"""What a block saves for backward, as its family counts it for the dry run's memory plan (trainer/models/activations.py,
asked by trainer/validate/plan.py), against the forward graph torch.compile's partitioner makes for our block: the
tensors that graph returns for backward, read from inductor's post-grad forward graph on this CPU (the same op graph a
GPU gets; docs/benchmarks.md compares the plan with what was live at measured peaks on an H100).

Bytes per token = (saved bytes at batch 2 - at batch 1) / seq_len: the weights and the RoPE tables (per position,
not per token) cancel, so the plan's per-token formula must match exactly."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from trainer.config import load_job_config
from trainer.models.layers import TransformerBlock, rope_cache
from trainer.validate import validate_job
from trainer.validate.memory import planned_gpus

pytestmark = pytest.mark.slow

SEQ = 128
SHAPE = ["--model.flavor=debug", "--model.dim=256", "--model.n_layers=1", "--model.n_heads=4", "--model.n_kv_heads=2",
         "--model.ffn_dim=768", "--model.vocab_size=512", f"--train.seq_len={SEQ}", "--train.batch_size=1",
         "--train.compile_model=true", "--data.source=synthetic", "--float8.emulate=true"]


def saved_bytes(block: nn.Module, *, batch: int, dim: int, rope: torch.Tensor) -> int:
    """Bytes of the tensors the compiled forward graph of `block` returns besides its output (saved for backward)."""
    import torch._inductor.config as inductor_config

    graphs: list[int] = []

    class Capture:
        def __call__(self, graph) -> None:
            output = next(n for n in graph.nodes if n.op == "output")
            values = [a.meta.get("val") for a in output.args[0][1:] if a is not None]
            graphs.append(sum(v.numel() * v.element_size() for v in values if isinstance(v, torch.Tensor)))

        def uuid(self):
            return None

    torch._dynamo.reset()
    x = torch.randn(batch, SEQ, dim, dtype=torch.bfloat16, requires_grad=True)
    with inductor_config.patch(post_grad_custom_post_pass=Capture(), force_disable_caches=True):
        torch.compile(block)(x, rope).sum().backward()
    return graphs[0]  # the forward graph (the backward's comes second)


@pytest.mark.parametrize("precision, ac, qk_norm", [
    ("bf16", "none", False), ("fp8", "none", False), ("bf16", "selective", False), ("fp8", "none", True),
    ("bf16", "full", False),
], ids=["bf16", "fp8", "selective", "fp8-qk_norm", "full"])
def test_plan_counts_what_the_compiled_block_saves(precision: str, ac: str, qk_norm: bool) -> None:
    cfg = load_job_config([*SHAPE, f"--train.mixed_precision={precision}", f"--train.activation_checkpointing={ac}",
                           f"--model.qk_norm={str(qk_norm).lower()}"])
    job = validate_job(cfg, world_size=1, target=planned_gpus(80))
    planned = next(r.bytes for r in job.memory_plan.rows if r.what == "activations") / SEQ  # 1 block, batch 1

    args = job.model_args
    torch.manual_seed(0)
    block = TransformerBlock(args).to(torch.bfloat16)
    if precision == "fp8":
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        convert_to_float8_training(block, config=Float8LinearConfig(emulate=True))
    if ac != "none":
        from trainer.parallel.activation_checkpoint import apply_ac

        holder = nn.Module()
        holder.layers = nn.ModuleDict({"0": block})
        apply_ac(holder, mode=ac)
        block = holder.layers["0"]
    rope = rope_cache(args, SEQ)
    per_token = (saved_bytes(block, batch=2, dim=args.dim, rope=rope)
                 - saved_bytes(block, batch=1, dim=args.dim, rope=rope)) / SEQ
    assert planned == per_token, (planned, per_token)
