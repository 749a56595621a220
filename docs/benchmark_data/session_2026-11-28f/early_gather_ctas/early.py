"""Prototype: update root + embeddings + layers.0 first, start their all-gathers on a side stream, then the rest."""
import os, runpy, sys
sys.path.insert(0, os.getcwd())
import torch
import trainer.run.step as S

orig = S.TrainStep._optimizer_step

def _group_params(unit):
    return [fp.sharded_param for fp in unit._get_fsdp_state()._fsdp_param_group.fsdp_params]

def patched(self, norm, found_inf):
    m = self.model
    if not hasattr(self, "_early"):
        units = [m]
        if getattr(m, "tok_embeddings", None) is not None and hasattr(m.tok_embeddings, "unshard"):
            units.append(m.tok_embeddings)
        first_block = next(iter(m.layers.values()))
        units.append(first_block)
        first = {id(p) for u in units for p in _group_params(u)}
        self._early = (units, first, torch.cuda.Stream())
        if torch.distributed.get_rank() == 0:
            print("EARLY units", len(units), "params", len(first), "of", len(self.params), flush=True)
    units, first, side = self._early
    grads = {id(p): p.grad for p in self.params}
    rest = [p for p in self.params if id(p) not in first]
    for p in rest:
        p.grad = None
    orig(self, norm, found_inf)
    for p in rest:
        p.grad = grads[id(p)]
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for u in units:
            u.unshard(async_op=True)
    for p in self.params:
        if id(p) in first:
            p.grad = None
    orig(self, norm, found_inf)

S.TrainStep._optimizer_step = patched
script = sys.argv[1]
sys.argv = [script] + sys.argv[2:]
runpy.run_path(script, run_name="__main__")
