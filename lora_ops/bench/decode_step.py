"""`python -m lora_ops.bench --decode-step`: the LoRA overhead of a whole model's decode step.

Every linear layer of the model (fused qkv with GQA slices, o, fused gate_up, down; attention is left out: LoRA
does not change it) runs once per layer, captured as ONE CUDA graph per step and replayed; weights rotate
through HBM as in a real step (a step's weights are many times the L2). Each row of the batch is on a random
adapter of a 32-slot pool, the adapters spread over the rows as evenly as possible (testing.random_token_slots), or,
for a step given as T/adapters/rank/drawn, one row each and the other rows on adapters drawn at random
(testing.drawn_sizes: uneven, as a serving batch's are; even sizes put a run of one slot's rows at every multiple of
the size in build_segments' order, which a kernel taking positions in fixed groups can be lucky with). Routes:

- base:        the base GEMMs alone (cuBLAS).
- sgmv-<b>:    base GEMM + the fused sgmv op per layer, backend <b> (cuda: the C++ kernels; triton).
- fold-<b>:    one GEMM per layer against [W; A of every slot] gives y and every used slot's h (bf16) at once,
               then the lora_expand op adds each row's own window of h times its B (backend <b>), on CUDA in its
               rows form (each row's slot as given, no segments), on Triton over the segments. The GEMM is
               lora_ops.fold_linear with the step's seg_indptr, as the serving layer runs it (up to 64 tokens on
               sm_90 it skips the A of the slots no row uses).
- kext-cuda:   one lora_ops.lora_linear per layer: a shrink writes each row's h (bf16), then one GEMM
               [x | h]·[W | B of every slot]ᵀ that starts while the shrink runs (programmatic dependent launch), as
               the serving layer's kext route runs it: on the modules lora_linear's kernels serve; the others
               (e.g. the 70B shard's o_proj, K = 1024: fewer K blocks than the GEMM's stages) take the committed
               routes table's fallback for the step, as the serving layer does.
- vllm:        a peer, where its copy is built (lora_ops.bench.peers): the base GEMM, then vLLM's lora_shrink and
               lora_expand as vLLM runs them, in vLLM's layout of each module's pool. Its metadata is prepared
               before the step is captured (it syncs the host), as vLLM prepares it before replaying a graph; the
               lora_ops routes build their segments inside the step.

Every route reads the adapter pool's layout of the serving layer (ModuleSlots): [W; A of every slot] as one
matrix, lora_b [L, N, R], and for the kext route B of every slot as columns [N, L·R] (b_cols, a copy).

With --between-modules, a kernel writes each module's input just before the module runs (x *= 1 in place: the
values stay), in the base and every route, as a model's norms, attention and activation do: the next GEMM then
follows a torch kernel instead of the previous module's LoRA kernel, and reads what that kernel wrote, which is
what decides a programmatic (early) launch's gain in a model (csrc/cuda/NOTES.md, session 28). Off by default: the
issue's step is the linear layers alone.

The LoRA routes also run build_segments once per step (the fold route's GEMM reads its seg_indptr, and the serving
layer's pool builds it every step, whatever the route). The base and the routes are timed in turn, five rounds, the
median of each. Reported per route: µs per step, the overhead over base in %, the floor of that overhead (the bytes
of the adapters present over the bytes of the base weights: what must be read, at the same bandwidth), the copy
floor (those bytes at the copy bandwidth measured in the same run, given by the caller: about the least that
kernels reading them after the base GEMM, sgmv's or vLLM's, can add; a route that reads them in a GEMM of its own
instead of the base GEMM, fold or kext, can beat both floors where the base GEMM runs below copy bandwidth), the fold
route's own floor where its GEMM does not skip unused slots (at::linear reads every pool slot's A; fold_linear's
sm_90 kernel, which skips them, can go below it), and the relative error against the float64 oracle of the first
layer's outputs, run eagerly, and of the last layer's, left by a replay of the timed graph (the larger; `base`
shows the bf16 GEMM's own error).
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

import lora_ops
from lora_ops import backends, reference, testing
from lora_ops import routes as route_table

from . import peers
from .timing import capture, time_interleaved

POOL_SLOTS = 32


@dataclasses.dataclass(frozen=True)
class ModelShape:
    name: str
    hidden: int        # K of qkv and gate_up, N of o and down
    q: int             # width of the q slice, K of o
    kv: int            # width of the k and v slices
    intermediate: int  # width of the gate and up slices, K of down
    layers: int

    def modules(self) -> List[Tuple[str, int, Tuple[int, ...]]]:
        """(name, K, slice widths) of one layer's LoRA-wrapped linear layers."""
        return [("qkv", self.hidden, (self.q, self.kv, self.kv)), ("o", self.q, (self.hidden,)),
                ("gate_up", self.hidden, (self.intermediate, self.intermediate)),
                ("down", self.intermediate, (self.hidden,))]

    def kn(self) -> List[Tuple[int, int]]:
        """Each module's (K, N), as a routes table records them."""
        return [(K, sum(widths)) for _, K, widths in self.modules()]


