"""fake_moe.py with the overlap pass reporting: per graph, the all-to-alls and what sits between each start and wait."""
import sys
import trainer.parallel.comm_overlap as co
orig = co.overlap_all_to_alls
def report(graph):
    n = orig(graph)
    order = list(graph.nodes)
    for a2a in [x for x in order if x.target is co.ALL_TO_ALL]:
        ws = [u for u in a2a.users if u.target is co.WAIT]
        if not ws:
            print("PASS a2a without wait", a2a.name, flush=True); continue
        i, j = order.index(a2a), order.index(ws[0])
        inside = [getattr(x.target, "__name__", str(x.target)) for x in order[i + 1:j]]
        print(f"PASS {a2a.name}: moved={n} {j - i - 1} nodes inside, gemms {[t for t in inside if 'mm' in t]}", flush=True)
co.OverlapAllToAlls.__call__ = lambda self, g: report(g)
sys.argv = sys.argv[1:]
exec(open("tmp_gpu/fake_moe.py").read())
