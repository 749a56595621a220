"""AdamW with moments of their own on sharded DTensors (2 spawned gloo ranks): every layout that holds whole 1x128 blocks (FSDP2's
dim-0 shards, uneven ones included; a TP dim-1 shard of 128 columns; an EP shard of whole experts) updates every
element exactly as one process does, the fp8 first moment's bytes and block scales included; a dim-1 shard that cuts
a block keeps a bf16 first moment. The sharded state saved by DCP on 2 ranks loads on 1 (resharded), as it is and
converted to another exp_avg dtype (trainer/checkpoint/moments.py)."""

from __future__ import annotations

import torch

from tests.distributed.spawn import run_distributed

# (shape, placement dim): FSDP2 dim 0 (7 rows: 4 and 3), TP dim 1 of 256 columns (128 each), EP's experts on dim 0,
# a dim-1 shard of 384 columns (192 each: cuts a block), a 1-D tensor.
CASES = [((7, 128), 0), ((4, 256), 1), ((4, 3, 128), 0), ((2, 384), 1), ((9,), 0)]
COMBOS = [("fp32", "fp8", "bf16"), ("bf16", "fp8", "fp32"), ("fp32", "bf16", "bf16")]


def _one_process_and_sharded(folder: str) -> dict:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    from trainer.distributed import destroy_distributed
    from trainer.optim.adamw import AdamW
    from trainer.optim.states import StateDtypes

    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (2,))
    gen = torch.Generator().manual_seed(0)
    out: dict = {}

    def full(t):
        if not isinstance(t, DTensor):
            return t
        if t.dtype != torch.float8_e4m3fn:
            return t.full_tensor()
        as_bytes = t.to_local().view(torch.uint8)  # gloo gathers no float8: its bytes instead
        return DTensor.from_local(as_bytes, t.device_mesh, t.placements, shape=t.shape,
                                  stride=t.stride()).full_tensor().view(t.dtype)

    def portable(t):  # pickle cannot bring float8 back from a spawned process: (dtype, bytes)
        return str(t.dtype), t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t

    def run(combo, sharded: bool, steps: int = 3):
        dtype = torch.float32 if combo[0] == "fp32" else torch.bfloat16
        params = [torch.nn.Parameter(distribute_tensor(t.to(dtype), mesh, [Shard(d)]) if sharded
                                     else t.to(dtype).clone())
                  for t, (_, d) in zip(starts, CASES)]
        opt = AdamW(params, lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, implementation="eager",
                    rounding="stochastic", dtypes=StateDtypes(*combo), seed=5, names=[f"p{i}" for i in range(len(CASES))])
        for step in grads[:steps]:
            for p, g, (_, d) in zip(params, step, CASES):
                g = g.to(dtype)
                p.grad = distribute_tensor(g, mesh, [Shard(d)]) if sharded else g
            opt.found_inf = torch.tensor(0.0)
            opt.step()
        return params, opt

    starts = [torch.randn(shape, generator=gen) for shape, _ in CASES]
    grads = [[torch.randn(shape, generator=gen) for shape, _ in CASES] for _ in range(3)]
    try:
        for combo in COMBOS:
            (p1, o1), (p2, o2) = run(combo, False), run(combo, True)
            out[combo] = [([portable(p.detach())] + [portable(v) for k, v in o1.state[p].items() if k != "step"],
                           [portable(full(q.detach()))] + [portable(full(v)) for k, v in o2.state[q].items()
                                                           if k != "step"],
                           sorted(o2.state[q]))
                          for p, q in zip(p1, p2)]
        # Save the sharded fp8 state with DCP on both ranks; load it on rank 0 alone, as it is and as bf16.
        params, opt = run(COMBOS[0], True, steps=2)
        state = {f"p{i}": {k: v for k, v in opt.state[p].items()} for i, p in enumerate(params)}
        dcp.save({"optimizer": {"state": state}}, checkpoint_id=folder)
        out["saved"] = [{k: portable(full(v)) for k, v in s.items() if k != "step"} for s in state.values()]
        return out
    finally:
        destroy_distributed()


def test_sharded_layouts_update_as_one_process_and_reshard(tmp_path) -> None:
    ranks = run_distributed(_one_process_and_sharded, world_size=2, args=(str(tmp_path / "ckpt"),), timeout=120)
    for rank in ranks:
        for combo in COMBOS:
            for (shape, dim), (one, sharded, keys) in zip(CASES, rank[combo]):
                cut = len(shape) < 2 or (dim == len(shape) - 1 and shape[-1] // 2 % 128)
                if combo[1] == "fp8":
                    assert ("exp_avg_scale" in keys) == (not cut), (combo, shape)
                if cut and combo[1] == "fp8" and len(shape) >= 2:
                    assert sharded[1][0] == "torch.bfloat16" and one[1][0] == "torch.float8_e4m3fn"
                    continue  # one process keeps fp8 blocks there: the layouts differ by design
                for (dtype_a, a), (dtype_b, b) in zip(one, sharded, strict=True):
                    assert dtype_a == dtype_b and torch.equal(a, b), (combo, shape, dtype_a)
    saved = [{k: b.view(torch.float8_e4m3fn) if d == "torch.float8_e4m3fn" else b for k, (d, b) in s.items()}
             for s in ranks[0]["saved"]]
    _load_on_one_process(str(tmp_path / "ckpt"), saved)


def _load_on_one_process(folder: str, saved: list[dict]) -> None:
    """The 2-rank checkpoint loaded in this (1-process) pytest process, as it is and converted to bf16."""
    import torch.distributed.checkpoint as dcp

    from trainer.optim import part as moments
    from trainer.optim.adamw import AdamW
    from trainer.optim.states import StateDtypes, dequantize_blocks

    metadata = dcp.FileSystemReader(folder).read_metadata().state_dict_metadata
    lines = {}
    for combo in (COMBOS[0], ("fp32", "bf16", "bf16")):
        params = [torch.nn.Parameter(torch.zeros(shape)) for shape, _ in CASES]
        for p in params:
            p.grad = torch.zeros_like(p)
        opt = AdamW(params, lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, implementation="eager",
                    rounding="stochastic", dtypes=StateDtypes(*combo), seed=5)
        opt.step()  # makes the state, overwritten by the load
        sd = {f"p{i}": dict(opt.state[p]) for i, p in enumerate(params)}
        staged, _ = moments.stage(sd, {k.removeprefix("optimizer.state."): md for k, md in metadata.items()})
        dcp.load({"optimizer": {"state": sd}}, checkpoint_id=folder, no_dist=True)
        lines[combo] = moments.convert(sd, staged)
        got = list(sd.values())
        if combo == COMBOS[0]:
            for s, g in zip(saved, got):
                if "exp_avg_scale" in s:
                    assert all(torch.equal(s[k].view(torch.uint8), g[k].view(torch.uint8)) for k in s)
        else:
            for s, g in zip(saved, got):
                m = dequantize_blocks(s["exp_avg"], s["exp_avg_scale"]) if "exp_avg_scale" in s else s["exp_avg"]
                assert torch.equal(g["exp_avg"].float(), m.float())  # e4m3 x a power of two is a bf16 value
    assert lines[COMBOS[0]] == "exp_avg bf16 -> fp8 (1 tensor)", lines  # the cut tensor: bf16 on 2 ranks
    assert lines[("fp32", "bf16", "bf16")] == "exp_avg fp8 -> bf16 (3 tensors)", lines
