"""MoE model: the layer against a plain per-expert loop, balancing, FP8 selection, parameter counts, configs."""

from __future__ import annotations

import logging
import math

import pytest
import torch
import torch.nn.functional as F

from trainer.models import FLAVORS, build_model, flops_per_token, model_args_for, num_params, param_counts
from trainer.models.moe import MOE_FLAVORS, STAT_AUX, MoE, MoEArgs, grouped_swiglu
from trainer.models.moe_balancer import MoEBalancer
from trainer.models.moe_experts import GROUP_ALIGN
from trainer.models.moe_permute import padded_layout

SMALL = MoEArgs(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=64, multiple_of=16, rope_theta=10000.0,
                n_experts=6, top_k=2, moe_ffn_dim=24, n_shared_experts=1, n_dense_layers=1, aux_loss_coef=0.1)


def reference_moe(moe: MoE, x: torch.Tensor, args: MoEArgs) -> tuple[torch.Tensor, torch.Tensor]:
    """float64, one token and one expert at a time: (output, unscaled aux loss)."""
    x = x.double()
    gate = moe.router.gate.weight.double()
    bias = moe.router.expert_bias.double()
    w1, w2, w3 = (getattr(moe.experts, n).double() for n in ("w1", "w2", "w3"))
    bsz, seq, dim = x.shape
    cap = math.ceil(args.capacity_factor * seq * args.top_k / args.n_experts) if args.capacity_factor else None
    out = torch.zeros_like(x)
    aux = torch.zeros((), dtype=torch.float64)
    for b in range(bsz):
        taken = [0] * args.n_experts
        frac = torch.zeros(args.n_experts, dtype=torch.float64)
        prob = torch.zeros(args.n_experts, dtype=torch.float64)
        for t in range(seq):
            logits = gate @ x[b, t]
            scores = logits.softmax(-1) if args.score_func == "softmax" else logits.sigmoid()
            chosen = torch.topk(scores + bias, args.top_k).indices.tolist()
            w = scores[chosen]
            if args.route_norm:
                w = w / w.sum()
            for e, we in zip(chosen, w):
                frac[e] += 1
                taken[e] += 1
                if cap is not None and taken[e] > cap:
                    continue  # dropped: over this sequence's capacity for e
                h = F.silu(w1[e] @ x[b, t]) * (w3[e] @ x[b, t])
                out[b, t] += we * (w2[e] @ h)
            prob += scores / (scores.sum() if args.score_func == "sigmoid" else 1.0)
        aux += args.n_experts * ((frac / (seq * args.top_k)) * (prob / seq)).sum()
    s = moe.shared_expert
    if s is not None:
        xs = x
        out += (F.silu(xs @ s.gate_proj.weight.double().T) * (xs @ s.up_proj.weight.double().T)) @ s.down_proj.weight.double().T
    return out, aux / bsz


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """Relative error in the 2-norm: fp32 against float64 agrees to ~1e-7."""
    return ((got.double() - want).norm() / want.norm()).item()


def make_moe(args: MoEArgs, seed: int = 0) -> MoE:
    torch.manual_seed(seed)
    moe = MoE(args)
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0, 0.2)
        moe.router.expert_bias.normal_(0, 0.05)  # the bias changes choices, never the weights
    return moe


@pytest.mark.parametrize(
    "overrides",
    [{}, {"score_func": "sigmoid", "route_norm": True}, {"capacity_factor": 1.0}, {"n_shared_experts": 0, "top_k": 3}],
    ids=["softmax", "sigmoid-norm", "capacity", "no-shared-top3"],
)
def test_moe_layer_matches_per_expert_loop(overrides) -> None:
    from dataclasses import replace

    args = replace(SMALL, **overrides)
    moe = make_moe(args)
    x = torch.randn(3, 10, args.dim, generator=torch.Generator().manual_seed(1), requires_grad=True)
    out = moe(x)
    ref_x = x.detach().double().requires_grad_()
    ref_params = {n: p.detach().double().requires_grad_() for n, p in moe.named_parameters()}
    # The reference reads float64 leaves of the same weights, to get their gradients.
    ref_out, ref_aux = _reference_with_leaves(moe, ref_params, ref_x, args)
    assert rel_err(out, ref_out) < 1e-6
    assert moe.stats[args.n_experts + STAT_AUX].item() == pytest.approx(ref_aux.item(), rel=1e-5)
    # Gradients of a non-uniform objective (its gradient is not a broadcast). The layer injects its
    # aux loss's gradient (x aux_grad_scale, 1 here) into backward: the LM part + the aux part.
    probe = torch.randn(out.shape, generator=torch.Generator().manual_seed(2))
    (out * probe).sum().backward()
    ((ref_out * probe.double()).sum() + args.aux_loss_coef * ref_aux).backward()
    assert rel_err(x.grad, ref_x.grad) < 1e-5
    for n, p in moe.named_parameters():
        assert rel_err(p.grad, ref_params[n].grad) < 1e-5, n
    if args.capacity_factor:
        dropped = moe.stats[args.n_experts].item()
        assert dropped > 0, "capacity 1.0 on 10 tokens x 2 should drop some assignments"


