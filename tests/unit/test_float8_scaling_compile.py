"""Delayed scaling and FP8 saved inputs under torch.compile and activation checkpointing: compiled == eager to bf16
rounding (the amaxes recorded in the compiled backward included), one recompile when the first step's history arrives
and none after (a toy model under full AC); the debug model compiled per block with selective AC."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from tests.helpers import DEBUG_CONFIG
from tests.unit.test_float8_scaling import aten_scaled_mm, converted  # noqa: F401  (autouse: aten's CPU _scaled_mm)


class Block(nn.Module):
    """Two converted Linears behind activation checkpointing, as the model's blocks are."""

    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(64, 128, bias=False), nn.Linear(128, 64, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + checkpoint(lambda h: self.down(torch.relu(self.up(h))), x, use_reentrant=False)


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).abs().mean() / b.float().abs().mean()).item()


@pytest.mark.slow  # ~25 s of inductor codegen on a CPU (70 s cold on a loaded 2-core machine)
def test_compiled_is_torchaos_compiled_then_tracks_eager_and_compiles_twice_only() -> None:
    """Compiled with full AC, over 4 steps of 2 microbatches: step 1 (dynamic, its amaxes recorded) is torchao's
    compiled Float8Linear bit for bit; later steps (delayed) track the eager run as closely as torchao's compiled
    and eager runs track each other on a CPU (inductor lowers the CPU _scaled_mm itself: measured up to 0.16 apart
    on values of a few units, for torchao too); the histories recorded in the compiled forward and backward are
    the eager run's to 2%; the model compiles twice (step 1, and step 2 with the history's scales), never after."""
    from torch._dynamo.utils import counters

    from trainer.parallel.float8.delayed import DelayedScaling

    torch.manual_seed(0)
    base = nn.Sequential(Block(), Block()).to(torch.bfloat16)
    eager = converted(base, delayed=True, save_fp8_input=True)
    compiled, theirs = copy.deepcopy(eager), torch.compile(converted(base, ours=False), fullgraph=True)
    hooks = [DelayedScaling(m, history_len=4, algo="max", margin=0, group=None) for m in (eager, compiled)]
    run = torch.compile(compiled, fullgraph=True)
    torch._dynamo.reset()
    counters.clear()
    graphs = []
    for step in range(1, 5):
        for micro in range(2):
            x = torch.randn(4, 16, 64, dtype=torch.bfloat16) * (1 + step + micro)
            outs = []
            for model in (eager, run, theirs) if step == 1 else (eager, run):
                out = model(x)
                (out.float() ** 2).mean().backward()
                outs.append(out)
            if step == 1:
                assert torch.equal(outs[1], outs[2])
            assert relative_error(outs[1], outs[0]) < 0.02
        for a, b, c in zip(eager.parameters(), compiled.parameters(), theirs.parameters()):
            assert relative_error(b.grad, a.grad) < 0.1  # e5m2 gradients: 2 mantissa bits
            if step == 1:
                assert torch.equal(b.grad, c.grad)
            a.grad = b.grad = None
        for hook in hooks:
            hook.after_optimizer_step(step, torch.tensor(False))
        torch.testing.assert_close(hooks[1].history, hooks[0].history, rtol=2e-2, atol=0)
        assert hooks[1].history[:, :, 0].gt(0).all()
        graphs.append(counters["stats"]["unique_graphs"])
    # Step 1 made ours and torchao's graph, step 2 ours with the history's scales; nothing after.
    assert graphs == [2, 3, 3, 3]


@pytest.mark.slow
@pytest.mark.parametrize("ac", ["selective"])  # full AC's recompute: the toy model above (40 s of CI saved)
def test_debug_model_compiled_per_block_with_activation_checkpointing(tmp_path: Path, ac: str) -> None:
    """The trainer's compiled blocks (fullgraph) and loss with delayed scaling and FP8 saved inputs under selective
    AC (the toy model above holds full AC's recompute): 4 steps close to the eager run, their histories too, no
    recompile after step 2."""
    from torch._dynamo.utils import counters

    from trainer.config import load_job_config
    from trainer.distributed import destroy_distributed
    from trainer.parallel.float8.delayed import DelayedScaling
    from trainer.run.train import build_trainer

    results = {}
    for compile_model in (False, True):
        trainer = build_trainer(load_job_config([
            "--config", DEBUG_CONFIG, "--train.seq_len=64", "--train.mixed_precision=fp8", "--train.steps=4",
            "--float8.scaling=delayed", "--float8.save_fp8_activations=true", f"--train.activation_checkpointing={ac}",
            f"--train.compile_model={str(compile_model).lower()}", f"--job.dump_folder={tmp_path / str(compile_model)}",
            "--metrics.enable_tensorboard=false"]))
        try:
            (hook,) = [h for h in trainer.hooks if isinstance(h, DelayedScaling)]
            losses, graphs = [], []
            for _ in range(4):
                losses.append(trainer.train_step(trainer.data_loader.next_batch()).loss.item())
                graphs.append(counters["stats"]["unique_graphs"])
            results[compile_model] = losses, hook.history.clone(), graphs
        finally:
            trainer.close()
            destroy_distributed()
    (eager, eager_history, _), (compiled, compiled_history, graphs) = results[False], results[True]
    assert graphs[1] == graphs[2] == graphs[3], graphs  # the blocks and the loss recompiled once, at step 2
    assert compiled == pytest.approx(eager, rel=1e-2)
    # The amaxes recorded in the compiled graphs are the eager run's to what parts compiled and eager fp8 on a CPU
    # (inductor lowers _scaled_mm itself; torchao's compiled and eager outputs differ by ~3% too): inputs' and
    # weights' measured within 5%, gradients' (e5m2, 2 mantissa bits) within 16%.
    assert compiled_history[:, :2, :4] == pytest.approx(eager_history[:, :2, :4], rel=0.1)
    assert compiled_history[:, 2, :4] == pytest.approx(eager_history[:, 2, :4], rel=0.25)