MODELS = {
    "llama3-8b": ModelShape("llama3-8b", 4096, 4096, 1024, 14336, 32),
    "qwen2-7b": ModelShape("qwen2-7b", 3584, 3584, 512, 18944, 28),
    # one GPU's shard of Llama-3-70B under tensor parallelism 8: column-parallel qkv/gate_up, row-parallel o/down
    "llama3-70b-tp8": ModelShape("llama3-70b-tp8", 8192, 1024, 128, 3584, 80),
}


# How a step's rows spread over its adapters (the module docstring); with one adapter, or no more tokens than
# adapters, the two give the same batch.
SPREADS = ("even", "drawn")


@dataclasses.dataclass(frozen=True)
class Step:
    T: int
    adapters: int
    rank: int
    spread: str = "even"

    def label(self) -> str:
        """The step as the log names it."""
        drawn = " (drawn)" if self.spread == "drawn" else ""
        return f"T={self.T} adapters={self.adapters}{drawn} rank={self.rank}"


# Issue 12's four rows, then two of them as a serving batch spreads its rows (what the even spread hides: with 4 rows
# on each adapter, each in a run of its own of the expand kernel's 4-position warps)
STEPS = [Step(32, 32, 16), Step(128, 32, 16), Step(32, 1, 16), Step(64, 16, 64), Step(128, 32, 16, "drawn"),
         Step(64, 16, 64, "drawn")]


def parse_steps(text: str) -> List[Step]:
    """'T/adapters/rank[/spread],...' (the --steps option) as steps; a ValueError names the bad one."""
    steps = []
    for item in text.split(","):
        fields = item.split("/")
        spread = fields.pop() if len(fields) == 4 and fields[3] in SPREADS else "even"
        if len(fields) != 3 or not all(f.isdigit() and int(f) > 0 for f in fields):
            raise ValueError(f"{item!r} is not T/adapters/rank with three positive integers, then optionally "
                             f"/{' or /'.join(SPREADS)}")
        step = Step(*map(int, fields), spread)
        if step.adapters > POOL_SLOTS:
            raise ValueError(f"{item!r}: more adapters than the pool's {POOL_SLOTS} slots")
        steps.append(step)
    return steps


def _layer_elements(model: ModelShape, rank: int) -> Tuple[int, int, int]:
    """One layer's elements: (its base weights, one slot's A, one slot's B)."""
    base = a = b = 0
    for _, K, widths in model.modules():
        base += sum(widths) * K
        a += rank * len(widths) * K
        b += rank * sum(widths)
    return base, a, b


def _present(step: Step) -> int:
    """The adapters a step's rows are on: with fewer tokens than adapters, T (one token each, Setup)."""
    return min(step.T, step.adapters)


def floors_pct(model: ModelShape, step: Step) -> Tuple[float, float]:
    """The overhead floors of a step, in % of the base weights' bytes: (the adapters present, A and B: what any
    route must read; the fold route's: every pool slot's A, which its GEMM reads where it does not skip unused
    slots, and the present adapters' B)."""
    base, a, b = _layer_elements(model, step.rank)
    present = _present(step)
    return 100.0 * present * (a + b) / base, 100.0 * (POOL_SLOTS * a + present * b) / base


def adapter_bytes(model: ModelShape, step: Step) -> int:
    """The bytes of the adapters present, A and B in bf16, over every layer."""
    _, a, b = _layer_elements(model, step.rank)
    return 2 * model.layers * _present(step) * (a + b)


def floor_copy_us(model: ModelShape, step: Step, copy_tbps: Optional[float]) -> Optional[float]:
    """µs to read the adapters present at the copy bandwidth (TB/s), the copy floor (module docstring); None
    without the bandwidth."""
    return adapter_bytes(model, step) / (copy_tbps * 1e6) if copy_tbps else None