@pytest.mark.parametrize("capacity_factor", [0.0, 1.0], ids=["no-drop", "capacity"])
def test_rows_move_by_gathers_in_forward_and_backward(capacity_factor: float) -> None:
    """No index_add / index_put anywhere in the layer's autograd graph: its backward moves rows by gathers
    (no atomics on CUDA, deterministic sums over each token's k experts; trainer/models/moe_permute.py)."""
    from dataclasses import replace

    moe = make_moe(replace(SMALL, capacity_factor=capacity_factor))
    out = moe(torch.randn(3, 10, SMALL.dim, generator=torch.Generator().manual_seed(1), requires_grad=True))
    names, todo, seen = set(), [out.grad_fn], set()
    while todo:
        fn = todo.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        names.add(type(fn).__name__)
        todo += [next_fn for next_fn, _ in fn.next_functions]
    assert "_TokensToExpertsBackward" in names and "_PermuteRowsBackward" in names
    scatters = {n for n in names if n.startswith(("IndexSelectBackward", "IndexAddBackward", "IndexBackward",
                                                  "IndexPutBackward"))}
    assert not scatters, scatters


def _reference_with_leaves(moe: MoE, params: dict[str, torch.Tensor], x: torch.Tensor, args: MoEArgs):
    class View:  # the attribute paths reference_moe reads, backed by float64 leaves
        pass

    v = View()
    v.router = View()
    v.router.gate = View()
    v.router.gate.weight = params["router.gate.weight"]
    v.router.expert_bias = moe.router.expert_bias
    v.experts = View()
    for n in ("w1", "w2", "w3"):
        setattr(v.experts, n, params[f"experts.{n}"])
    if moe.shared_expert is None:
        v.shared_expert = None
    else:
        v.shared_expert = View()
        for n in ("gate_proj", "up_proj", "down_proj"):
            proj = View()
            proj.weight = params[f"shared_expert.{n}.weight"]
            setattr(v.shared_expert, n, proj)
    return reference_moe(v, x, args)


def test_grouped_swiglu_backward_with_a_broadcast_gradient() -> None:
    # The CPU grouped GEMM backward rejects stride-0 gradients like that of .sum(); ours must not.
    g = torch.Generator().manual_seed(0)
    x = torch.randn(11, 16, generator=g, requires_grad=True)
    w1, w3 = (torch.randn(3, 8, 16, generator=g, requires_grad=True) for _ in range(2))
    w2 = torch.randn(3, 16, 8, generator=g, requires_grad=True)
    counts = torch.tensor([4, 0, 7])
    grouped_swiglu(x, counts, w1, w2, w3).sum().backward()
    got = [t.grad.clone() for t in (x, w1, w2, w3)]
    for t in (x, w1, w2, w3):
        t.grad = None
    rows, start = [], 0
    for e, c in enumerate(counts.tolist()):
        xe = x[start:start + c]
        rows.append((F.silu(xe @ w1[e].T) * (xe @ w3[e].T)) @ w2[e].T)
        start += c
    torch.cat(rows).sum().backward()
    for a, t in zip(got, (x, w1, w2, w3)):
        assert rel_err(a, t.grad.double()) < 1e-6


def test_compiled_experts_keep_their_padded_input_once_for_backward() -> None:
    """Compiled (bf16: the GPU's path), the experts save their padded input for backward once. The zeros their
    backward copies the output's gradient into (select_unique_rows) had the shape of the forward's zeros buffer;
    a compiled graph's common-subexpression pass made them one tensor and its partitioner kept that buffer from
    forward to backward too: one more activation-sized tensor per MoE layer (1.3 GiB of moe_16b x 8 layers at
    ep=1 on the GPU, three times that with moe.dispatch='padded' at ep=2). The gradients stay the eager ones."""
    g = torch.Generator().manual_seed(0)
    n, dim, hidden, counts = 40, 32, 24, torch.tensor([9, 0, 17, 14])
    x = torch.randn(n, dim, generator=g).bfloat16().requires_grad_()
    w1, w3 = (torch.randn(4, hidden, dim, generator=g).div(dim ** 0.5).bfloat16().requires_grad_() for _ in range(2))
    w2 = torch.randn(4, dim, hidden, generator=g).div(hidden ** 0.5).bfloat16().requires_grad_()
    rows = padded_layout(counts, n, GROUP_ALIGN)[2]
    saved = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(tuple(t.shape))
        return t

    torch._dynamo.reset()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = torch.compile(grouped_swiglu, fullgraph=True)(x, counts, w1, w2, w3)
    assert saved.count((rows, dim)) == 1, saved
    out.float().square().sum().backward()
    got = [t.grad.clone() for t in (x, w1, w2, w3)]
    for t in (x, w1, w2, w3):
        t.grad = None
    grouped_swiglu(x, counts, w1, w2, w3).float().square().sum().backward()
    for a, t in zip(got, (x, w1, w2, w3)):  # compiled against eager bf16: a few bf16 roundings apart
        assert rel_err(a, t.grad.double()) < 2e-2