def eager_saved_bytes(block: nn.Module, x: torch.Tensor, rope: torch.Tensor) -> int:
    """Bytes the eager forward saves for backward, each storage once, parameters not counted."""
    params = {p.untyped_storage().data_ptr() for p in block.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.untyped_storage().data_ptr() not in params:
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        block(x, rope)
    return sum(seen.values())


def compiled_saved_bytes_per_token(block: nn.Module, rope: torch.Tensor, *, dim: int, seq: int) -> float:
    """Bytes per token of the tensors the compiled forward graph saves for backward (its outputs besides the
    block's), read as tests/unit/test_memory_plan_graphs.py reads them but from one compile: at batch 3 the
    per-token tensors are those whose first dim is 5 or 5 x seq (no model dim or buffer length is)."""
    import torch._inductor.config as inductor_config

    found: list[float] = []

    class Capture:
        def __call__(self, graph) -> None:
            output = next(n for n in graph.nodes if n.op == "output")
            values = [a.meta.get("val") for a in output.args[0][1:] if a is not None]
            found.append(sum(v.numel() * v.element_size() for v in values
                             if isinstance(v, torch.Tensor) and v.dim() and v.shape[0] in (5, 5 * seq)) / (5 * seq))

        def uuid(self):
            return None

    torch._dynamo.reset()
    x = torch.randn(5, seq, dim, dtype=torch.bfloat16, requires_grad=True)
    with inductor_config.patch(post_grad_custom_post_pass=Capture(), force_disable_caches=True):
        torch.compile(block)(x, rope).sum().backward()
    return found[0]  # the forward graph's


@pytest.mark.slow
def test_what_fp8_saved_inputs_and_delayed_scaling_change_in_what_a_block_saves() -> None:
    """Bytes per token a Llama block saves for backward (docs/fp8.md#fp8-activations-saved-for-backward), from the
    compiled forward graph's saved outputs and, eagerly, saved_tensors_hooks; d = dim, q = n_heads x head_dim,
    f = ffn_dim:

    - compiled, float8.save_fp8_activations changes nothing: the partitioner picks what the joint graph saves
      whatever the autograd function asked for (it already recomputes the normed inputs and their casts);
    - eager, it saves f - d - q bytes per token: down_proj keeps f bytes instead of 2f, but q/k/v (and gate/up)
      share one bf16 input that becomes one fp8 copy per Linear (3d instead of 2d; 2d as before), and o_proj's
      input, which attention's backward keeps in bf16 anyway, gains a q-byte fp8 copy;
    - compiled, delayed scaling saves 3d more: q, k and v each scale the shared input by their own history, so
      the three fp8 casts differ and the partitioner keeps them instead of recomputing them."""
    from tests.unit.test_memory_plan_graphs import SEQ, SHAPE
    from trainer.config import load_job_config
    from trainer.models.layers import TransformerBlock, rope_cache
    from trainer.validate import validate_job
    from trainer.validate.memory import planned_gpus

    def planned(*overrides: str) -> float:
        job = validate_job(load_job_config([*SHAPE, "--train.mixed_precision=fp8", *overrides]), world_size=1,
                           target=planned_gpus(80))
        return next(r.bytes for r in job.memory_plan.rows if r.what == "activations") / SEQ

    # torchao's compiled block saves what the plan counts (tests/unit/test_memory_plan_graphs.py pins it).
    args = validate_job(load_job_config([*SHAPE, "--train.mixed_precision=fp8"]), world_size=1,
                        target=planned_gpus(80)).model_args
    rope = rope_cache(args, SEQ)
    d, q, f = args.dim, args.n_heads * args.head_dim, args.ffn_dim

    def block(kind: str) -> nn.Module:
        torch.manual_seed(0)
        b = converted(TransformerBlock(args).to(torch.bfloat16), ours=kind != "torchao",
                      delayed=kind.startswith("delayed"), save_fp8_input=kind.endswith("save"))
        for m in b.modules():
            if getattr(m, "cast", None) is not None and m.cast.delayed:
                m.use_history()  # a step after the first: the scales come from the history
        return b

    def eager(kind: str) -> float:
        xs = [torch.randn(n, SEQ, d, dtype=torch.bfloat16, requires_grad=True) for n in (2, 1)]
        b = block(kind)
        return (eager_saved_bytes(b, xs[0], rope) - eager_saved_bytes(b, xs[1], rope)) / SEQ

    assert eager("dynamic-save") == eager("torchao") - (f - d - q)
    assert compiled_saved_bytes_per_token(block("dynamic-save"), rope, dim=d, seq=SEQ) == planned()
    delayed = planned("--float8.scaling=delayed")
    assert delayed == planned() + 3 * d  # the dry run counts it
    assert compiled_saved_bytes_per_token(block("delayed-save"), rope, dim=d, seq=SEQ) == delayed
