"""Tensor parallelism with sequence parallel norms and a vocabulary-parallel loss."""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh, *, loss_parallel: bool) -> str:
    """Megatron-style TP on every block; activations between blocks are sharded on the sequence dim.

    Column-parallel q/k/v and gate/up, row-parallel o/down, so each block needs one
    all-gather in and one reduce-scatter out per sublayer. With loss_parallel the
    logits stay sharded over the vocabulary and the loss runs under
    `torch.distributed.tensor.parallel.loss_parallel()`.

    An MoE block's shared experts are tensor-parallel like the dense MLP. Its routed experts
    are not split: each tp rank routes the tokens of its own sequence slice (which sequence
    parallel already gives it) through whole experts, so the routed path moves no bytes
    between tp ranks. Splitting each expert's hidden dim over tp (Megatron's expert tensor
    parallel) would all-gather every token's input and reduce-scatter its output, 2 x dim
    values per token per layer, for the same FLOPs in skinnier GEMMs. The experts and the
    router are FSDP-sharded over dp_shard x tp instead (trainer.parallel.fsdp), which sums
    their gradients over the tp ranks' token slices; the sequence-wise aux loss reduces its
    statistics over tp (trainer.models.moe.MoE.set_sequence_group).
    """
    parallelize_module(
        model,
        tp_mesh,
        {
            # Hands its sequence shard on as a DTensor, which the model's forward unwraps
            # (trainer.models.layers.Decoder.forward): to_local() returns a view of the DTensor's local
            # tensor, and the embeddings are an FSDP2 unit of their own (trainer.parallel.fsdp), which
            # must not return a view (FSDP2 warns, docs/debug.md).
            "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1),
                                              use_local_output=False),
            "norm": SequenceParallel(),
            "output_head.proj": ColwiseParallel(
                input_layouts=Shard(1),
                output_layouts=Shard(-1) if loss_parallel else Replicate(),
                use_local_output=not loss_parallel,
            ),
        },
    )
    block_plan = {
        "attention_norm": SequenceParallel(),
        "attention": PrepareModuleInput(
            input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None), use_local_output=True
        ),
        "attention.q_proj": ColwiseParallel(),
        "attention.k_proj": ColwiseParallel(),
        "attention.v_proj": ColwiseParallel(),
        "attention.o_proj": RowwiseParallel(output_layouts=Shard(1)),
        "mlp_norm": SequenceParallel(),
        "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_output=True),
        "mlp.gate_proj": ColwiseParallel(),
        "mlp.up_proj": ColwiseParallel(),
        "mlp.down_proj": RowwiseParallel(output_layouts=Shard(1)),
    }
    moe_plan = {key: style for key, style in block_plan.items() if key != "mlp" and not key.startswith("mlp.")} | {
        # The routed path takes this rank's sequence slice as a plain tensor.
        "moe": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Shard(1),), use_local_output=True),
        "moe.shared_expert": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),),
                                                use_local_output=True),
        "moe.shared_expert.gate_proj": ColwiseParallel(),
        "moe.shared_expert.up_proj": ColwiseParallel(),
        "moe.shared_expert.down_proj": RowwiseParallel(output_layouts=Shard(1)),
    }
    tp = tp_mesh.size()
    # trainer.validate checked this for the user; here it is an invariant.
    assert model.args.n_heads % tp == 0 and model.args.n_kv_heads % tp == 0, (tp, model.args)
    # The rope cache stays a plain tensor: sequence parallel shards the sequence only
    # between sublayers, and attention sees the whole (replicated) sequence.
    num_moe = 0
    for block in model.layers.values():
        moe = getattr(block, "moe", None)
        if moe is None:
            parallelize_module(block, tp_mesh, block_plan)
            continue
        plan = moe_plan if moe.shared_expert is not None else {
            k: v for k, v in moe_plan.items() if not k.startswith("moe.shared_expert")}
        parallelize_module(block, tp_mesh, plan)
        moe.set_sequence_group(tp_mesh.get_group())
        num_moe += 1
    moe_text = (f"; {num_moe} MoE blocks: shared experts tensor-parallel, routed experts whole, each tp rank routing "
                "its sequence slice" if num_moe else "")
    return f"tensor parallel: tp={tp}, sequence parallel norms, loss_parallel={loss_parallel}{moe_text}"