def test_module_names_and_flavor_family() -> None:
    args = model_args_for("debug_moe")
    with torch.device("meta"):
        model = build_model(args)
    names = {n for n, _ in model.named_parameters()}
    assert "layers.0.mlp.gate_proj.weight" in names  # n_dense_layers=1
    for i in range(1, args.n_layers):
        for sub in ("moe.router.gate.weight", "moe.experts.w1", "moe.experts.w2", "moe.experts.w3",
                    "moe.shared_expert.gate_proj.weight", "moe.shared_expert.up_proj.weight",
                    "moe.shared_expert.down_proj.weight", "attention.q_proj.weight"):
            assert f"layers.{i}.{sub}" in names
        assert dict(model.named_buffers())[f"layers.{i}.moe.router.expert_bias"].shape == (args.n_experts,)
    assert model.layers["1"].moe.experts.w1.shape == (8, 64, 128)
    # The bias is checkpointed; the counters are not.
    sd = model.state_dict()
    assert "layers.1.moe.router.expert_bias" in sd and "layers.1.moe.stats" not in sd


def test_moe_16b_parameter_counts_and_flops() -> None:
    args = FLAVORS["moe_16b"]
    assert (args.dim, args.n_layers, args.n_experts, args.top_k, args.moe_ffn_dim) == (2048, 27, 64, 6, 1408)
    assert (args.n_shared_experts, args.n_dense_layers, args.ffn_dim, args.vocab_size) == (2, 1, 10944, 102400)
    with torch.device("meta"):
        model = build_model(args)
    total, active = param_counts(args)
    assert num_params(model) == total
    assert total / 1e9 == pytest.approx(15.67, abs=0.01)
    assert active / 1e9 == pytest.approx(2.42, abs=0.01)
    # Active = total - unchosen experts - embeddings, counted from the real modules.
    expert = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n) // (26 * 64)
    assert active == total - 26 * (64 - 6) * expert - model.tok_embeddings.weight.numel()
    # MFU counts active parameters: 6 * N_active + attention.
    assert flops_per_token(args, 4096) == 6 * active + 12 * 27 * 16 * 128 * 4096
    for flavor in MOE_FLAVORS:  # every flavor states both numbers
        t, a = param_counts(FLAVORS[flavor])
        assert 0 < a < t


@pytest.mark.parametrize("n_layers, n_dense_layers, sparse_step, dense_layers", [
    (4, 0, 1, ()), (4, 1, 1, ()), (5, 0, 2, ()), (6, 0, 3, (2,)), (6, 1, 2, (3, 4)), (5, 0, 1, (0, 4)),
    (3, 3, 1, ()), (4, 0, 5, ()),  # no MoE block at all
])
def test_which_blocks_route_is_transformers_rule_counted_in_closed_form(n_layers, n_dense_layers, sparse_step,
                                                                        dense_layers) -> None:
    """Qwen3MoeDecoderLayer's rule (modeling_qwen3_moe.py): block i is sparse when i is not in mlp_only_layers and
    (i + 1) % decoder_sparse_step == 0; our leading n_dense_layers are more mlp_only_layers. The built model, the
    closed-form counts (parameters, tensors, the log's count) and the memory plan's runs all follow it."""
    from dataclasses import replace

    from trainer.models.counts import num_params_for, num_tensors, param_count
    from trainer.models.moe import MoEBlock, block_runs

    args = replace(MOE_FLAVORS["qwen3_moe_debug"], n_layers=n_layers, n_dense_layers=n_dense_layers,
                   sparse_step=sparse_step, dense_layers=dense_layers)
    mlp_only = set(range(n_dense_layers)) | set(dense_layers)
    sparse = [i not in mlp_only and (i + 1) % sparse_step == 0 for i in range(n_layers)]
    with torch.device("meta"):
        model = build_model(args)
    assert [isinstance(block, MoEBlock) for block in model.layers.values()] == sparse
    assert args.n_moe_layers == sum(sparse)
    assert (num_params(model), len(model.state_dict())) == (num_params_for(args)[0], num_tensors(args))
    assert param_count(args) == num_params(model) + sum(sparse) * args.n_experts  # + the expert-bias buffers
    assert [sorted(run) for run in block_runs(args)] == [r for r in (
        [i for i in range(n_layers) if not sparse[i]], [i for i in range(n_layers) if sparse[i]]) if r]


def test_a_crafted_depth_costs_nothing_to_count() -> None:
    """No loop over n_layers: a config or checkpoint.json may say 2**40 before anything is checked against files."""
    from dataclasses import replace

    from trainer.models.moe import block_runs

    args = replace(MOE_FLAVORS["qwen3_moe_debug"], n_layers=2**40, sparse_step=3, dense_layers=(2, 5, 6))
    assert args.n_moe_layers == 2**40 // 3 - 2  # blocks 2 and 5 would route; 6 does not anyway
    dense, moe = block_runs(args)
    assert (len(dense), dense[0], len(moe), moe[0]) == (2**40 - args.n_moe_layers, 0, args.n_moe_layers, 8)
    assert 2**40 - 1 - 1 in moe and 2**40 - 1 in dense and 5 in dense


