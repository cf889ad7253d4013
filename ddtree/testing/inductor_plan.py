"""What Inductor would run for a compiled function, without building or running its kernels: per graph, the
wrapper code (its buffer allocations) and Inductor's own count of the bytes each fused kernel reads and writes.

`inductor_plans()` stops each Inductor compile inside it after the scheduling and code generation (the step where
`torch._inductor.graph.GraphLowering` turns the fused nodes into kernel source), before any kernel is compiled: the
call that compiled raises (`plan_of` runs one call and keeps the plan). Inputs may be memory never written
(`torch.empty`, a model from `to_empty`): nothing reads it. So a graph's bytes can be counted at a 27B model's dims
on a CPU with little memory (bench/bench_launches.py --compile), and a test can read the allocations of a tiny
model's graphs in seconds instead of minutes of C++ compiling (tests/test_compile.py).

Bytes per kernel (`_node_bytes`) start from Inductor's own account (`get_read_write_buffer_accesses`, what
torch.compile's `inductor_metrics` log sums): every buffer a fused node reads or writes, once per node, fused
intermediates left out; a buffer read through indices is counted at the elements the loop touches (Inductor takes
the whole buffer) and an extern kernel's buffers (matrix products, attention) whole (Inductor caps them at 1e9
elements), or at the view it reads where an input is a view of a larger buffer (one layer's slot of a stacked state). The scheduler and code generation are the CPU backend's here; a CUDA compile fuses differently in
places (Triton), with the same buffers in and out of each extern kernel.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch

__all__ = ["Plan", "allocations", "inductor_plans", "plan_of", "round_plans"]

_ALLOC = re.compile(r"(\w+) = empty_strided_\w+\(\(([^)]*)\), \(([^)]*)\), torch\.(\w+)\)")


@dataclass
class Plan:
    """One graph's plan: its wrapper code and (node name, bytes read and written, what it runs) per scheduled
    node."""

    code: str
    nodes: list[tuple[str, int, str]] = field(default_factory=list)

    @property
    def bytes(self) -> int:
        return sum(b for _, b, _ in self.nodes)


class _Planned(Exception):
    pass


def _node_bytes(node) -> int:
    """Bytes one scheduled node reads and writes: Inductor's per-buffer count (each buffer at most its size, fused
    intermediates left out), with corrections where that count is a worst case, not the traffic: an extern kernel's
    buffers at their sizes (Inductor caps them at 1e9 elements: a 27B model's lm_head), an extern kernel's input read
    through a view of a larger buffer at the view's size (`_viewed`), a buffer read or written through indices (an
    embedding's rows, a gather, `index_copy_`'s rows: Inductor takes the whole buffer) at the elements the loop
    touches, and an ordering edge (WeakDep: a buffer written in place later) at none."""
    from torch._inductor.dependencies import MemoryDep, StarDep, WeakDep
    from torch._inductor.scheduler import ExternKernelSchedulerNode, NopKernelSchedulerNode
    from torch._inductor.utils import get_dtype_size
    from torch._inductor.virtualized import V

    if isinstance(node, NopKernelSchedulerNode):
        return 0
    hint = V.graph.sizevars.optimization_hint

    def whole(name: str) -> int:
        try:
            return int(hint(V.graph.get_numel(name), fallback=0)) * get_dtype_size(V.graph.get_dtype(name))
        except Exception:  # a buffer without a layout (NoneLayout)
            return 0

    if isinstance(node, ExternKernelSchedulerNode):
        viewed = _viewed(node)
        return sum(min(whole(name), viewed.get(name, whole(name)))
                   for name in {d.name for d in (*node.read_writes.reads, *node.read_writes.writes)})
    acc = node.get_read_write_buffer_accesses(include_reads=True, include_writes=True)
    for name in acc:
        touched, indexed = 0, False
        for sub in node.get_nodes():
            ranges = sub.get_ranges() if hasattr(sub, "get_ranges") else ((), ())
            numel = int(hint(sympy_product(ranges[0]) * sympy_product(ranges[1]), fallback=0))
            for dep in (*sub.read_writes.reads, *sub.read_writes.writes):
                if dep.name != name:
                    continue
                if isinstance(dep, WeakDep):  # an ordering edge (a later write to the buffer), no access
                    indexed = True
                elif isinstance(dep, StarDep) or (isinstance(dep, MemoryDep) and dep.is_indirect()):
                    indexed = True
                    touched += numel
                elif isinstance(dep, MemoryDep):
                    touched += int(hint(dep.get_numel(), fallback=0))
        if indexed:
            acc[name] = min(acc[name], touched * get_dtype_size(V.graph.get_dtype(name)))
    return int(sum(acc.values()))


def _viewed(node) -> dict[str, int]:
    """An extern kernel's inputs read through views of a larger buffer (`reinterpret_tensor`: a GDN layer's slot of the
    stacked recurrent state, the k rows of a [q; k] buffer): buffer -> bytes of the largest such view. The kernel reads
    the view, not the buffer (Inductor's dependency is the whole buffer)."""
    from torch._inductor.ir import ReinterpretView
    from torch._inductor.utils import get_dtype_size
    from torch._inductor.virtualized import V

    hint = V.graph.sizevars.optimization_hint
    out: dict[str, int] = {}
    for inp in getattr(node.node, "inputs", ()) or ():
        if not isinstance(inp, ReinterpretView):  # (read whole too, if it is a buffer)
            name = getattr(inp, "get_name", lambda: None)()
            if name is not None:
                out[name] = 1 << 62
        else:
            try:
                size = int(hint(sympy_product(inp.get_size()), fallback=0)) * get_dtype_size(inp.get_dtype())
            except Exception:  # a view without a static size
                continue
            name = inp.get_name()
            out[name] = max(out.get(name, 0), size)
    return out


def sympy_product(sizes):
    from torch._inductor.utils import sympy_product as product

    return product(sizes)


def _kind(node) -> str:
    """An extern kernel's op (aten.mm, sdpa, ...), else the fused node's origin ops."""
    inner = getattr(node, "node", None)
    name = getattr(inner, "python_kernel_name", None)
    if name:
        return str(name)
    origins = sorted({str(o.target) for n in getattr(node, "get_nodes", lambda: [node])()
                      for o in getattr(getattr(n, "node", None), "origins", ()) if o.op == "call_function"})
    return "fused: " + ", ".join(origins[:6])


def allocations(code: str) -> list[tuple[str, tuple[int, ...], str]]:
    """(buffer, shape, dtype) of every buffer a graph's wrapper code allocates (its temporaries and outputs)."""
    out = []
    for m in _ALLOC.finditer(code):
        shape = tuple(int(x) for x in m.group(2).replace(" ", "").split(",") if x)
        out.append((m.group(1), shape, m.group(4)))
    return out


@contextlib.contextmanager
def inductor_plans() -> Iterator[list[Plan]]:
    """Inside: every Inductor compile records its Plan into the yielded list and stops before building kernels."""
    from torch._inductor import config
    from torch._inductor.graph import GraphLowering

    plans: list[Plan] = []
    original = GraphLowering._compile_to_module

    def planned(self):
        wrapper, _ = self.codegen()
        code = getattr(wrapper, "value", wrapper)
        nodes = [(node.get_name(), _node_bytes(node), _kind(node)) for node in self.scheduler.nodes]
        plans.append(Plan(str(code), nodes))
        raise _Planned

    GraphLowering._compile_to_module = planned
    try:
        with config.patch(fx_graph_cache=False, force_disable_caches=True):
            yield plans
    finally:
        GraphLowering._compile_to_module = original


def plan_of(fn: Callable, *args) -> Plan:
    """The Plan of `fn` (a torch.compile'd function with the inductor backend) on `args`: its one graph."""
    with inductor_plans() as plans, torch.inference_mode():
        try:
            fn(*args)
        except Exception as e:  # dynamo wraps the stop as a backend failure
            cause = e
            while cause is not None and not isinstance(cause, _Planned):
                cause = cause.__cause__ or cause.__context__
            if cause is None:
                raise
    if len(plans) != 1:
        raise RuntimeError(f"expected one graph, Inductor planned {len(plans)}")
    return plans[0]


def round_plans(engine, capacity: int, draft_capacity: int | None = None) -> dict[str, Plan]:
    """The Plan of each graph of `engine`'s compiled round (ddtree.engine.compiled, compile="true" with the inductor
    backend) at KV capacity `capacity` (the drafter's: `draft_capacity`, default the same): {"draft", "tree",
    "verify", "commit"}, those the method has. Inputs are fresh `torch.empty` buffers of the shapes a round passes
    (their values are never read)."""
    from ddtree.engine import gdn
    from ddtree.engine.compiled import pending_shapes

    static = engine.static
    model, dev = static.model, static.device
    dtype = static.binding.dtype
    n = engine.proposer.max_nodes if hasattr(engine.proposer, "max_nodes") else None
    if engine.method == "ddtree":
        n = engine.budget + 1
    elif engine.method == "dflash":
        n = engine.proposer.block_size
    elif engine.method == "ar":
        n = 1
    cfg = model.config.get_text_config()
    long = dict(dtype=torch.long, device=dev)
    ids, parents, depths = (torch.zeros(1, n, **long), torch.arange(n, **long) - 1, torch.arange(n, **long))
    anc = torch.ones(n, n, dtype=torch.bool, device=dev).tril_()
    length = torch.zeros(1, **long)
    keys = values = conv = rec = pending = None
    if static.attn_layers:
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads

        def kv():
            return [torch.empty(1, cfg.num_key_value_heads, capacity, head_dim, dtype=dtype, device=dev)
                    for _ in static.attn_layers]

        keys, values = kv(), kv()
    if static.gdn_modules:
        module, count = static.gdn_modules[0], len(static.gdn_modules)
        channels = module.conv1d.weight.shape[0]
        conv = torch.empty(count, 1, channels, static.kernel, dtype=dtype, device=dev)
        rec = torch.empty(count, 1, module.num_v_heads, module.head_k_dim, module.head_v_dim, dtype=torch.float32,
                          device=dev)
        shapes = pending_shapes(gdn._buffer_shapes(module, 1, n, channels))
        pending = tuple(torch.empty(count, *shape, device=dev,
                                    dtype=dtype if name in gdn._MODEL_DTYPE else torch.float32)
                        for name, shape in shapes.items())
    plans = {"verify": plan_of(static.verify_graph, ids, parents, depths, anc, length, keys, values, conv, rec)}
    draft = static.draft
    io: tuple = ()
    if draft is not None and hasattr(draft, "context_for"):  # a DFlash drafter (StaticDraft)
        width = len(draft.drafter.target_layer_ids) * draft.drafter.config.hidden_size
        feats = torch.empty(1, n, width, dtype=dtype, device=dev)
        context, count_t = draft.context_for(n)
        io = (feats, context, count_t)
        dcfg = draft.drafter.config
        q = draft.q

        def dkv():
            return [torch.empty(1, dcfg.num_key_value_heads, draft_capacity or capacity, dcfg.head_dim, dtype=dtype,
                                device=dev) for _ in draft.drafter.layers]

        root = torch.zeros(1, **long)
        mask_ids = torch.zeros(q - 1, **long)
        plans["draft"] = plan_of(draft.graph, root, context, count_t, length, dkv(), dkv(), mask_ids)
        if engine.method == "ddtree":
            logits = torch.empty(q - 1, cfg.vocab_size, dtype=torch.float32, device=dev)
            plans["tree"] = plan_of(static.tree_graph, root, logits, engine.budget)
    path = torch.zeros(n, **long)
    plans["commit"] = plan_of(static.commit_graph, path, length, keys, values, conv, rec, pending, *io)
    return plans
