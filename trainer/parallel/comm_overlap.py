"""Compute beside the expert-parallel all-to-alls in a compiled MoE block (moe.overlap_all_to_all).

Dynamo traces each functional collective's wait right after it, so in the compiled block every all-to-all ran
alone: the GPU idled while the rows crossed. `OverlapAllToAlls` is an inductor post-grad pass over each graph
(forward and backward) that reorders, for every all-to-all, the stretch of nodes around it that it may reorder
(between the nearest nodes with side effects or collectives, so every rank still issues its collectives in one
order):

    [the all-to-all's inputs] all-to-all  [what does not need its rows]  wait  [what does]

A topological order of the same nodes, so the same values: nodes that do not descend from the all-to-all never
read its rows, and its ancestors never read a node moved after them. What lands inside (the MoE layer runs its shared
experts in the routed experts' call, `GroupedExperts.forward`'s `beside`, so they share a graph with the all-to-alls
even where FSDP's hooks around the routed experts end a graph): in forward the shared experts, beside the combine; in
backward the shared experts' backward beside the combine's gradient, and the routed experts' weight gradients beside
the dispatch's. The waits are NCCL stream waits, so the GEMMs run while the rows cross.

Inductor's own reordering passes (`reorder_for_compute_comm_overlap`) decide by their runtime and memory estimates,
and left every window of these graphs empty on an H200 (torch 2.11); this pass decides by the data dependencies
alone. Inductor's reordering for peak memory, which would undo it, is off in these graphs
(`trainer.parallel.compile.OVERLAP_INDUCTOR_OPTIONS`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import fx
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

ALL_TO_ALL = torch.ops._c10d_functional.all_to_all_single.default
WAIT = torch.ops._c10d_functional.wait_tensor.default


def _fixed(node: fx.Node) -> bool:
    """A node nothing may move across: side effects (mutations, asserts, waits, placeholders, output) or a
    collective (each rank must issue them in the same order)."""
    return node.is_impure() or (node.op == "call_function" and "_c10d_functional" in str(node.target))


def _closure(start: fx.Node, step: Callable[[fx.Node], Iterable[fx.Node]], within: set[fx.Node]) -> set[fx.Node]:
    """The nodes of `within` reached from `start` by repeated `step` (inputs: ancestors; users: descendants)."""
    seen, todo = set(), [start]
    while todo:
        for nxt in step(todo.pop()):
            if nxt in within and nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen


def overlap_all_to_alls(graph: fx.Graph) -> int:
    """Reorder `graph` in place as the module docstring says; the number of all-to-alls with nodes moved beside
    them."""
    overlapped = 0
    for a2a in [n for n in graph.nodes if n.target is ALL_TO_ALL]:
        waits = [u for u in a2a.users if u.target is WAIT]
        if len(waits) != 1:
            continue
        wait = waits[0]
        order = list(graph.nodes)
        i = order.index(a2a)
        lo = i
        while lo > 0 and not _fixed(order[lo - 1]):
            lo -= 1
        hi = i + 1
        while hi < len(order) and (order[hi] is wait or not _fixed(order[hi])):
            hi += 1
        stretch = order[lo:hi]
        within = set(stretch)
        inputs = _closure(a2a, lambda n: n.all_input_nodes, within)
        readers = _closure(a2a, lambda n: n.users, within)  # the wait and everything that reads the rows
        beside = [n for n in stretch if n is not a2a and n not in inputs and n not in readers]
        new = [n for n in stretch if n in inputs] + [a2a] + beside + [wait] + [
            n for n in stretch if n in readers and n is not wait]
        if new == stretch or not beside:
            continue
        end = order[hi]  # the output node at the latest: a stretch never holds it
        for node in new:
            end.prepend(node)
        overlapped += 1
    graph.lint()
    return overlapped


class OverlapAllToAlls(CustomGraphPass):
    """`overlap_all_to_alls` as inductor's post_grad_custom_post_pass (its uuid keys inductor's graph cache)."""

    def __call__(self, graph: fx.Graph) -> None:
        overlap_all_to_alls(graph)

    def uuid(self) -> bytes:
        return get_hash_for_files((__file__,))