def test_qwen3_30b_a3b_has_the_published_shape() -> None:
    """Qwen/Qwen3-30B-A3B's config.json: 48 blocks, all MoE, 128 experts top-8 of width 768, 32 / 4 heads of 128;
    30.5B parameters, 3.3B active as Qwen counts them (with the embeddings)."""
    args = FLAVORS["qwen3_30b_a3b"]
    assert (args.dim, args.n_layers, args.n_heads, args.n_kv_heads, args.head_dim) == (2048, 48, 32, 4, 128)
    assert (args.n_experts, args.top_k, args.moe_ffn_dim, args.n_shared_experts, args.n_moe_layers) == (
        128, 8, 768, 0, 48)
    assert (args.vocab_size, args.ffn_dim, args.qk_norm, args.route_norm) == (151936, 6144, True, True)
    total, active = param_counts(args)
    assert total / 1e9 == pytest.approx(30.53, abs=0.01)
    assert (active + args.vocab_size * args.dim) / 1e9 == pytest.approx(3.35, abs=0.01)


def test_init_is_layout_free_and_depth_scaled() -> None:
    args = model_args_for("debug_moe")
    a, b = build_model(args), build_model(args)
    a.init_weights(seed=0)
    b.init_weights(seed=0)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    w2 = a.layers["1"].moe.experts.w2
    assert w2.std().item() == pytest.approx(0.02 / math.sqrt(2 * args.n_layers), rel=0.15)
    assert torch.all(a.layers["1"].moe.router.expert_bias == 0)


def test_bias_update_reduces_imbalance() -> None:
    """Aux-loss-free balancing alone (no aux loss, frozen weights): imbalance falls; without it, it stays."""

    def imbalance_history(rate: float, steps: int) -> list[float]:
        args = model_args_for("debug_moe", aux_loss_coef=0.0, bias_update_rate=rate)
        model = build_model(args)
        model.init_weights(seed=0)
        tokens = torch.randint(0, args.vocab_size, (8, 64), generator=torch.Generator().manual_seed(0))
        balancer = MoEBalancer(model, bias_update_rate=rate)
        history = []
        with torch.no_grad():
            for step in range(1, steps + 1):
                model(tokens)
                balancer.after_optimizer_step(step, torch.tensor(False))
                history.append(balancer.on_log(step)["moe/imbalance_mean"])
        return history

    still, balanced = imbalance_history(0.0, 3), imbalance_history(0.002, 8)
    assert still == [still[0]] * len(still)  # same data, no bias update: same routing
    assert balanced[0] == still[0] > 1.15
    assert max(balanced[-3:]) < still[0] - 0.08, balanced


def _record_routing(model) -> dict[str, tuple]:
    """Each MoE layer's router output (weights, expert ids, scores) of the latest forward, by block index."""
    seen: dict[str, tuple] = {}
    for name, block in model.layers.items():
        if hasattr(block, "moe"):
            block.moe.router.register_forward_hook(lambda m, args, out, name=name: seen.__setitem__(name, out))
    return seen