def b_as_columns(lora_b: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """lora_b [L, N, R] copied as B of every slot side by side in columns, b_cols [N, L·R], and its [L, N, R] view:
    the layout lora_linear's GEMM reads, as the adapter pool keeps it for the kext route."""
    L, N, R = lora_b.shape
    b_cols = lora_b.permute(1, 0, 2).reshape(N, L * R)
    return b_cols, b_cols.view(N, L, R).permute(1, 0, 2)


class Module:
    """One linear layer with its LoRA pool in the serving pool's layout (ModuleSlots), so that every route is timed
    on the layout serving uses: w_cat = [W; A of every slot] (W and the pool's lora_a are views of it), lora_b
    [L, N, R], and its copy b_cols = [B of every slot] as columns, [N, L·R] (kext_lora_b [L, N, R] a view of it)."""

    def __init__(self, K: int, widths: Sequence[int], rank: int, device, gen_seed: int):
        self.K, self.N, self.S, self.R = K, sum(widths), len(widths), rank
        self.offsets = [0]
        for w in widths:
            self.offsets.append(self.offsets[-1] + w)
        g = torch.Generator(device=device).manual_seed(gen_seed)
        rows = self.N + POOL_SLOTS * self.S * rank
        self.w_cat = (torch.randn(rows, K, generator=g, device=device) / K ** 0.5).to(torch.bfloat16)
        self.w = self.w_cat[:self.N]
        self.lora_a = self.w_cat[self.N:].view(POOL_SLOTS, self.S * rank, K)
        self.lora_b = (torch.randn(POOL_SLOTS, self.N, rank, generator=g, device=device) / rank ** 0.5).to(
            torch.bfloat16)
        self.b_cols, self.kext_lora_b = b_as_columns(self.lora_b)
        self.slice_offsets = self.offsets if self.S > 1 else None
        # On CUDA, where lora_linear's kernels do not serve the module, the kext route runs the fold route for it
        # (off CUDA, in the CPU tests, the op itself: its composition)
        self.kext_fallback = self.w.is_cuda and not torch.ops.lora_ops._lora_linear_kernels_serve(
            self.w, self.lora_a, self.kext_lora_b, self.slice_offsets)


class Setup:
    """The model's layers for one step shape, the step's activations and routing, and the output buffers."""

    def __init__(self, model: ModelShape, step: Step, device, seed: int = 0, between: bool = False):
        self.model, self.step, self.between = model, step, between
        gen = torch.Generator().manual_seed(seed)
        slots = torch.randperm(POOL_SLOTS, generator=gen)[:step.adapters].tolist()
        sizes = testing.drawn_sizes(step.T, step.adapters, gen) if step.spread == "drawn" else None
        self.token_lora = testing.random_token_slots(step.T, slots, gen, sizes).to(device)
        # Every slot holds an adapter of the pool's rank on every module: the serving layer passes no ranks then
        self.ranks = None
        self.scales = (torch.rand(POOL_SLOTS, generator=gen) * 2 + 0.5).to(device)
        shapes = model.modules()
        self.layers = [[Module(K, widths, step.rank, device, seed * 100003 + i * 7 + j)
                        for j, (_, K, widths) in enumerate(shapes)] for i in range(model.layers)]
        self.x = {name: torch.randn(step.T, K, generator=gen).to(torch.bfloat16).to(device)
                  for name, K, _ in shapes}
        first = self.layers[0]
        self.y = {name: torch.empty(step.T, m.N, dtype=torch.bfloat16, device=device)
                  for (name, _, _), m in zip(shapes, first)}
        self.out = {name: torch.empty(step.T, m.w_cat.shape[0], dtype=torch.bfloat16, device=device)
                    for (name, _, _), m in zip(shapes, first)}  # the fold GEMM parts' outputs
        # The y of each route whose op returns it (fold_linear's base columns, lora_linear's), as its last call left
        # it: in its captured graph's memory, which its replays rewrite
        self.route_y: Dict[str, Dict[str, torch.Tensor]] = {}
        self.names = [name for name, _, _ in shapes]
        self.seg: Optional[lora_ops.Segments] = None

    def build_segments(self):
        """The step's routing, once per step as the serving layer builds it (LoRABatch.set)."""
        self.seg = lora_ops.build_segments(self.token_lora, POOL_SLOTS)
        self.sorted_slots = route_table.sorted_slots(self.token_lora, self.seg.token_indices)

    def expand_rows(self, backend: str) -> tuple:
        """The rows lora_expand reads on `backend`, as the serving layer passes them (routes.fold_expand_rows)."""
        return route_table.fold_expand_rows(backend, self.sorted_slots,
                                            (self.seg.seg_indptr, self.seg.seg_lora, self.seg.token_indices))

    def write_input(self, n: str) -> None:
        """--between-modules: module n's input written by a kernel of its own just before the module."""
        if self.between:
            self.x[n].mul_(1.0)

    # ---- the routes: each returns the calls of one step, and the first layer's outputs ----
    def module_calls(self, one: Callable[[Module, str], None], module: Optional[str]) -> List[Callable[[], None]]:
        """one(m, n) for every layer's modules, or for module `module`'s layers only."""
        return [lambda m=m, n=n: one(m, n) for layer in self.layers for n, m in zip(self.names, layer)
                if module in (None, n)]

    def base_calls(self, module: Optional[str] = None) -> List[Callable[[], None]]:
        def one(m, n):
            self.write_input(n)
            torch.mm(self.x[n], m.w.t(), out=self.y[n])
        return self.module_calls(one, module)

    def sgmv_one(self, sgmv, m: Module, n: str) -> None:
        """Module m's sgmv route: the base GEMM, then the sgmv op."""
        self.write_input(n)
        torch.mm(self.x[n], m.w.t(), out=self.y[n])
        sgmv(self.y[n], self.x[n], m.lora_a, m.lora_b, self.seg.seg_indptr, self.seg.seg_lora,
             self.seg.token_indices, self.ranks, self.scales, m.slice_offsets, 1.0)

    def sgmv_calls(self, sgmv) -> List[Callable[[], None]]:
        return [self.build_segments] + self.module_calls(lambda m, n: self.sgmv_one(sgmv, m, n), None)

    def fold_one(self, route: str, expand, backend: str, m: Module, n: str) -> None:
        """Module m's fold route: one GEMM against [W; A], then the expand (lora_expand on `backend`)."""
        self.write_input(n)
        out = lora_ops.ops.fold_linear(self.x[n], m.w_cat, None, self.seg.seg_indptr, m.S * m.R)
        y = self.route_y.setdefault(route, {})[n] = out[:, :m.N]
        expand(y, out[:, m.N:].view(self.step.T, POOL_SLOTS, m.S * m.R), m.lora_b, *self.expand_rows(backend),
               self.ranks, self.scales, m.slice_offsets, 1.0)

    def fold_calls(self, route: str, expand, module: Optional[str] = None) -> List[Callable[[], None]]:
        """Route `route` ("fold-<backend>"): expand is lora_expand on that backend."""
        backend = route.split("-", 1)[1]
        return [self.build_segments] + self.module_calls(lambda m, n: self.fold_one(route, expand, backend, m, n),
                                                         module)

    def kext_calls(self, route: str, lora_linear, module: Optional[str] = None) -> List[Callable[[], None]]:
        # the modules the kernels do not serve take the routes table's fallback for this step, as in serving
        kind, backend = serving_default(self.model, self.step, kext_serves=False).split("-")
        fallback = route_table.op("lora_expand" if kind == "fold" else "sgmv", backend)

        def one(m, n):
            if m.kext_fallback and kind == "fold":
                return self.fold_one(route, fallback, backend, m, n)
            if m.kext_fallback:
                self.route_y.setdefault(route, {})[n] = self.y[n]
                return self.sgmv_one(fallback, m, n)
            self.write_input(n)
            self.route_y.setdefault(route, {})[n] = lora_linear(self.x[n], m.w, m.lora_a, m.kext_lora_b,
                                                                self.token_lora, self.scales, m.slice_offsets)
        return [self.build_segments] + self.module_calls(one, module)

    def vllm_calls(self, ops) -> List[Callable[[], None]]:
        """The vllm peer's step: vLLM's metadata and its layout of every module's pool, made here, before the
        capture, and kept by the Setup (a captured graph holds their addresses, not them); then per module the base
        GEMM and vLLM's add_lora_linear."""
        self.vllm_batch = peers.VllmBatch(ops, self.token_lora, POOL_SLOTS)
        self.vllm_layouts = {id(m): peers.VllmLayout(m.lora_a, m.lora_b, self.ranks, self.scales, 1.0, m.offsets)
                             for layer in self.layers for m in layer}

        def one(m, n):
            self.write_input(n)
            torch.mm(self.x[n], m.w.t(), out=self.y[n])
            peers.add_lora_linear(ops, self.y[n], self.x[n], self.vllm_layouts[id(m)], self.vllm_batch)
        return self.module_calls(one, None)

    # ---- parts of the routes alone, to place the time (not routes: their outputs are not checked) ----
    def fold_gemm_calls(self, module: Optional[str] = None) -> List[Callable[[], None]]:
        return self.module_calls(lambda m, n: torch.mm(self.x[n], m.w_cat.t(), out=self.out[n]), module)

    def fold_linear_calls(self, module: Optional[str] = None) -> List[Callable[[], None]]:
        """fold_linear as the fold routes call it, with the step's segments (built before: not timed here), so
        skipping the slots no row uses. The calls hold that seg_indptr: other parts rebuild self.seg as they are
        captured, and a graph keeps only its address."""
        seg_indptr = self.seg.seg_indptr
        return self.module_calls(lambda m, n: lora_ops.ops.fold_linear(self.x[n], m.w_cat, None, seg_indptr, m.S * m.R),
                                 module)

    def expand_only_calls(self, expand, backend: str, module: Optional[str] = None) -> List[Callable[[], None]]:
        def one(m, n):
            out = self.out[n]
            expand(out[:, :m.N], out[:, m.N:].view(self.step.T, POOL_SLOTS, m.S * m.R), m.lora_b,
                   *self.expand_rows(backend), self.ranks, self.scales, m.slice_offsets, 1.0)
        return [self.build_segments] + self.module_calls(one, module)

    def sgmv_only_calls(self, sgmv) -> List[Callable[[], None]]:
        def one(m, n):
            sgmv(self.y[n], self.x[n], m.lora_a, m.lora_b, self.seg.seg_indptr, self.seg.seg_lora,
                 self.seg.token_indices, self.ranks, self.scales, m.slice_offsets, 1.0)
        return [self.build_segments] + self.module_calls(one, None)

    def outputs(self, route: str) -> Dict[str, torch.Tensor]:
        """The outputs of the layer that ran last, as the route leaves them (every layer writes the same buffers):
        the first layer's after build_segments and its calls ran alone, the last layer's after a whole step."""
        return self.route_y.get(route, self.y)

    def reference(self, layer: int) -> Dict[str, Tuple[torch.Tensor, torch.Tensor]]:
        """float64 (base output, base + LoRA) of one layer, on the device."""
        seg = reference.build_segments(self.token_lora.cpu(), POOL_SLOTS)
        out = {}
        for n, m in zip(self.names, self.layers[layer]):
            x = self.x[n].double()
            base = x @ m.w.double().t()
            full = reference.sgmv(base, x, m.lora_a, m.lora_b, *[t.to(x.device) for t in seg[1:]],
                                  seg[0].to(x.device), self.ranks, self.scales, m.slice_offsets, 1.0)
            out[n] = (base, full)
        return out


def routes() -> Dict[str, Tuple[str, Callable]]:
    """route name -> (kind, op) for every available backend, and on CUDA the peers that are built (kind "peer")."""
    out = {}
    if backends.cuda_served_by.get("sgmv") == "cuda":
        out["sgmv-cuda"] = ("sgmv", torch.ops.lora_ops.sgmv.default)
    if backends.cuda_served_by.get("lora_expand") == "cuda":
        out["fold-cuda"] = ("fold", torch.ops.lora_ops.lora_expand.default)
    out["kext-cuda"] = ("kext", lora_ops.ops.lora_linear)  # every build: where its kernels do not apply, ATen ops
    if "triton" not in backends.unavailable:
        import lora_ops.triton as lt
        out["sgmv-triton"] = ("sgmv", lt.sgmv)
        out["fold-triton"] = ("fold", lt.lora_expand)
    vllm_ops = peers.vllm_ops()[0] if torch.cuda.is_available() else None
    if vllm_ops is not None:
        out["vllm"] = ("peer", vllm_ops)
    return out


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b).norm() / b.norm()).item()