def test_balancer_metrics_equal_an_independent_count() -> None:
    args = model_args_for("debug_moe", capacity_factor=1.0)
    model = build_model(args)
    model.init_weights(seed=0)
    routing = _record_routing(model)
    balancer = MoEBalancer(model, bias_update_rate=0.0)
    bsz, seq, e, k = 2, 32, args.n_experts, args.top_k
    tokens = torch.randint(0, args.vocab_size, (bsz, seq), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        # Twice, as activation checkpointing's recompute runs a forward again: every metric is a ratio.
        model(tokens)
        model(tokens)
        balancer.after_optimizer_step(1, torch.tensor(False))
    m = balancer.on_log(1)
    total_aux = 0.0
    for layer, (_, idx, scores) in routing.items():
        load = torch.bincount(idx.flatten(), minlength=e).double()
        assert m[f"moe/layer{layer}/imbalance"] == pytest.approx((load.max() / load.mean()).item(), rel=1e-6)
        per_seq = torch.stack([torch.bincount(row, minlength=e) for row in idx.view(bsz, seq * k)])
        capacity = math.ceil(1.0 * seq * k / e)  # the earliest assignments beyond it are kept, the rest dropped
        dropped = (per_seq - capacity).clamp(min=0).sum().item()
        assert m[f"moe/layer{layer}/dropped_fraction"] == pytest.approx(dropped / (bsz * seq * k), rel=1e-6)
        assert 0 < dropped
        frac = per_seq.double() / (seq * k)
        prob = scores.double().view(bsz, seq, e).mean(dim=1)
        aux = (e * (frac * prob).sum(dim=1)).mean().item()
        assert m[f"moe/layer{layer}/aux_loss"] == pytest.approx(aux, rel=1e-5)
        total_aux += args.aux_loss_coef * aux
    assert sorted(routing) == ["1", "2", "3"]
    # The logged aux loss is the term the objective adds: sum over layers of aux_loss_coef x layer aux loss.
    assert m["aux_loss"] == pytest.approx(total_aux, rel=1e-5)
    assert m["moe/imbalance_max"] == max(m[f"moe/layer{n}/imbalance"] for n in routing)
    assert balancer.on_log(2) == {}  # reset after reading
    model.eval()  # evaluation forwards are not counted (they must not move the bias)
    with torch.no_grad():
        model(tokens)
    assert all(torch.all(moe.stats == 0) for moe in balancer.modules)


def test_bias_moves_by_sign_minus_its_mean_and_not_on_a_skipped_step() -> None:
    rate = 1e-3
    args = model_args_for("debug_moe", aux_loss_coef=0.0, bias_update_rate=rate)
    model = build_model(args)
    model.init_weights(seed=0)
    routing = _record_routing(model)
    balancer = MoEBalancer(model, bias_update_rate=rate)
    tokens = torch.randint(0, args.vocab_size, (4, 32), generator=torch.Generator().manual_seed(0))

    def biases() -> list[torch.Tensor]:
        return [moe.router.expert_bias.clone() for moe in balancer.modules]

    with torch.no_grad():
        model(tokens)
        before = biases()
        balancer.after_optimizer_step(1, torch.tensor(True))  # a skipped step (non-finite gradients)
        assert all(torch.equal(a, b) for a, b in zip(biases(), before))
        model(tokens)  # the next step: its own loads only, the skipped step's are not carried over
        balancer.after_optimizer_step(2, torch.tensor(False))
    for (_, idx, _), b0, b1 in zip(routing.values(), before, biases()):
        load = torch.bincount(idx.flatten(), minlength=args.n_experts).float()
        delta = rate * torch.sign(load.mean() - load)
        torch.testing.assert_close(b1 - b0, delta - delta.mean(), rtol=0, atol=1e-9)
    with torch.no_grad():
        for step in range(3, 23):
            model(tokens)
            balancer.after_optimizer_step(step, torch.tensor(False))
    # Mean-subtracted: the biases keep summing to zero instead of drifting together.
    for bias in biases():
        assert bias.abs().max() > 5 * rate and abs(bias.sum().item()) < 1e-6, bias


def test_aux_loss_injection_gives_the_gradients_of_the_explicit_sum(monkeypatch) -> None:
    """The trainer's step at pp=1 (2 accumulated microbatches): the aux loss enters backward through each
    layer's injection, scaled like the LM loss; the same gradients as adding every layer's aux loss to the
    objective by hand (what the trainer did before)."""
    import trainer.models.moe as moe_module
    from trainer.loss import LossFn
    from trainer.models.layers import clean_fqn
    from trainer.models.moe import set_aux_loss_scale

    args = model_args_for("debug_moe")
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randint(0, args.vocab_size, (2, 32), generator=g),
                torch.randint(0, args.vocab_size, (2, 32), generator=g)) for _ in range(2)]

    def grads(explicit: bool) -> dict[str, torch.Tensor]:
        model = build_model(args)
        model.init_weights(seed=0)
        loss_fn = LossFn(model.norm, model.output_head)
        layers = [m for m in model.modules() if isinstance(m, MoE)]
        set_aux_loss_scale(layers, 1.0 / len(batches))
        recorded: list[torch.Tensor] = []
        if explicit:  # no injection: each layer's aux loss is collected and added to the objective
            monkeypatch.setattr(moe_module, "attach_aux_loss", lambda out, aux, scale: (recorded.append(aux), out)[1])
        for inputs, labels in batches:
            recorded.clear()
            loss = loss_fn(model(inputs), labels)
            objective = loss + sum(recorded) if explicit else loss
            (objective / len(batches)).backward()
            assert len(recorded) == (3 if explicit else 0)
        monkeypatch.undo()
        return {clean_fqn(n): p.grad.clone() for n, p in model.named_parameters()}

    injected, explicit = grads(False), grads(True)
    assert injected.keys() == explicit.keys()
    for name, ref in explicit.items():
        err = ((injected[name] - ref).norm() / ref.norm()).item()
        assert err < 1e-6, (name, err)
    # The aux term is really in both: the routers' gradients come from it alone and are not zero.
    assert explicit["layers.1.moe.router.gate.weight"].norm() > 0


def test_grouped_swiglu_in_float64_matches_a_per_expert_loop() -> None:
    # torch._grouped_mm rejects float64 on CPU; the layer falls back to a loop there (float64 references).
    g = torch.Generator().manual_seed(0)
    x = torch.randn(13, 16, generator=g, dtype=torch.float64)
    w1, w3 = (torch.randn(3, 8, 16, generator=g, dtype=torch.float64) for _ in range(2))
    w2 = torch.randn(3, 16, 8, generator=g, dtype=torch.float64)
    counts = torch.tensor([5, 0, 8])
    out = grouped_swiglu(x, counts, w1, w2, w3)
    rows, start = [], 0
    for e, c in enumerate(counts.tolist()):
        xe = x[start:start + c]
        rows.append((F.silu(xe @ w1[e].T) * (xe @ w3[e].T)) @ w2[e].T)
        start += c
    assert out.dtype == torch.float64
    torch.testing.assert_close(out, torch.cat(rows), rtol=1e-12, atol=1e-12)


def test_fp8_filter_exact_sets_on_debug_moe(caplog) -> None:
    from trainer.parallel.float8 import Float8Options, apply_float8, select_float8_linears

    args = model_args_for("debug_moe")
    with torch.device("meta"):
        model = build_model(args)
    converted, excluded, num_linear = select_float8_linears(model, exclude_fqns=[])
    attn = {f"layers.{i}.attention.{p}_proj" for i in range(4) for p in "qkvo"}
    dense = {f"layers.0.mlp.{p}_proj" for p in ("gate", "up", "down")}
    assert set(converted) == attn | dense | {"output_head.proj"}
    routers = {f"layers.{i}.moe.router.gate" for i in (1, 2, 3)}
    shared = {f"layers.{i}.moe.shared_expert.{p}_proj" for i in (1, 2, 3) for p in ("gate", "up", "down")}
    assert set(excluded) == routers | shared
    assert {excluded[f] for f in routers} == {"MoE router"}
    assert {excluded[f] for f in shared} == {"MoE shared expert"}
    assert num_linear == len(converted) + len(excluded)

    model = build_model(args)
    with caplog.at_level(logging.INFO, logger="trainer"):
        apply_float8(model, Float8Options(recipe="tensorwise"), device=torch.device("cpu"))
    lines = [r.getMessage() for r in caplog.records]
    assert ("converted 20/32 Linear layers; excluded: layers.{1..3}.moe.router.gate (MoE router); "
            "layers.{1..3}.{moe.shared_expert.gate_proj,moe.shared_expert.up_proj,moe.shared_expert.down_proj} "
            "(MoE shared expert)") in lines
    assert any(line.startswith("MoE routed experts stay bf16: layers.*.moe.experts.{w1,w2,w3} x3") for line in lines)