def serving_default(model: ModelShape, step: Step, kext_serves: bool = True) -> str:
    """The route the serving layer takes for this step on this shape, by the committed routes table (on the modules
    lora_linear's kernels serve, or do not: kext_serves)."""
    table = route_table.table_for(model.kn())
    return "-".join(route_table.pick(step.T, "cuda", step.rank, kext_serves, table))


def bench_step(model: ModelShape, step: Step, device, records: List[dict], failures: List[str], log,
               only: Optional[Sequence[str]] = None, parts: bool = False, between: bool = False,
               copy_tbps: Optional[float] = None) -> None:
    """copy_tbps: the copy bandwidth measured in the run (TB/s), for the copy floor; None: not recorded."""
    s = Setup(model, step, device, between=between)
    # The first layer's outputs are checked after it ran eagerly, the last layer's after a replay of the timed graph
    # (each replay is a whole step: every layer's base GEMM overwrites the buffers its LoRA then adds to). The base
    # and the routes are timed in turn, round after round (time_interleaved), so that the overheads compare times
    # taken side by side.
    ref, ref_last = s.reference(0), s.reference(-1)
    floor, fold_floor = floors_pct(model, step)
    copy_floor = floor_copy_us(model, step, copy_tbps)
    # between_modules and spread in every record: the report never puts a step timed with input writers beside one
    # without, nor drawn adapter sizes beside even ones
    row = dict(op="decode_step", model=model.name, T=step.T, adapters=step.adapters, rank=step.rank,
               spread=step.spread, between_modules=between, floor_pct=round(floor, 2),
               fold_floor_pct=round(fold_floor, 2), floor_copy_us=None if copy_floor is None else round(copy_floor, 1))
    writer = ", an input writer before each module" if between else ""
    log(f"{model.name} {step.label()}: floor +{floor:.1f}%, "
        f"the fold route's +{fold_floor:.1f}% (every slot's A){writer}")
    def fail(name: str, what: str, message: str) -> None:
        """A route that raised or was wrong: logged, and a failure of the run unless it is a peer (measured, not
        trusted)."""
        if name not in peers.PEERS:
            failures.append(f"decode_step {name} {row}: {message}")
        log(f"  {name:<12} {what}")

    base_calls = s.base_calls()
    graphs = {"base": capture(base_calls)}
    checked, calls = {}, []
    for name, (kind, op) in routes().items():
        if (only and name not in only) or (kind == "kext" and step.T > route_table.KEXT_MAX_TOKENS):
            continue
        try:
            calls = s.sgmv_calls(op) if kind == "sgmv" else s.fold_calls(name, op) if kind == "fold" else \
                s.vllm_calls(op) if kind == "peer" else s.kext_calls(name, op)
            if kind == "peer":  # the whole step once: vLLM fills its pointer tables on first use (not capturable)
                for f in calls:
                    f()
            preamble = 0 if kind == "peer" else 1  # build_segments
            for f in calls[:preamble + len(s.names)]:  # the first layer, eagerly: the checked outputs
                f()
            outs = s.outputs(name)
            first_err = max(_rel(outs[n], ref[n][1]) for n in s.names)
            graphs[name] = capture(calls)
            checked[name] = first_err
        except Exception as exc:
            fail(name, f"FAILED: {type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:100]}",
                 f"raised {type(exc).__name__}: {exc}")
    ms = time_interleaved({name: g.replay for name, g in graphs.items()}, min_ms=100)

    def last_layer_err(name: str, which: int) -> float:  # its graph replayed last: the step's final outputs
        graphs[name].replay()
        if torch.device(device).type == "cuda":
            torch.cuda.synchronize()
        return max(_rel(s.outputs(name)[n], ref_last[n][which]) for n in s.names)

    base_ms = ms["base"]
    row["floor_copy_pct"] = None if copy_floor is None else round(100 * copy_floor / (base_ms * 1e3), 2)
    default = serving_default(model, step)
    recorded: List[str] = []  # the routes whose time is recorded (right on both checks)
    base_err = last_layer_err("base", 0)
    for f in base_calls[:len(s.names)]:
        f()
    base_err = max(base_err, *(_rel(s.y[n], ref[n][0]) for n in s.names))
    records.append(dict(row, backend="base", base_us=round(base_ms * 1e3, 1), us=round(base_ms * 1e3, 1),
                        overhead_pct=0.0, err=base_err))
    log(f"  {'base':<12} {base_ms * 1e3:9.1f} us                   err {base_err:.1e}"
        + ("" if copy_floor is None else f"  (copy floor {copy_floor:.1f} us, +{row['floor_copy_pct']:.1f}%)"))
    for name, first_err in checked.items():
        try:
            err = max(first_err, last_layer_err(name, 1))
        except Exception as exc:
            fail(name, f"FAILED on replay: {type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:100]}",
                 f"its graph's replay raised {type(exc).__name__}: {exc}")
            continue
        if not err <= 2 * max(base_err, 1e-3):
            fail(name, f"WRONG: relative error {err:.2e} vs the float64 oracle; not recorded",
                 f"relative error {err:.2e} vs the float64 oracle")
            continue
        overhead = 100.0 * (ms[name] - base_ms) / base_ms
        recorded.append(name)
        extra = {}
        if name == "vllm":  # its per-step metadata, outside the graph (vLLM's prepare_tensors, every step)
            extra["meta_us"] = round(s.vllm_batch.prepare_us(s.token_lora), 1)
        records.append(dict(row, backend=name, base_us=round(base_ms * 1e3, 1), us=round(ms[name] * 1e3, 1),
                            overhead_pct=round(overhead, 2), err=err, serving_default=name == default, **extra))
        log(f"  {name:<12} {ms[name] * 1e3:9.1f} us  overhead {overhead:+6.1f}%  err {err:.1e}"
            + ("  (the serving default)" if name == default else "")
            + (f"  (+ {extra['meta_us']:.1f} us of metadata a step, outside the graph)" if extra else ""))
    base_graph = graphs.pop("base")  # the parts are timed beside it
    del graphs, calls, base_calls  # the routes' graphs' pools and the Setup the calls hold: freed before the parts
    if parts:
        bench_parts(s, base_graph.replay, row, records, log, recorded)
    del s, base_graph  # freed before the next step
    peers.release()  # the step's vLLM layouts, which vLLM's pointer caches hold
    torch.cuda.empty_cache()


def bench_parts(s: Setup, base_step: Callable[[], None], row: dict, records: List[dict], log,
                recorded: Sequence[str]) -> None:
    """Each route's parts alone (op "decode_step_part"): the fold GEMMs (cuBLAS's, reading every slot's A, and
    fold_linear's as the routes call it, skipping unused slots), of every module and of each module alone (which
    GEMM shape fold_linear's kernel wins or loses), the expand kernels on
    their output, of every module and of each alone, the sgmv kernels without the base GEMM; and each module's
    layers alone through the base GEMM and through each fold and kext route (which modules, by K and N, a route
    wins or loses: the kext route is one op, so its modules are its parts); µs per step and as % of the base step
    (base_step, a replay of its graph), timed in the same rounds as the part (time_interleaved): the base timed
    before the parts drifts from them as the clocks do."""
    s.build_segments()  # the step's segments, which fold_linear's parts read
    parts = {"fold-gemm": s.fold_gemm_calls(), "fold-gemm-fold_linear": s.fold_linear_calls()}
    for module in s.names:
        parts[f"fold-gemm-{module}"] = s.fold_gemm_calls(module)
        parts[f"fold-gemm-fold_linear-{module}"] = s.fold_linear_calls(module)
        parts[f"base-{module}"] = s.base_calls(module)
    for name, (kind, op) in routes().items():
        if name not in recorded or kind == "peer":  # the lora_ops routes timed and right in this step
            continue
        backend = name.split("-")[1]
        if kind == "sgmv":
            parts[f"sgmv-only-{backend}"] = s.sgmv_only_calls(op)
        elif kind == "fold":  # and each module's expands alone: which slice shapes the expand's time goes to
            parts[f"expand-only-{backend}"] = s.expand_only_calls(op, backend)
            for module in s.names:
                parts[f"expand-only-{backend}-{module}"] = s.expand_only_calls(op, backend, module)
        if kind in ("fold", "kext"):
            for module in s.names:
                parts[f"{name}-{module}"] = (s.fold_calls if kind == "fold" else s.kext_calls)(name, op, module)
    for name, calls in parts.items():
        for f in calls:  # eagerly once: the expand parts read the fold GEMMs' outputs as they are
            f()
        ms = time_interleaved({"base": base_step, name: capture(calls).replay}, min_ms=50)
        records.append(dict(row, op="decode_step_part", backend=name, base_us=round(ms["base"] * 1e3, 1),
                            us=round(ms[name] * 1e3, 1), pct_of_base=round(100 * ms[name] / ms["base"], 2)))
        log(f"  part {name:<30} {ms[name] * 1e3:9.1f} us = {100 * ms[name] / ms['base']:5.1f}% of base")