MOE_CONFIG = str(__import__("pathlib").Path(__file__).resolve().parents[2] / "configs" / "train" / "debug_moe.toml")


@pytest.mark.parametrize(
    "world_size, args, message",
    [
        (1, ["--moe.top_k=9"], "moe.top_k=9 must be at most moe.n_experts=8 (model.flavor='debug_moe' and the [model] "
                               "and [moe] keys set)"),
        (1, ["--moe.n_experts=4", "--moe.top_k=6"], "moe.top_k=6 must be at most moe.n_experts=4"),
        (1, ["--moe.n_dense_layers=5"], "moe.n_dense_layers=5 must be at most model.n_layers=4"),
        (1, ["--moe.dense_layers=1,4"], "moe.dense_layers holds 4, not a block of model.n_layers=4"),
        (1, ["--moe.dense_layers=2,2"], "moe.dense_layers=[2, 2] names a block twice"),
        (1, ["--moe.dense_layers=-1"], "moe.dense_layers[0]=-1 must be an integer in [0, 1099511627776]"),
        (1, ["--moe.sparse_step=0"], "moe.sparse_step=0 must be an integer in [1, 1099511627776] (leave "
                                     "moe.sparse_step out for the flavor's own)"),
        (1, ["--moe.top_k=0"], "moe.top_k=0 must be an integer in [1, 1099511627776] (leave moe.top_k out for the "
                               "flavor's own)"),
        (1, ["--moe.capacity_factor=-0.5"], "moe.capacity_factor=-0.5 must be in [0, 1e+06] (leave "
                                            "moe.capacity_factor out for the flavor's own)"),
        (1, ["--moe.aux_loss_coef=-1"], "moe.aux_loss_coef=-1.0 must be in [0, 1e+06] (leave moe.aux_loss_coef out "
                                        "for the flavor's own)"),
        (1, ["--moe.bias_update_rate=-0.1"], "moe.bias_update_rate=-0.1 must be in [0, 1e+06]"),
        (6, ["--distributed.ep=4"], "distributed.ep=4 must divide distributed.dp_shard x distributed.cp = 6 x 1"),
        (3, ["--distributed.ep=3"], "distributed.ep=3 must divide the 8 routed experts of model.flavor='debug_moe'"),
        (2, ["--distributed.tp=2", "--moe.capacity_factor=1.25"],
         "moe.capacity_factor=1.25 with distributed.tp=2: capacity keeps the earliest positions of each sequence"),
        (4, ["--distributed.ep=2", "--train.activation_checkpointing=selective"],
         "per-op policy (train.selective_ac_every=0) does not work with distributed.ep=2 while the routed experts are "
         "an FSDP2 unit of their own"),
        (2, ["--model.flavor=debug", "--distributed.ep=2"],
         "distributed.ep=2 needs an MoE model, but model.flavor='debug' is dense"),
        (1, ["--model.flavor=debug", "--moe.top_k=2"], "moe.top_k=2 has no effect: model.flavor='debug' is dense"),
        # Any [moe] key set, even to what a dense model does anyway (debug_moe.toml's capacity_factor = 0.0).
        (1, ["--model.flavor=debug"], "moe.capacity_factor=0.0 has no effect: model.flavor='debug' is dense"),
    ],
)
def test_bad_moe_configs_are_one_line_naming_the_key(world_size: int, args: list[str], message: str) -> None:
    from trainer.config import load_job_config
    from trainer.errors import ConfigError
    from trainer.validate import validate_job

    with pytest.raises(ConfigError) as e:
        validate_job(load_job_config(["--config", MOE_CONFIG, *args]), world_size=world_size)
    assert message in str(e.value)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("flavor", sorted(MOE_FLAVORS))
def test_moe_flavors_may_export_at_the_end_of_training(flavor: str) -> None:
    """checkpoint.model_only=true: every MoE flavor has an exact transformers target (tests/unit/test_hf_moe.py)."""
    import dataclasses

    from trainer.hf import check_exportable

    assert check_exportable(MOE_FLAVORS[flavor]) == []  # no refusal, nothing to warn about (no token dropping)
    dropping = dataclasses.replace(MOE_FLAVORS[flavor], capacity_factor=1.25)
    assert ["capacity_factor=1.25 (token dropping)" in note for note in check_exportable(dropping)] == [True]