def run(models: Sequence[str], device, records, failures, log, only=None, steps: Sequence[Step] = STEPS,
        parts: bool = False, between: bool = False, copy_tbps: Optional[float] = None):
    for name in models:
        for step in steps:
            bench_step(MODELS[name], step, device, records, failures, log, only, parts, between, copy_tbps)


def choose_routes(samples: List[List[Dict[str, float]]]) -> List[Tuple[str, float]]:
    """Each regime's route, from every mix's times ({route: us}, samples[mix][regime]) at its sample (its top end)
    and at the previous regime's (just below its bottom end): the route whose worst slowdown against the fastest
    at those ends, over the mixes, is smallest (routes.least_worst), with that slowdown. The top end alone picked
    defaults 13-82% slower than another route at the regime's other end (H200, 7f9cdc6); one mix alone (32
    adapters) picked the kext route for a 70B shard's T=32, 10% slower than the fold route with one adapter
    (057b51d)."""
    chosen = []
    for i in range(len(samples[0])):
        names = list(samples[0][i])  # the routes that serve the regime: those timed at its sample
        # each end against the fastest of those routes (least_worst): a route that serves only the regime below
        # (kext at 128 tokens, for 129-256) must not set the pace there
        ends = [mix[j] for mix in samples for j in sorted({max(i - 1, 0), i})]
        chosen.append(route_table.least_worst(ends, names))  # one not timed everywhere: inf
    return chosen


def split_points(regimes: List[dict]) -> List[int]:
    """Where a route sweep times a rank class again (routes.SPLIT_ABOVE), the worst regime first: the middle of each
    regime (a table's, with its mixes' times) whose route is more than SPLIT_ABOVE slower than the fastest at one of
    its two ends, where at each end alone a route is within it (else the mixes disagree, and no split helps), and
    whose ends are at least SPLIT_MIN_TOKENS apart."""
    def within(times: List[Dict[str, float]], names: List[str]) -> bool:
        return route_table.least_worst(times, names)[1] <= route_table.SPLIT_ABOVE

    points = []
    for below, regime in zip(regimes, regimes[1:]):
        lo, hi = below["measured_T"], regime["measured_T"]
        names = [n for n in regime["us"][0] if n != "base"]  # those that serve the regime (choose_routes)
        if (regime["slowdown"] > route_table.SPLIT_ABOVE and hi - lo >= route_table.SPLIT_MIN_TOKENS
                and within(below["us"], names) and within(regime["us"], names)):
            points.append((-regime["slowdown"], (lo + hi) // 2))
    return [T for _, T in sorted(points)]


Timed = Dict[Tuple[str, int, int, int], Dict[str, float]]  # (model, T, adapters, rank): {"base" or route: us}


def timed_steps(records: List[dict]) -> Timed:
    """The decode-step records a routes table is made of: the base and lora_ops' routes (a peer's time, the vllm
    route, is no route of a table), the last record of each counting, none of a --between-modules run (the sweep's
    step is the linear layers alone) or of drawn adapter sizes (its steps' are even; records from before the spread
    was recorded are)."""
    timed: Timed = {}
    for r in records:
        if r.get("op") == "decode_step" and not r.get("between_modules") and r.get("spread", "even") == "even" and (
                r["backend"] == "base" or r["backend"] in route_table.NAMES):
            timed.setdefault((r["model"], r["T"], r["adapters"], r["rank"]), {})[r["backend"]] = r["us"]
    return timed


def regimes_at(timed: Timed, model: str, mixes: Sequence[Tuple[int, int]], sample_T: List[int]) -> List[dict]:
    """A rank class's regimes, each up to one of `sample_T` (the last: every larger T), measured there: its route
    (choose_routes), every mix's times and the route's worst slowdown. Raises ValueError unless every route was
    timed at every sample for every mix."""
    timings = [[timed.get((model, T, adapters, rank), {}) for T in sample_T] for rank, adapters in mixes]
    samples = [[{k: v for k, v in t.items() if k != "base"} for t in mix] for mix in timings]
    for (rank, adapters), mix in zip(mixes, samples):
        missing = [T for T, sample in zip(sample_T, mix) if set(sample) != set(route_table.timed_names(T))]
        if missing:
            raise ValueError(f"{model}: not every route ({', '.join(route_table.NAMES)}; kext up to "
                             f"{route_table.KEXT_MAX_TOKENS} tokens) timed at rank {rank}, {adapters} adapters, "
                             f"T = {missing}")
    regimes = []
    for i, (bound, T, (choice, worst)) in enumerate(zip([*sample_T[:-1], None], sample_T, choose_routes(samples))):
        route, backend = choice.split("-")
        regimes.append(dict(max_tokens=bound, route=route, backend=backend, measured_T=T, slowdown=round(worst, 3),
                            us=[mix[i] for mix in timings]))
    return regimes


def class_regimes(timed: Timed, model: str, mixes: Sequence[Tuple[int, int]]) -> Tuple[List[dict], Optional[int]]:
    """A rank class's regimes as the route sweep makes them: at routes.REGIME_SAMPLES, then split at split_points'
    first (the worst regime's middle), one split at a time, up to SPLIT_MAX_SAMPLES; and the split the sweep times
    next (None: none is due). A split without the base and every route timed for every mix ends the splits there,
    and a T that no split asked for is not a sample, so that the sweep and bench.report --routes make the same
    table from the same records (other steps of the run, a second sweep merged, do not move its bounds)."""
    def complete(T: int) -> bool:
        return all(set(timed.get((model, T, adapters, rank), {})) == {"base", *route_table.timed_names(T)}
                   for rank, adapters in mixes)

    sample_T = list(route_table.REGIME_SAMPLES)
    while True:
        regimes = regimes_at(timed, model, mixes, sample_T)
        points = split_points(regimes)
        if not points or len(sample_T) - len(route_table.REGIME_SAMPLES) >= route_table.SPLIT_MAX_SAMPLES:
            return regimes, None
        if not complete(points[0]):
            return regimes, points[0]
        sample_T = sorted(sample_T + [points[0]])


def routes_table(records: List[dict], meta: dict, models: Sequence[str]) -> dict:
    """The serving layer's routes table (lora_ops/route_tables/<gpu>.json) from a route sweep's decode-step records
    (timed_steps): a table per model shape (with its modules' (K, N), which a pool is matched to), of rank classes,
    each measured at its mixes (rank, adapter count): each class's regimes (class_regimes). Raises ValueError unless
    every route and backend was timed at every step of routes.REGIME_SAMPLES (a run of some routes, --impls, makes
    no table)."""
    timed = timed_steps(records)
    tables = []
    for model in models:
        classes = [dict(max_rank=max_rank, mixes=[dict(rank=r, adapters=a) for r, a in mixes],
                        regimes=class_regimes(timed, model, mixes)[0])
                   for max_rank, mixes in zip(route_table.RANK_BOUNDS, route_table.CLASS_MIXES)]
        modules = [list(kn) for kn in MODELS[model].kn()]
        tables.append(dict(model=model, modules=modules, ranks=classes))
    table = dict(meta, models=tables)
    route_table.validate(table)
    return table


def write_routes(path: str, device, records, failures, log, meta: dict, models: Sequence[str]) -> None:
    """Times every route at each regime's sample T, for each rank class at its mixes, on each of `models`' shapes,
    then at the splits class_regimes asks for (one a class at a time, its regimes worked out again after each),
    and writes the table of each model's classes' routes by
    regime (routes_table) to `path`. A run in which any route failed or gave a wrong result writes none."""
    import json

    failures_before = len(failures)
    first = len(records)

    def sweep(model: str, mixes, T: int) -> None:
        for rank, adapters in mixes:
            bench_step(MODELS[model], Step(T, adapters, rank), device, records, failures, log,
                       only=route_table.NAMES)  # lora_ops' routes: a table chooses among them

    for model in models:
        for mixes in route_table.CLASS_MIXES:
            for T in route_table.REGIME_SAMPLES:
                sweep(model, mixes, T)
        tried = set()  # a split timed without every route (no failure said) is not asked for again
        while len(failures) == failures_before:
            try:
                due = [(mixes, class_regimes(timed_steps(records[first:]), model, mixes)[1])
                       for mixes in route_table.CLASS_MIXES]
            except ValueError:
                break  # said below, where the whole table is made
            due = [(mixes, T) for mixes, T in due if T is not None and (mixes, T) not in tried]
            if not due:
                break
            for mixes, T in due:
                tried.add((mixes, T))
                log(f"routes: {model}: a regime split at T={T} (mixes {mixes})")
                sweep(model, mixes, T)
    try:
        table = routes_table(records[first:], meta, models)
    except ValueError as exc:
        failures.append(f"routes: {path} not written: {exc}")
        return
    if len(failures) > failures_before:
        failures.append(f"routes: {path} not written: a route failed")
        return
    with open(path, "w") as f:
        json.dump(table, f, indent=1)
    log(f"wrote {path}:")
    for line in route_table.describe(table):
        log(f"  {line}")