def test_model_only_asks_the_exports_check_and_its_refusal_names_the_key(monkeypatch) -> None:
    import trainer.validate.layout as layout
    from trainer.config import load_job_config
    from trainer.errors import ConfigError
    from trainer.hf import ExportError
    from trainer.validate import validate_job

    asked = []
    monkeypatch.setattr(layout, "check_exportable", lambda args: asked.append(args) or [])  # where validation looks it up
    cfg = load_job_config(["--config", MOE_CONFIG, "--checkpoint.model_only=true"])
    job = validate_job(cfg, world_size=1)
    assert asked == [job.model_args] and cfg.checkpoint.model_only  # asked once, and model_only kept

    def refuse(args):
        raise ExportError("no Hugging Face target")

    monkeypatch.setattr(layout, "check_exportable", refuse)
    with pytest.raises(ConfigError) as e:
        validate_job(load_job_config(["--config", MOE_CONFIG, "--checkpoint.model_only=true"]), world_size=1)
    assert str(e.value) == "checkpoint.model_only=true: no Hugging Face target; set checkpoint.model_only=false"
    validate_job(load_job_config(["--config", MOE_CONFIG]), world_size=1)  # without model_only nothing is asked


@pytest.mark.parametrize("keys, named, fix", [
    (["--checkpoint.export_interval=100"], "checkpoint.export_interval=100", "set checkpoint.export_interval=0"),
    (["--checkpoint.export_interval=100", "--checkpoint.model_only=true"],
     "checkpoint.model_only=true, checkpoint.export_interval=100",
     "set checkpoint.model_only=false and checkpoint.export_interval=0"),
])
def test_exports_while_training_of_a_model_without_a_target_are_refused_naming_the_keys(keys, named, fix) -> None:
    """checkpoint.export_interval asks the same check as model_only: a tied MoE model (no place for it in the
    Ernie4_5_Moe layout) is refused before training, in one line naming every key that asked for an export."""
    from trainer.config import load_job_config
    from trainer.errors import ConfigError
    from trainer.validate import validate_job

    tied = ["--config", MOE_CONFIG, "--model.tie_word_embeddings=true"]
    with pytest.raises(ConfigError) as e:
        validate_job(load_job_config([*tied, *keys]), world_size=1)
    assert str(e.value).startswith(f"{named}: model.tie_word_embeddings=true has no mapping in this trainer's MoE "
                                   "export") and str(e.value).endswith(fix) and "\n" not in str(e.value)
    validate_job(load_job_config(tied), world_size=1)  # trained tied, it is only the export that cannot be


def test_moe_section_overrides_the_flavor() -> None:
    from trainer.config import load_job_config
    from trainer.validate import validate_job

    job = validate_job(load_job_config(["--config", MOE_CONFIG, "--moe.top_k=3", "--moe.aux_loss_coef=0",
                                        "--moe.capacity_factor=1.25"]), world_size=1)
    args = job.model_args
    assert (args.top_k, args.aux_loss_coef, args.capacity_factor) == (3, 0.0, 1.25)
    assert args.bias_update_rate == FLAVORS["debug_moe"].bias_update_rate  # left out: the flavor's own


def test_fp8_ep_recipe_validates_on_four_ranks(on_h100) -> None:
    from pathlib import Path

    from trainer.config import load_job_config
    from trainer.validate import validate_job

    recipe = Path(MOE_CONFIG).with_name("moe_16b_4gpu_fp8.toml")
    job = validate_job(load_job_config(["--config", str(recipe), "--data.source=synthetic"]), world_size=4)
    pd = job.parallel_dims
    assert (pd.dp_shard, pd.ep, pd.dp_shard_mod_ep) == (4, 4, 1)
    assert job.model_args.n_experts == 64 and job.build.float8 is not None


def test_checkpoint_of_the_other_family_is_a_shape_mismatch(tmp_path) -> None:
    from trainer.checkpoint import CheckpointError, RunInfo
    from trainer.checkpoint.verify import check_model_matches

    dense = RunInfo(flavor="debug", model_args=FLAVORS["debug"], mixed_precision="fp32")
    moe = RunInfo(flavor="debug_moe", model_args=model_args_for("debug_moe"), mixed_precision="fp32")
    assert moe.model_json()["name"] == "moe" and dense.model_json()["name"] == "llama3"
    with pytest.raises(CheckpointError, match=r"the checkpoint is llama3 debug with n_experts=None \(this run: 8\)"):
        check_model_matches({"model": dense.model_json()}, moe, path=tmp_path)
    with pytest.raises(CheckpointError, match=r"the checkpoint is moe debug_moe with n_experts=8 \(this run: None\)"):
        check_model_matches({"model": moe.model_json()}, dense, path=tmp_path)
    check_model_matches({"model": moe.model_json()}, moe, path=tmp_path)  # same model: no error


def test_a_checkpoint_keeps_which_blocks_route(tmp_path) -> None:
    """checkpoint.json holds sparse_step and dense_layers (a JSON list): the model loads back with the same blocks and
    logits, a run with another rule is a shape mismatch naming it, and a checkpoint written before the keys existed
    means the rule it had then (every block after n_dense_layers)."""
    import json
    from dataclasses import replace

    from trainer.checkpoint import CheckpointError, RunInfo, load_model, save_model_only
    from trainer.checkpoint.verify import check_model_matches

    args = replace(MOE_FLAVORS["qwen3_moe_debug"], n_layers=5, dense_layers=(3,), max_seq_len=32)
    with torch.device("meta"):
        model = build_model(args)
    model.to_empty(device="cpu")
    model.init_weights(seed=0)
    run = RunInfo(flavor="qwen3_moe_debug", model_args=args, mixed_precision="fp32")
    ckpt = save_model_only(tmp_path / "ckpt", model.state_dict(), run=run, source="test")
    saved = json.loads((ckpt / "checkpoint.json").read_text())["model"]
    assert (saved["sparse_step"], saved["dense_layers"]) == (2, [3])
    loaded = load_model(ckpt)
    assert loaded.args == args and args.n_moe_layers == 1  # block 1 only: 3 is listed dense
    tokens = torch.arange(16).reshape(2, 8)
    with torch.no_grad():
        assert torch.equal(loaded.logits(tokens), model.eval().logits(tokens))
    other = RunInfo(flavor="qwen3_moe_debug", model_args=replace(args, dense_layers=()), mixed_precision="fp32")
    with pytest.raises(CheckpointError, match=r"dense_layers=\[3\] \(this run: \[\]\)"):
        check_model_matches({"model": saved}, other, path=tmp_path)
    old = RunInfo(flavor="debug_moe", model_args=model_args_for("debug_moe"), mixed_precision="fp32").model_json()
    for key in ("sparse_step", "dense_layers"):
        del old[key]
    check_model_matches({"model": old}, RunInfo(flavor="debug_moe", model_args=model_args_for("debug_moe"),
                                                mixed_precision="fp32"), path=tmp_path)


def _moe_trainer(tmp_path, *args: str):
    from trainer.config import load_job_config
    from trainer.run.train import build_trainer

    return build_trainer(load_job_config(["--config", MOE_CONFIG, "--train.seq_len=32", "--train.batch_size=2",
                                    "--metrics.log_freq=1", "--metrics.enable_tensorboard=false",
                                    f"--job.dump_folder={tmp_path}", *args]))


def test_bf16_master_weights_keep_moe_buffers_fp32(tmp_path) -> None:
    from trainer.distributed import destroy_distributed

    trainer = _moe_trainer(tmp_path, "--train.mixed_precision=bf16", "--distributed.master_dtype=bf16",
                           "--moe.aux_loss_coef=0", "--moe.bias_update_rate=0.001")
    try:
        layers = [m for m in trainer.model.modules() if isinstance(m, MoE)]
        assert len(layers) == 3 and all(p.dtype == torch.bfloat16 for p in trainer.model.parameters())
        for m in layers:
            assert m.router.expert_bias.dtype == m.stats.dtype == m.aux_grad_scale.dtype == torch.float32
            # At 0.75 a 1e-3 step is below half a bf16 ulp (2^-9): a bf16 bias would not move.
            m.router.expert_bias.fill_(0.75)
        trainer.train_step(trainer.data_loader.next_batch())
        for m in layers:
            step = (m.router.expert_bias - 0.75).abs()
            assert 0.5e-3 < step.max().item() < 2e-3, step
    finally:
        trainer.close()
        destroy_distributed()


def test_a_skipped_step_moves_no_expert_bias(tmp_path) -> None:
    from trainer.distributed import destroy_distributed
    from trainer.run.step import NonFiniteError

    trainer = _moe_trainer(tmp_path, "--train.steps=2", "--train.on_nonfinite=skip", "--moe.bias_update_rate=0.01")
    try:
        with torch.no_grad():  # a NaN in a dense weight: every gradient norm is non-finite, every step skipped
            trainer.model.layers["0"].mlp.up_proj.weight.to_local()[0, 0] = float("nan")
        with pytest.raises(NonFiniteError, match=r"^every one of this run's 2 steps"):  # trained nothing: not exit 0
            trainer.run()
        assert trainer.metrics.num_nonfinite == 2
        assert all(torch.all(m.router.expert_bias == 0) for m in trainer.model.modules() if isinstance(m, MoE))
    finally:
        trainer.close()
        destroy_distributed()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_swiglu_leaves_rows_past_the_last_group_out(dtype: torch.dtype) -> None:
    """Rows past sum(counts) belong to no expert (the padded all-to-all's empty rows, moe.dispatch='padded'): the
    experts' rows give what they give alone, bit for bit, whatever the extra rows hold (here huge values), and no
    gradient of a weight or of an expert's row depends on them."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(13, 16, generator=g).to(dtype)
    w1, w3 = (torch.randn(3, 16, 16, generator=g).to(dtype).requires_grad_() for _ in range(2))
    w2 = torch.randn(3, 16, 16, generator=g).to(dtype).requires_grad_()
    counts = torch.tensor([5, 0, 8])
    extra = torch.full((7, 16), 1e30).to(dtype)

    def run(rows: torch.Tensor) -> list[torch.Tensor]:
        rows = rows.clone().requires_grad_()
        out = grouped_swiglu(rows, counts, w1, w2, w3)[:13]
        grads = torch.autograd.grad(out.float().square().sum(), [rows, w1, w2, w3])
        return [out, grads[0][:13], *grads[1:]]

    alone, padded = run(x), run(torch.cat([x, extra]))
    for a, p in zip(alone, padded):
        assert torch.equal(a, p)
