#!/usr/bin/env python3
"""Mutation check of the test suite: plant one known bug at a time in a scratch copy of the repository, run the
tests, and report whether they caught it. On demand, not in CI (a full run takes tens of minutes on 2 cores).

    python scripts/mutate.py                  # every CPU mutation; the whole pytest suite per mutation
    python scripts/mutate.py --fast           # each mutation runs only the test files listed with it
    python scripts/mutate.py --only ID ...    # chosen mutations (ids from --list)
    python scripts/mutate.py --gpu            # the GPU-only mutations (on the GPU box, after its CUDA build)
    python scripts/mutate.py --check          # only check that every snippet still applies; runs nothing
    python scripts/mutate.py --list           # the documented list of planted bugs
    python scripts/mutate.py --restore        # only undo a killed --in-place run (scripts/gpu_run.sh, before its build)
    options: --log FILE (also write the report there), --scratch DIR (reuse a scratch copy and its C++ objects
             across runs), --in-place (no copy: plant the bugs in this checkout and rebuild with its own build
             directory, so a C++ mutation recompiles one file instead of the whole extension; for a throwaway tree
             such as the GPU machine's), --skip-stale (run the mutations that apply, report the others as stale),
             --workers N (pytest-xdist processes per run; a GPU box has the cores)

A mutation is (id, file, exact original snippet, replacement, description, needs_gpu, its test files).

The scratch copy holds the working tree's files (tracked, or untracked but not ignored) and this checkout's
built lora_ops/_C*.so, _ascend_model*.so and _build_info.json (build first: see README). The unmutated copy must
pass first (with --fast: the test files of the mutations that will run). Then, per mutation: replace the snippet (it must occur exactly once in its file, else the list is
stale: the script stops with exit status 2 and says where else the snippet occurs), rebuild the extension in the
copy when the file is C++ (CPU only, LORA_OPS_NO_CUDA=1; with --gpu the CUDA kernels too), run the tests, restore
the file. With --in-place the same happens in this checkout: the original of a mutated file waits in
<file>.mutate-orig until it is restored, and a run that was killed is undone by the next one, which restores any
such file (dated now, so that a build recompiles it) and rebuilds before it starts; a run that ends rebuilds the
checkout once after its last C++ bug, so that no object of a planted bug stays in the build directory.

The tests run as the pytest part of the README's test command (scripts/test.sh: `python -m pytest tests -q`),
with -x (stop at the first failure: a caught bug costs seconds, the verdict is the same) and -p no:cacheprovider,
the test files named one by one with the mutation's own first, so that a caught bug fails early: every
tests/**/test_*.py file runs, as under `pytest tests` (with --gpu, its GPU tests only, `-m gpu`, as the GPU job's
suite: the planted bugs there are in code only a GPU runs). ctest is not run: a bug only the C++ unit tests catch
reports as survived. A non-zero pytest exit status is "caught" (1: a test failed; 2 with --workers: pytest-xdist
ends a -x session as interrupted after its first failure; negative: the process crashed, e.g. on an out-of-bounds
access); zero is "survived". All pytest runs of one invocation share one
LORA_OPS_TEST_SEED (printed; taken from the environment when set).

Refreshing the list after a refactor: run --check. For a stale mutation it names the files where its snippet
now occurs (a moved function: update `file`); otherwise copy the exact text of the new code with the same logic
into `original` and adapt `replacement`.
Exit status: 0 all caught, 1 some survived (or a mutation did not compile), 2 stale list or failing baseline.
"""
from __future__ import annotations

import argparse
import dataclasses
import glob
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import List, Optional, Sequence

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CPP_SUFFIXES = (".cpp", ".h", ".cu", ".cuh")
# Where --check looks for a snippet that moved: source files only (benchmarks/results holds PNGs and JSON), not
# this script, whose own list holds every snippet.
SOURCE_SUFFIXES = (".py",) + CPP_SUFFIXES
SELF = os.path.relpath(os.path.abspath(__file__), ROOT)
# Untracked build outputs copied into the scratch (and restored after a C++ mutation rebuilt them).
BUILT = ["lora_ops/_C*.so", "lora_ops/_C*.pyd", "lora_ops/_ascend_model*.so", "lora_ops/_build_info.json"]


@dataclasses.dataclass(frozen=True)
class Mutation:
    id: str
    file: str
    original: str
    replacement: str
    description: str
    needs_gpu: bool = False
    tests: Sequence[str] = ()  # test files that should catch it (--fast); the full suite runs by default


SGMV_T = ("tests/test_sgmv.py",)
GG_T = ("tests/test_grouped_gemm.py",)
ERR_T = ("tests/test_errors.py", "tests/test_errors_devices.py")
TILING_T = ("tests/test_triton_tiling.py", "tests/test_sgmv.py", "tests/test_grouped_gemm.py")
EXPAND_T = ("tests/test_lora_expand.py",)
SERVING_T = ("tests/test_serving.py", "tests/test_serving_peft.py", "tests/test_routes.py")

# The first block: the 20 bugs the suite missed at ce06dbc (issue 11), and close relatives. The second: bugs the
# suite already caught then, kept so that a weakened test shows up. The third: the same classes of bug in code
# written since (the lora_expand op, the serving layer's fold route and route table).
MUTATIONS: List[Mutation] = [
    # ---- strides ----
    Mutation("cpu-sgmv-x-contiguous", "csrc/cpu/sgmv.cpp",
             "load_floats(p.x_dtype, p.x, blk.rows[i] * p.x_row_stride, K, &xf[i * K]);",
             "load_floats(p.x_dtype, p.x, blk.rows[i] * K, K, &xf[i * K]);",
             "CPU sgmv assumes x rows are contiguous (row stride K)", tests=SGMV_T),
    Mutation("cpu-sgmv-a-slot-stride", "csrc/cpu/sgmv.cpp",
             "blk.slot * p.a_stride0 + (s * R + j) * p.a_stride1",
             "blk.slot * S * R * K + (s * R + j) * p.a_stride1",
             "CPU sgmv assumes a contiguous lora_a pool (slot stride S*R*K)", tests=SGMV_T),
    Mutation("cpu-sgmv-b-slot-stride", "csrc/cpu/sgmv.cpp",
             "blk.slot * p.b_stride0 + n * p.b_stride1",
             "blk.slot * p.n * R + n * p.b_stride1",
             "CPU sgmv assumes a contiguous lora_b pool (slot stride N*R)", tests=SGMV_T),
    Mutation("cpu-gg-x-contiguous", "csrc/cpu/grouped_gemm.cpp",
             "load_floats(p.x_dtype, p.x, blk.rows[i] * p.x_row_stride, k_l, &xf[i * k_l]);",
             "load_floats(p.x_dtype, p.x, blk.rows[i] * p.k, k_l, &xf[i * k_l]);",
             "CPU grouped_gemm assumes x rows are contiguous (row stride K)", tests=GG_T),
    Mutation("triton-sgmv-x-contiguous", "lora_ops/triton/kernels.py",
             "rows[:, None] * x_stride + kk[None, :], mask=rmask[:, None] & kmask[None, :], other=0.0)\n"
             "        at = tl.load(",
             "rows[:, None] * K + kk[None, :], mask=rmask[:, None] & kmask[None, :], other=0.0)\n"
             "        at = tl.load(",
             "Triton sgmv assumes x rows are contiguous (row stride K)", tests=SGMV_T),
    Mutation("triton-gg-x-contiguous", "lora_ops/triton/kernels.py",
             "rows[:, None] * x_stride + kk[None, :], mask=rmask[:, None] & kmask[None, :], other=0.0)\n"
             "        wt = tl.load(",
             "rows[:, None] * K + kk[None, :], mask=rmask[:, None] & kmask[None, :], other=0.0)\n"
             "        wt = tl.load(",
             "Triton grouped_gemm assumes x rows are contiguous (row stride K)", tests=GG_T),
    # ---- scale ----
    Mutation("cpu-scale-without-scales-only", "csrc/cpu/sgmv.cpp",
             "const float coef = p.scale * (p.lora_scales ? p.lora_scales[blk.slot] : 1.f);",
             "const float coef = p.lora_scales ? p.lora_scales[blk.slot] : p.scale;",
             "CPU sgmv applies the scalar scale only when lora_scales is None", tests=SGMV_T),
    Mutation("triton-scale-without-scales-only", "lora_ops/triton/kernels.py",
             "        coef = coef * tl.load(scales_ptr + slot.to(tl.int64) * scales_stride, mask=has_tile, other=1.0)",
             "        coef = tl.load(scales_ptr + slot.to(tl.int64) * scales_stride, mask=has_tile, other=1.0)",
             "Triton sgmv (and lora_expand: shared preamble) applies the scalar scale only when lora_scales is None",
             tests=SGMV_T),
    # ---- Triton tiling ----
    Mutation("triton-sgmv-split-ignored", "lora_ops/triton/kernels.py",
             "    n_begin = lo + split * chunk",
             "    n_begin = lo",
             "Triton sgmv and lora_expand (both forms: shared column split) ignore the column-split index (every "
             "split expands the first chunk)", tests=TILING_T + EXPAND_T),
    Mutation("triton-gg-k-accumulation", "lora_ops/triton/kernels.py",
             'acc += tl.dot(xt, wt, input_precision="ieee")',
             'acc = tl.dot(xt, wt, input_precision="ieee")',
             "Triton grouped_gemm keeps only the last K block (no accumulation across K blocks)", tests=TILING_T),
    Mutation("triton-gg-column-block", "lora_ops/triton/__init__.py",
             'grid = (tile_bound(positions, G, cfg["BLOCK_M"]), triton.cdiv(N, cfg["BLOCK_N"]))',
             'grid = (tile_bound(positions, G, cfg["BLOCK_M"]), max(1, N // cfg["BLOCK_N"]))',
             "Triton grouped_gemm launches floor(N / BLOCK_N) column blocks: the last partial one is dropped",
             tests=TILING_T),
    # ---- Triton half precision (fp16/bf16 run only on a GPU) ----
    Mutation("triton-lo-term-dropped", "lora_ops/triton/kernels.py",
             "    return tl.dot(hi, b) + tl.dot(lo, b)",
             "    return tl.dot(hi, b)",
             "Triton's float32 x half product drops the lo term: the intermediate is rounded to half",
             needs_gpu=True, tests=SGMV_T + GG_T),
    # ---- Triton presence ----
    Mutation("triton-import-error", "lora_ops/triton/__init__.py",
             "                      sgmv_kernel)",
             "                      sgmv_kernel, sgmv_shrink_kernel)",
             "lora_ops.triton fails to import (a name that does not exist)", tests=SGMV_T),
    # ---- argument checks ----
    Mutation("check-device-x-a-b", "csrc/common/checks.cpp",
             '  for (auto [name, t] : {std::pair{"x", &x}, {"lora_a", &lora_a}, {"lora_b", &lora_b}}) {\n'
             "    check_device(op, name, *t, y);\n  }\n",
             "",
             "sgmv's device check on x, lora_a and lora_b removed", tests=ERR_T),
    Mutation("check-device-lora-scales", "csrc/common/checks.cpp",
             '    check_device(op, "lora_scales", *lora_scales, y);\n',
             "",
             "sgmv's device check on lora_scales removed", tests=ERR_T),
    Mutation("check-device-gg-x-w", "csrc/common/checks.cpp",
             '  check_device(op, "x", x, y);\n  check_device(op, "w", w, y);\n',
             "",
             "grouped_gemm's device check on x and w removed", tests=ERR_T),
    Mutation("check-k-sizes-length", "csrc/common/checks.cpp",
             'check_index_tensor(op, "k_sizes", *k_sizes, y, L, "one per group: w.size(0)")',
             'check_index_tensor(op, "k_sizes", *k_sizes, y, std::nullopt, "")',
             "grouped_gemm's k_sizes length check removed (a short k_sizes is read past its end)", tests=ERR_T),
    Mutation("check-inference-y-after-write", "csrc/bindings.cpp",
             "  TORCH_CHECK(!(written.defined() && written.is_inference() && !c10::InferenceMode::is_enabled()),\n"
             '              op.schema().name(), ": y is an inference tensor (made under torch.inference_mode()): '
             'update it inside "\n              "inference mode");\n',
             "",
             "an inference-mode y is written before the error (a retry adds the delta twice)", tests=ERR_T),
    Mutation("check-y-version-not-bumped", "csrc/bindings.cpp",
             "  if (written.defined()) torch::autograd::impl::bump_version(written);",
             "",
             "y's version never moves: a backward that saved y before the op wrote it runs with wrong gradients",
             tests=ERR_T),
    Mutation("check-scale-float32-range", "csrc/common/checks.cpp",
             "  if (std::isfinite(value) && !std::isfinite(f)) {",
             "  if (false) {",
             "a scale beyond float32's range becomes inf in every delta", tests=ERR_T),
    Mutation("triton-launch-block-unchecked", "lora_ops/triton/__init__.py",
             "    if block > _MAX_BLOCK:",
             "    if False:",
             "Triton compiles a rank's block past its largest (an error naming nothing)", tests=ERR_T),
    # ---- serving ----
    Mutation("serving-rslora-config-r", "lora_ops/serving/peft_format.py",
             'scale = alpha_m / (math.sqrt(rank) if config.get("use_rslora") else rank)',
             'scale = alpha_m / (math.sqrt(r) if config.get("use_rslora") else rank)',
             "rslora scales by the config's r instead of the module's rank_pattern rank", tests=SERVING_T),
    Mutation("serving-qkv-kv-swapped", "lora_ops/serving/peft_format.py",
             'FUSED_SLICES = {"qkv_proj": ("q_proj", "k_proj", "v_proj"),',
             'FUSED_SLICES = {"qkv_proj": ("q_proj", "v_proj", "k_proj"),',
             "per-slice k_proj/v_proj adapters land in each other's columns of a fused qkv_proj", tests=SERVING_T),
    Mutation("serving-stale-slot", "lora_ops/serving/pool.py",
             "                mod.clear(slot)\n                continue",
             "                mod.ranks[slot] = 0\n                continue",
             "a reused slot keeps the evicted adapter's weights in the modules the new one does not target (wrong "
             "once the ops get no ranks, as a graph captured with a pool of one rank calls them)", tests=SERVING_T),
    Mutation("serving-unsorted-slots", "lora_ops/serving/pool.py",
             "routes.sorted_slots(self.token_slots, self.token_indices, out=self.sorted_slots)",
             "self.sorted_slots.copy_(self.token_slots)",
             "the fold route's rows form pairs build_segments' order of rows with the slots in token order",
             tests=SERVING_T),
    Mutation("serving-unload-keeps-weights", "lora_ops/serving/pool.py",
             "            m.clear(slot)  # a routing set before the unload",
             "            m.ranks[slot] = 0  # a routing set before the unload",
             "an unloaded slot keeps its weights: a routing set before the unload still applies them without ranks",
             tests=SERVING_T),
    Mutation("serving-slice-alpha-ratio", "lora_ops/serving/peft_format.py",
             "B[lo:hi, :sl.rank] = (sl.b.float() * (sl.scale / scale if scale else 0.0)).to(B.dtype)",
             "B[lo:hi, :sl.rank] = sl.b.to(B.dtype)",
             "slices of a fused module with different alphas all get the slot's (largest) scale", tests=SERVING_T),
    # ==== session 41: outputs overlapping inputs, and the serving layer against PEFT ====
    Mutation("check-output-overlap-ignored", "csrc/common/checks.cpp",
             "  if (sa.hi <= sb.lo || sb.hi <= sa.lo) return false;",
             "  return false;",
             "y sharing memory with an input is accepted (a silently wrong, backend-dependent answer)",
             tests=ERR_T),
    Mutation("check-output-overlap-by-storage", "csrc/common/checks.cpp",
             "  if (a.numel() == 0 || b.numel() == 0 || !a.has_storage() || !b.has_storage()) return false;",
             "  if (a.numel() == 0 || b.numel() == 0 || !a.storage().is_alias_of(b.storage())) return false;",
             "the overlap check compares storages, so two storages over one memory (numpy views) pass",
             tests=ERR_T),
    Mutation("pool-nested-batch-clears", "lora_ops/serving/pool.py",
             "            self._route(self._outer_routings.pop())",
             "            self._outer_routings.pop()\n            self._route(None)",
             "a nested pool.batch clears the enclosing block's routing on exit (it then runs the base model)",
             tests=SERVING_T),
    Mutation("pool-routed-slot-reused", "lora_ops/serving/pool.py",
             "            if s not in used and s not in routed:",
             "            if s not in used:",
             "a load reuses the free slot of an unloaded adapter the active routing still names", tests=SERVING_T),
    Mutation("peft-alpha-default-r", "lora_ops/serving/peft_format.py",
             'float(config.get("lora_alpha", PEFT_DEFAULT_ALPHA))',
             'float(config.get("lora_alpha", config["r"]))',
             "a config without lora_alpha scales by r / r instead of PEFT's default 8 / r", tests=SERVING_T),
    Mutation("peft-trained-bias-skipped", "lora_ops/serving/peft_format.py",
             '            if key.endswith(".bias"):\n                raise UnsupportedAdapterError(',
             '            if key.endswith(".bias"):\n                continue\n                raise UnsupportedAdapterError(',
             "an adapter's trained biases (bias='all'/'lora_only' on a model with biases) are dropped, not refused: "
             "served without the biases PEFT puts in the base layers", tests=SERVING_T),
    Mutation("pool-all-linear-takes-the-output-layer", "lora_ops/serving/pool.py",
             "if output is not None and module is output}",
             "if output is not None and module is output and False}",
             "a pool made with target_modules='all-linear' also wraps the output layer (PEFT leaves it out)",
             tests=SERVING_T),
    Mutation("peft-v4-paths-not-renamed", "lora_ops/serving/pool.py",
             "        self._rename_keys = transformers_key_renaming(model)",
             "        self._rename_keys = None",
             "an adapter saved under transformers 4's module paths (Gemma-3's language_model.model.*) is refused, "
             "where PEFT renames and serves it", tests=SERVING_T),
    Mutation("serving-fold-window-one-slice", "lora_ops/serving/layer.py",
             "            slot_rows = len(m.slice_names) * m.lora_b.shape[2]",
             "            slot_rows = m.lora_b.shape[2]",
             "the fold route hands fold_linear one slice's rows as a slot's window on a fused module (on sm_90 the "
             "GEMM would skip the wrong rows of [W; A])", tests=SERVING_T),
    Mutation("serving-guard-skips-the-bias", "lora_ops/serving/layer.py",
             " or self.base.bias is not self._slots.base_params[1]:",
             ":",
             "a replaced base bias is not refused by the layer: the fold route adds the stale bias_cat",
             tests=SERVING_T),
    Mutation("serving-guard-identity-only", "lora_ops/serving/pool.py",
             "        moved = next((m for m in self.modules.values() if m.base_data_moved()), None)",
             "        moved = None",
             "a base weight or bias given other data (param.data = ...) is not refused: the fold route reads the "
             "stale w_cat", tests=SERVING_T),
    Mutation("peft-non-finite-a-unchecked", "lora_ops/serving/peft_format.py",
             "    if not (torch.isfinite(A).all() and torch.isfinite(B).all()):",
             "    if not torch.isfinite(B).all():",
             "a NaN or inf in an adapter's lora_A is loaded (it reaches other adapters' rows on the kext route)",
             tests=SERVING_T),
    Mutation("peft-pattern-key-searched", "lora_ops/serving/peft_format.py",
             '        if re.match(rf"(.*\\.)?({key})$", module_path):',
             "        if re.search(key, module_path):",
             "rank_pattern / alpha_pattern keys match anywhere in the path (PEFT anchors them at a dot and the end)",
             tests=SERVING_T),
    Mutation("testing-padding-not-nan", "lora_ops/testing.py",
             'big = torch.full([s + 2 * pad for s in values.shape], float("nan"), dtype=values.dtype, device=device)',
             "big = torch.full([s + 2 * pad for s in values.shape], 0.0, dtype=values.dtype, device=device)",
             "the parity tests' padded inputs sit in zeros, not NaN: a kernel reading past a view goes unseen",
             tests=("tests/test_testing.py",)),
    Mutation("testing-outside-view-unchecked", "lora_ops/testing.py",
             "    changed = int(((flat.view(bits) != snapshot.view(bits)) & ~inside).sum())",
             "    changed = 0",
             "check_outside_view never reports a write past y's view", tests=("tests/test_testing.py",)),

    # ==== caught at ce06dbc already ====
    Mutation("cpu-sgmv-ignores-ranks", "csrc/cpu/sgmv.cpp",
             "const int64_t rank = slot_size(p.lora_ranks, blk.slot, R);",
             "const int64_t rank = R;",
             "CPU sgmv ignores lora_ranks (reads the pool's max rank)", tests=SGMV_T),
    Mutation("cpu-sgmv-slice-a-rows", "csrc/cpu/sgmv.cpp",
             "(s * R + j) * p.a_stride1",
             "j * p.a_stride1",
             "CPU sgmv uses slice 0's A rows for every slice", tests=SGMV_T),
    Mutation("cpu-sgmv-fp32-y-h-rounded", "csrc/cpu/sgmv.cpp",
             "for (int64_t i = 0; i < blk.count; ++i) h[i * R + j] = dot(&xf[i * K], wf.data(), K);",
             "for (int64_t i = 0; i < blk.count; ++i) {\n"
             "            const float v = dot(&xf[i * K], wf.data(), K);\n"
             "            h[i * R + j] = p.x_dtype == DType::F16    ? static_cast<float>(static_cast<c10::Half>(v))\n"
             "                           : p.x_dtype == DType::BF16 ? static_cast<float>(static_cast<c10::BFloat16>(v))\n"
             "                                                      : v;\n"
             "          }",
             "CPU sgmv rounds the intermediate h to x's half precision (caught only with the tolerance by y's dtype)",
             tests=SGMV_T),
    Mutation("cpu-gg-ignores-accumulate", "csrc/cpu/grouped_gemm.cpp",
             "if (p.accumulate) {",
             "if (true) {",
             "CPU grouped_gemm always accumulates", tests=GG_T),
    Mutation("cpu-gg-ignores-n-sizes", "csrc/cpu/grouped_gemm.cpp",
             "const int64_t n_l = slot_size(p.n_sizes, blk.slot, p.n);",
             "const int64_t n_l = p.n;",
             "CPU grouped_gemm ignores n_sizes", tests=GG_T),
    Mutation("cpu-gg-alpha-dropped", "csrc/cpu/grouped_gemm.cpp",
             "yf[i * n_l + n] += p.alpha * dot(",
             "yf[i * n_l + n] += dot(",
             "CPU grouped_gemm ignores alpha", tests=GG_T),
    Mutation("cpu-rows-last-partial-block", "csrc/cpu/rows.h",
             "    if (cur.count > 0) blocks.push_back(cur);\n",
             "",
             "CPU kernels drop each segment's last partial row block", tests=SGMV_T + GG_T),
    Mutation("cpu-build-segments-covers-no-lora", "csrc/cpu/build_segments.cpp",
             "p.seg_indptr[p.num_slots] = static_cast<int32_t>(next[p.num_slots]);",
             "p.seg_indptr[p.num_slots] = static_cast<int32_t>(total);",
             "CPU build_segments' last segment ends after the no-LoRA tokens", tests=("tests/test_build_segments.py",)),
    Mutation("check-y-overlap", "csrc/common/checks.cpp",
             '  check_output_rows(op, y);\n\n  check_slot_tensors_host(op, y, T, L, R, "x.size(0)", "lora_a.size(0)"',
             '\n  check_slot_tensors_host(op, y, T, L, R, "x.size(0)", "lora_a.size(0)"',
             "sgmv's overlapping-rows check on y removed", tests=ERR_T),
    Mutation("check-seg-length", "csrc/common/checks.cpp",
             'check_index_tensor(op, slot_name, seg_slot, y, seg_indptr->sym_size(0) - 1, '
             '"one per segment: len(seg_indptr) - 1");',
             'check_index_tensor(op, slot_name, seg_slot, y, std::nullopt, "");',
             "the seg_lora/seg_weight length check removed", tests=ERR_T),
    Mutation("check-lora-ranks-length", "csrc/common/checks.cpp",
             'check_index_tensor(op, "lora_ranks", *lora_ranks, y, L, '
             '(std::string("one per slot: ") + l_what).c_str());',
             'check_index_tensor(op, "lora_ranks", *lora_ranks, y, std::nullopt, "");',
             "the lora_ranks length check removed", tests=ERR_T),
    Mutation("check-x-unit-stride", "csrc/common/checks.cpp",
             '  check_unit_last_stride(op, "x", x);\n  check_unit_last_stride(op, "y", y);\n'
             '  check_unit_last_stride(op, "lora_a", lora_a);\n',
             '  check_unit_last_stride(op, "y", y);\n  check_unit_last_stride(op, "lora_a", lora_a);\n',
             "sgmv's unit-column-stride check on x removed", tests=ERR_T),
    Mutation("triton-sgmv-ignores-ranks", "lora_ops/triton/kernels.py",
             "rank = tl.minimum(tl.maximum(tl.load(ranks_ptr + slot, mask=has_tile, other=0), 0), R)",
             "rank = R",
             "Triton sgmv (and lora_expand: shared preamble) ignores lora_ranks", tests=SGMV_T),
    Mutation("triton-gg-always-accumulates", "lora_ops/triton/kernels.py",
             "    if ACCUMULATE:\n        out += tl.load(",
             "    if True:\n        out += tl.load(",
             "Triton grouped_gemm always accumulates", tests=GG_T),
    Mutation("triton-build-segments-covers-no-lora", "lora_ops/triton/kernels.py",
             "tl.store(seg_indptr_ptr + num_slots, base)",
             "tl.store(seg_indptr_ptr + num_slots, T)",
             "Triton build_segments' last segment ends after the no-LoRA tokens",
             tests=("tests/test_build_segments.py",)),
    Mutation("serving-alpha-pattern-ignored", "lora_ops/serving/peft_format.py",
             "alpha_m = float(pattern_value(alpha_pattern, module_path, alpha))",
             "alpha_m = alpha",
             "the adapter's alpha_pattern is ignored", tests=SERVING_T),
    Mutation("serving-rslora-ignored", "lora_ops/serving/peft_format.py",
             'scale = alpha_m / (math.sqrt(rank) if config.get("use_rslora") else rank)',
             "scale = alpha_m / rank",
             "use_rslora is ignored (alpha / r instead of alpha / sqrt(r))", tests=SERVING_T),
    Mutation("serving-lru-evicts-newest", "lora_ops/serving/pool.py",
             "for name, s in self._slot_of.items():  # oldest first",
             "for name, s in reversed(self._slot_of.items()):  # oldest first",
             "the pool evicts the most recently used adapter", tests=SERVING_T),
    Mutation("serving-dora-accepted", "lora_ops/serving/peft_format.py",
             '"use_dora": ("unsupported", ',
             '"use_dora": ("ignored", ',
             "a DoRA adapter is loaded as a plain LoRA", tests=SERVING_T),
    # ==== code written since ce06dbc: the lora_expand op, the fold route, the route table ====
    Mutation("cpu-expand-h-slot-stride", "csrc/cpu/lora_expand.cpp",
             "blk.slot * p.h_slot_stride + s * R",
             "blk.slot * p.num_slices * R + s * R",
             "CPU lora_expand assumes h's slots are contiguous (slot stride S*R; a broadcast h has 0)", tests=EXPAND_T),
    Mutation("cpu-expand-h-row-stride", "csrc/cpu/lora_expand.cpp",
             "blk.rows[i] * p.h_row_stride + blk.slot",
             "blk.rows[i] * p.num_slots * p.num_slices * R + blk.slot",
             "CPU lora_expand assumes h's rows are contiguous (row stride L*S*R; the folded GEMM's is N + L*S*R)",
             tests=EXPAND_T),
    Mutation("cpu-expand-scale-without-scales-only", "csrc/cpu/lora_expand.cpp",
             "const float coef = p.scale * (p.lora_scales ? p.lora_scales[blk.slot] : 1.f);",
             "const float coef = p.lora_scales ? p.lora_scales[blk.slot] : p.scale;",
             "CPU lora_expand applies the scalar scale only when lora_scales is None", tests=EXPAND_T),
    Mutation("cpu-expand-ignores-ranks", "csrc/cpu/lora_expand.cpp",
             "const int64_t rank = slot_size(p.lora_ranks, blk.slot, R);",
             "const int64_t rank = R;",
             "CPU lora_expand ignores lora_ranks (reads the pool's max rank)", tests=EXPAND_T),
    Mutation("triton-expand-rank-mask", "lora_ops/triton/kernels.py",
             "mask=rmask[:, None] & (offs_r < rank)[None, :], other=0.0).to(tl.float32)",
             "mask=rmask[:, None] & (offs_r < R)[None, :], other=0.0).to(tl.float32)",
             "Triton lora_expand loads h past the slot's rank (a NaN or Inf there, never written by a shrink of "
             "that rank, reaches y)", tests=EXPAND_T),
    Mutation("triton-expand-overwrites-y", "lora_ops/triton/kernels.py",
             "tl.store(y_ptrs, (yt + delta).to(y_ptr.dtype.element_ty), mask=ymask)",
             "tl.store(y_ptrs, delta.to(y_ptr.dtype.element_ty), mask=ymask)",
             "Triton's shared expand (sgmv and lora_expand) overwrites y instead of adding to it",
             tests=SGMV_T + EXPAND_T),
    Mutation("cuda-expand-h-slot-stride", "csrc/cuda/lora_expand.cu",
             "const TH* src = h + r.slot * p.h_slot_stride + r.row * p.h_row_stride + j0 + j;",
             "const TH* src = h + r.slot * p.num_slices * p.max_rank + r.row * p.h_row_stride + j0 + j;",
             "CUDA lora_expand (also sgmv's decode expand) assumes h's slots are contiguous (slot stride S*R)",
             needs_gpu=True, tests=EXPAND_T + SGMV_T),
    Mutation("cuda-expand-run-ignores-slot", "csrc/cuda/lora_expand.cu",
             "rows[m - 1].row >= 0 && rows[m].slot == rows[m - 1].slot) same |= 1u << m;",
             "rows[m - 1].row >= 0) same |= 1u << m;",
             "CUDA positions expand: every real row takes its predecessor's B, whatever its slot",
             needs_gpu=True, tests=EXPAND_T + SGMV_T),
    Mutation("cuda-expand-near-rank-lo-only", "csrc/cuda/lora_expand.cu",
             "rank = slot < 32 ? rank_lo : rank_hi;",
             "rank = rank_lo;",
             "CUDA positions expand: slots 32-63 take the rank of slot - 32",
             needs_gpu=True, tests=EXPAND_T),
    Mutation("cuda-expand-far-slots-near", "csrc/cuda/lora_expand.cu",
             "if (slot >= kNearSlots) {",
             "if (slot >= 2 * kNearSlots) {",
             "CUDA positions expand: slots 64-127 take a near slot's rank and scale from the walk's lanes",
             needs_gpu=True, tests=EXPAND_T),
    # ---- lora_expand's rows form (seg_indptr=None) and its CUDA rows kernel ----
    Mutation("rows-form-indptr-not-identity", "csrc/common/params.h",
             "return clamp_index(s.indptr ? s.indptr[i] : i, 0, s.positions);",
             "return clamp_index(s.indptr ? s.indptr[i] : 0, 0, s.positions);",
             "a missing indptr reads as all zeros (the rows form's segments all empty: nothing is added)",
             tests=EXPAND_T),
    Mutation("check-rows-form-length", "csrc/common/checks.cpp",
             "    check_index_tensor(op, slot_name, seg_slot, y, positions,",
             "    check_index_tensor(op, slot_name, seg_slot, y, std::nullopt,",
             "the rows form's check that seg_lora has one slot per position removed (a short one is read past its "
             "end)", tests=EXPAND_T),
    Mutation("triton-expand-rows-rank-mask", "lora_ops/triton/kernels.py",
             "    in_rank = offs_r < rank",
             "    in_rank = offs_r < R",
             "Triton's rows-form kernel reads h and B past the slot's rank (NaN there reaches y)", tests=EXPAND_T),
    Mutation("triton-expand-rows-ignores-token-indices", "lora_ops/triton/kernels.py",
             "        row = tl.load(idx_ptr + p)",
             "        row = p",
             "Triton's rows-form kernel takes position p as row p even with token_indices", tests=EXPAND_T),
    Mutation("cuda-expand-rows-past-rank", "csrc/cuda/lora_expand_rows.cu",
             "if (pass_cols >= kPassCols && j + 16 * kSteps <= rank) {",
             "if (pass_cols >= kPassCols) {",
             "CUDA rows and runs kernels: a partial rank step takes the unchecked loads, reading h and B past the "
             "slot's rank (NaN there reaches y; the pipelined runs kernel's trips too)", needs_gpu=True,
             tests=EXPAND_T),
    Mutation("cuda-expand-keep-bits-off-by-one", "csrc/cuda/lora_expand_rows.cu",
             "  return valid >= 4 ? ~uint64_t{0} : some;",
             "  return valid >= 3 ? ~uint64_t{0} : some;",
             "CUDA tensor-core expand: a checked trip keeps a 4-element read whole where 3 of its ranks are valid, so "
             "the element past a slot's rank reaches the mma", needs_gpu=True, tests=EXPAND_T),
    Mutation("cuda-expand-checked-trip-unmasked", "csrc/cuda/lora_expand_rows.cu",
             "  if constexpr (kChecked) {  // by the rank only",
             "  if constexpr (false) {  // by the rank only",
             "CUDA tensor-core expand: a checked trip's loads are never masked, so B and h past a slot's rank (inside "
             "its 4-element read) reach the mma (NaN padding reaches y)", needs_gpu=True, tests=EXPAND_T),
    Mutation("cuda-expand-runs-one-run", "csrc/cuda/lora_expand_rows.cu",
             "run.rows = __ballot_sync(kAll, (todo >> lane & 1) && slot == run.slot);",
             "run.rows = __ballot_sync(kAll, (todo >> lane & 1) != 0);",
             "CUDA runs kernel: every position of a warp takes the first position's slot (one run)", needs_gpu=True,
             tests=EXPAND_T),
    Mutation("cuda-expand-runs-four-positions-first-at-eight", "csrc/cuda/lora_expand_rows.cu",
             "  int64_t pos0 = ((int64_t)blockIdx.y * kWarps + (threadIdx.x >> 5)) * kPositions;",
             "  int64_t pos0 = ((int64_t)blockIdx.y * kWarps + (threadIdx.x >> 5)) * kRunPositions;",
             "CUDA runs kernel on 4 positions a warp: warp w starts at 8w, so positions 8w+4..8w+7 get no delta",
             needs_gpu=True, tests=EXPAND_T),
    Mutation("cuda-expand-runs-pipelined-first-trip", "csrc/cuda/lora_expand_rows.cu",
             "        run = next;\n        trip = next_trip;",
             "        run = next;",
             "CUDA pipelined runs kernel: every run of a warp multiplies the first run's B and h (the next trip "
             "loaded, never used)", needs_gpu=True, tests=EXPAND_T),
    Mutation("cuda-expand-runs-wide-trip-at-32-ranks", "csrc/cuda/lora_expand_rows.cu",
             "expand_runs_kernel<TB, TH, TY, 4, RunsPipeline::None, 4>>(",
             "expand_runs_kernel<TB, TH, TY, 2, RunsPipeline::None, 4>>(",
             "CUDA runs kernel at ranks 33-64 and few rows a slot: 32 ranks a trip where its 4-position grid fits "
             "(not 64; the kernels' grid-stride loops keep any grid right, so the test names the instantiation)",
             needs_gpu=True, tests=EXPAND_T),
    Mutation("cuda-expand-segments-past-tile", "csrc/cuda/lora_expand_rows.cu",
             "m.row = ref.begin + lane < ref.end ? row : -1;",
             "m.row = lane < kRunPositions ? segment_row(p.seg, ref.begin + lane, p.rows) : -1;",
             "CUDA segments kernel: a tile takes 8 positions whatever its segment's end (the next segment's rows get "
             "this slot's product)", needs_gpu=True, tests=EXPAND_T),
    Mutation("cuda-expand-guess-unchecked", "csrc/cuda/lora_expand_rows.cu",
             "return c.row == m.row && c.slot == m.slot && c.rank == m.rank &&",
             "return true || c.row == m.row && c.slot == m.slot && c.rank == m.rank &&",
             "CUDA rows and runs kernels: the metadata guessed before the programmatic-launch wait is used unchecked",
             needs_gpu=True, tests=EXPAND_T),
    Mutation("cuda-expand-rows-one-after-redo", "csrc/cuda/lora_expand_rows.cu",
             "  for (; pos < p.seg.positions; pos += stride) {",
             "  if (pos < p.seg.positions) {",
             "CUDA rows kernel: a warp takes at most one position after its guessed first (a redo, or the next one)",
             needs_gpu=True, tests=EXPAND_T),
    Mutation("cuda-sgmv-mma-own-rank-half", "csrc/cuda/sgmv_mma.cu",
             "const int owner = ks / (kWarpRanks / 16) * kRowWarps + wr;",
             "const int owner = wc * kRowWarps + wr;",
             "CUDA prefill sgmv at a 128-wide rank tile: each warp expands its own half of the ranks twice",
             needs_gpu=True, tests=SGMV_T),
    Mutation("cuda-sgmv-cluster-sum-own-partial", "csrc/cuda/sgmv_tile.cuh",
             "      if (m < members) {\n        const float4 part = recv[",
             "      if (m == member) {\n        const float4 part = recv[",
             "CUDA prefill sgmv (both kernels): the cluster's h sum keeps each member's own K share of h",
             needs_gpu=True, tests=SGMV_T),
    Mutation("cuda-sgmv-cluster-sum-floor-share", "csrc/cuda/sgmv_tile.cuh",
             "  const int tid = threadIdx.x, share = (kFrags + members - 1) / members;",
             "  const int tid = threadIdx.x, share = kFrags / members;",
             "CUDA prefill sgmv (both kernels): a cluster of a size that does not divide the fragments (the one-wave "
             "rule's 3, 5, 6, 7) sends the last few fragments of h past the last member", needs_gpu=True,
             tests=SGMV_T),
    Mutation("cuda-sgmv-wgmma-last-rank-block-dropped", "csrc/cuda/sgmv_wgmma.cu",
             "    for (int kb = 0; kb < RT / 16; ++kb) {\n      gemm(mma_e",
             "    for (int kb = 0; kb < RT / 16 - 1; ++kb) {\n      gemm(mma_e",
             "CUDA wgmma prefill sgmv: the expand leaves out h's last 16 ranks", needs_gpu=True, tests=SGMV_T),
    Mutation("cuda-sgmv-wgmma-rows128-y-stages-overlap", "csrc/cuda/sgmv_wgmma.cu",
             "  auto ys = [&](int st) { return y_stages + st * kRows * (kBN + kYPad); };",
             "  auto ys = [&](int st) { return y_stages + st * 64 * (kBN + kYPad); };",
             "CUDA wgmma prefill sgmv in 128-position tiles: the y stages placed 64 rows apart, so each overlaps the "
             "next one's first half", needs_gpu=True, tests=SGMV_T),
    Mutation("cuda-sgmv-wgmma-bound-one-late", "csrc/cuda/sgmv_mma.cu",
             "       p.seg.positions >= kWgmmaMinPositions)) {",
             "       p.seg.positions > kWgmmaMinPositions)) {",
             "CUDA prefill sgmv: the automatic choice takes the wgmma kernel from one position past its bound",
             needs_gpu=True, tests=SGMV_T),
    Mutation("cuda-find-tile-rows-first-lane-step", "csrc/cuda/common.cuh",
             "      if (found && r < kRows) rows[r] = row[i];",
             "      if (i == 0 && found && r < kRows) rows[r] = row[i];",
             "CUDA tile lookup (block_find_tile): only each tile's first 32 rows reach the shared row list, the rest "
             "keep what was there (64- and 128-position tiles)", needs_gpu=True, tests=SGMV_T),
    Mutation("cuda-sgmv-k-tail-read-whole", "csrc/cuda/sgmv_tile.cuh",
             "    const int bytes = (int)std::clamp<int64_t>(p.k - k0 - kc, 0, 8) * 2;",
             "    const int bytes = 16;",
             "CUDA prefill sgmv (both tensor-core kernels): the shrink's last K step reads x and A past K (no zero "
             "fill)", needs_gpu=True, tests=SGMV_T),
    Mutation("cuda-expand-f32h-hi-only", "csrc/cuda/lora_expand_rows.cu",
             "if constexpr (kHiLo) mma16816<TB>(acc[i], a, trip.h_lo[u]);",
             "if constexpr (false) mma16816<TB>(acc[i], a, trip.h_lo[u]);",
             "CUDA tensor-core expand: float32 h rounded to B's 16-bit type (its lo part dropped)", needs_gpu=True,
             tests=EXPAND_T + ("tests/test_grouped_gemm_cuda.py",)),
    Mutation("cuda-gg-lora-ignores-k-sizes", "csrc/cuda/registration.cpp",
             "  e.lora_ranks = p.k_sizes;",
             "  e.lora_ranks = nullptr;",
             "CUDA grouped_gemm's LoRA expand on lora_expand's kernels reads every group's K (k_sizes ignored)",
             needs_gpu=True, tests=("tests/test_grouped_gemm_cuda.py",)),
    Mutation("cuda-shrink-mma-first-k-part", "csrc/cuda/sgmv_shrink.cu",
             "        for (int q = 0; q < k_parts; ++q) {",
             "        for (int q = 0; q < 1; ++q) {",
             "CUDA tensor-core decode shrink: where K is split among the warps h keeps only its first part",
             needs_gpu=True, tests=SGMV_T),
    Mutation("cuda-shrink-mma-rows-swapped", "csrc/cuda/sgmv_shrink.cu",
             "const uint32_t a[4] = {a0[2 * m], a1[2 * m], a0[2 * m + 1], a1[2 * m + 1]};",
             "const uint32_t a[4] = {a1[2 * m], a0[2 * m], a1[2 * m + 1], a0[2 * m + 1]};",
             "CUDA tensor-core decode shrink: A rows g and g + 8 of an M block trade places (h's rank rows permuted)",
             needs_gpu=True, tests=SGMV_T),
    Mutation("cuda-gg-split-last-split", "csrc/cuda/grouped_gemm_split.cu",
             "for (int64_t s = 0; s < splits; ++s) sum +=",
             "for (int64_t s = 1; s < splits; ++s) sum +=",
             "CUDA grouped_gemm split-K: the sum leaves out the first K chunk", needs_gpu=True,
             tests=("tests/test_grouped_gemm_cuda.py",)),
    Mutation("cuda-expand-rows-column-pair", "csrc/cuda/lora_expand_rows.cu",
             "hi = t == k ? acc[4 * quad + k][2] : hi;",
             "hi = t == k ? acc[4 * quad + k][1] : hi;",
             "CUDA rows kernel: the second column of a lane's pair takes the first column's sum", needs_gpu=True,
             tests=EXPAND_T),
    Mutation("ascend-expand-h-slot-stride", "csrc/ascend/lora_expand.cpp",
             "return h_[slot * t_.h_slot_stride + s * t_.expand.max_rank];",
             "return h_[(slot * t_.expand.num_slices + s) * t_.expand.max_rank];",
             "Ascend lora_expand (CPU model) assumes h's slots are contiguous (slot stride S*R; a broadcast h has 0)",
             tests=EXPAND_T),
    Mutation("ascend-sgmv-f32-h-read-unsynced", "csrc/ascend/sgmv.cpp",
             "        SetFlag<HardEvent::FIX_MTE2>(h_stored);\n        WaitFlag<HardEvent::FIX_MTE2>(h_stored);\n",
             "",
             "Ascend sgmv float32 x (CPU model): h is copied back from GM into L1 with no FIX -> MTE2 sync after "
             "Fixpipe stored it", tests=("tests/test_ascend_model.py",)),
    Mutation("ascend-gather-runs-past-dma-stride", "csrc/ascend/kernel_common.h",
             "const bool runs = row_stride >= cols && row_stride <= kNd2NzMaxStride;",
             "const bool runs = row_stride >= cols;",
             "Ascend row gather into L1 (CPU model): runs of rows by one DMA also where the row stride passes the "
             "DMA's 16-bit source stride", tests=("tests/test_ascend_model.py",)),
    Mutation("ascend-gather-run-over-a-gap", "csrc/ascend/kernel_common.h",
             "rows[i + run] == first + run", "rows[i + run] >= first + run",
             "Ascend row gather into L1 (CPU model): a run of rows goes on past a gap in the gathered rows",
             tests=("tests/test_ascend_model.py",)),
    Mutation("ascend-sgmv-f32-h-other-block", "csrc/ascend/sgmv.cpp",
             "stage.CopyIn(cube, 0, planes.source, walk.count, planes.ld, t_.expand, rank);",
             "stage.CopyIn(cube, 0, SplitPlanes<T>(split_, (block + 1) % t_.tiles.block_dim, t_.tiles).source, "
             "walk.count, planes.ld, t_.expand, rank);",
             "Ascend sgmv float32 x (CPU model): h is read back from the next block's GM tile",
             tests=("tests/test_ascend_model.py",)),
    # ---- the op table (C++ or Triton by measurement) and build_segments v4 ----
    Mutation("op-table-cpp-boundary", "csrc/common/op_table.cpp",
             "(std::lower_bound(b.begin(), b.end(), values[a]) - b.begin())",
             "(std::upper_bound(b.begin(), b.end(), values[a]) - b.begin())",
             "the C++ op-table lookup puts a value equal to a class bound in the next class",
             tests=("tests/test_op_table.py",)),
    Mutation("op-table-no-margin", "lora_ops/op_table.py",
             'cell["backend"] = "triton" if worst["cuda"] >= TRITON_MARGIN * worst["triton"] else "cuda"',
             'cell["backend"] = "triton" if worst["cuda"] > worst["triton"] else "cuda"',
             "the op table gives a regime to Triton on any win, without the 10% margin",
             tests=("tests/test_op_table.py",)),
    Mutation("op-table-true-ranks-default", "lora_ops/op_table.py",
             '"true_ranks": 2 if record.get("lora_ranks", True) else 1}',
             '"true_ranks": 2}',
             "the op table files the bench's calls without lora_ranks under calls with them",
             tests=("tests/test_op_table.py",)),
    Mutation("cuda-op-table-true-ranks-swapped", "csrc/cuda/registration.cpp",
             "slices_of(slice_offsets), op_table::true_ranks_axis(lora_ranks.has_value())})) {",
             "slices_of(slice_offsets), op_table::true_ranks_axis(!lora_ranks.has_value())})) {",
             "the CUDA sgmv looks its call up in the true_ranks class of the other kind of call",
             needs_gpu=True, tests=("tests/test_op_table.py",)),
    Mutation("op-table-from-quick-run", "lora_ops/op_table.py",
             '    if settings["quick"]:\n        problems.append("--quick times only the first few cases")\n',
             "",
             "the bench writes the op table from a --quick run",
             tests=("tests/test_bench.py", "tests/test_op_table.py")),
    Mutation("bench-floor-pool-rank", "lora_ops/bench/ops.py",
             "c.adapters * c.rank * (c.slices * c.K + c.N) * e",
             "c.adapters * c.R * (c.slices * c.K + c.N) * e",
             "the sgmv floor counts the pool's rank, not the adapters' true rank",
             tests=("tests/test_bench.py",)),
    Mutation("bench-floor-y-once", "lora_ops/bench/ops.py",
             "        return self.touched_bytes() + self.case.T * self.case.N * self.p.y.element_size()\n",
             "        return self.touched_bytes()\n",
             "the sgmv and expand floors count y once, as if it were only written",
             tests=("tests/test_bench.py",)),
    Mutation("bench-ops-timed-in-sequence", "lora_ops/bench/ops.py",
             "        ms = time_interleaved({key: run for key, (run, _) in runners.items()}, min_ms=30.0)\n",
             "        ms = time_interleaved({key: run for key, (run, _) in runners.items()}, min_ms=30.0, rounds=1)\n",
             "the op bench times each implementation in one round: a drift of the clocks decides close verdicts",
             tests=("tests/test_bench.py",)),
    Mutation("bench-decode-without-op-table", "lora_ops/bench/__main__.py",
             "        decode_step.run(models, device, records, failures, log, only, steps, args.parts, args.between_modules,\n"
             "                        copy_tbps)\n",
             "        with op_table.disabled():\n"
             "            decode_step.run(models, device, records, failures, log, only, steps, args.parts,\n"
             "                            args.between_modules, copy_tbps)\n",
             "the decode step times the C++ kernels without the op table the serving layer runs with",
             tests=("tests/test_bench.py",)),
    # ---- the decode-step bench ----
    Mutation("routes-choice-paced-by-routes-below", "lora_ops/routes.py",
             "    fastest = [min(t for n, t in s.items() if n in names) for s in samples]",
             "    fastest = [min(s.values()) for s in samples]",
             "the route sweep measures a regime's lower end against a route that serves only the regime below",
             tests=("tests/test_bench.py",)),
    Mutation("routes-bounds-not-integers", "lora_ops/routes.py",
             "    if not all(isinstance(b, int) and not isinstance(b, bool) for b in finite):",
             "    if False:",
             "a routes table with a NaN bound passes validation and matches no token count",
             tests=("tests/test_routes.py",)),
    Mutation("routes-triton-regime-without-triton", "lora_ops/routes.py",
             '        if backend == "triton" and "triton" in backends.unavailable:',
             "        if False:",
             "without Triton, a Triton regime hands the public op Triton's form of the route",
             tests=("tests/test_routes.py",)),
    Mutation("bench-interleaved-mean", "lora_ops/bench/timing.py",
             "return {name: statistics.median(ts) for name, ts in times.items()}",
             "return {name: statistics.mean(ts) for name, ts in times.items()}",
             "the decode-step bench's interleaved rounds are averaged: one slow round moves a route's time",
             tests=("tests/test_bench.py",)),
    Mutation("bench-serving-default-at-any-tokens", "lora_ops/bench/decode_step.py",
             "    default = serving_default(model, step)\n",
             "    default = serving_default(model, Step(1, step.adapters, step.rank))\n",
             "the decode-step bench marks the route the table gives one token as every step's serving default",
             tests=("tests/test_bench.py",)),
    Mutation("bench-route-capture-failure-kept", "lora_ops/bench/decode_step.py",
             "            graphs[name] = capture(calls)\n            checked[name] = first_err\n",
             "            checked[name] = first_err\n            graphs[name] = capture(calls)\n",
             "a route whose graph capture raises stays among the checked routes: the bench crashes on it",
             tests=("tests/test_bench.py",)),
    Mutation("fuzz-fold-linear-unjudged", "tests/fuzz/cases.py",
             "        problem = _compare_linear(case, args, result)\n",
             "        problem = \"\"\n",
             "the fuzzer accepts any fold_linear output",
             tests=("tests/fuzz/test_fuzz.py",)),
    Mutation("cuda-build-segments-unstable", "csrc/cuda/build_segments.cu",
             "p.token_indices[bucket_start[s.bucket] + base + s.rank] = (int32_t)s.token;",
             "p.token_indices[bucket_start[s.bucket] + base + __popc(s.peers) - 1 - s.rank] = (int32_t)s.token;",
             "CUDA build_segments places each warp batch's tokens of one slot in reverse order (not stable)",
             needs_gpu=True, tests=("tests/test_build_segments.py",)),
    Mutation("check-expand-h-shape", "csrc/common/checks.cpp",
             "holds(h.sym_size(0).sym_eq(T) & h.sym_size(1).sym_eq(L) & h.sym_size(2).sym_eq(R * S))",
             "holds(h.sym_size(0).sym_eq(T))",
             "lora_expand's check of h's slots and width removed (a narrow h is read past its end)", tests=EXPAND_T),
    Mutation("check-expand-device", "csrc/common/checks.cpp",
             '  check_device(op, "h", h, y);\n  check_device(op, "lora_b", lora_b, y);\n',
             "",
             "lora_expand's device check on h and lora_b removed", tests=EXPAND_T),
    Mutation("serving-fold-wrong-slice", "lora_ops/serving/layer.py",
             "            return out[..., :N]",
             "            return out[..., -N:]",
             "the fold route returns the last N columns of the [W; A] GEMM output (h's) instead of y's",
             tests=SERVING_T),
    Mutation("routes-validate-open-last", "lora_ops/routes.py",
             "if bounds[-1] is not None or any(b is None for b in bounds[:-1]):",
             "if any(b is None for b in bounds[:-1]):",
             "routes.validate accepts a table whose last regime is bounded: larger T fall in a gap with no route",
             tests=("tests/test_routes.py",)),
    Mutation("fold-linear-no-bias-grad", "csrc/bindings.cpp",
             "const bool bias_grad = bias.has_value() && bias->defined() && bias->requires_grad();",
             "const bool bias_grad = false;",
             "fold_linear under autograd ignores a bias that requires grad (no gradient reaches it)",
             tests=("tests/test_fold_linear.py",)),
    Mutation("cuda-fold-linear-short-k", "csrc/cuda/fold_linear_sm90.cu",
             "cute::make_shape((int)p.n, (int)p.t, (int)p.k, 1);",
             "cute::make_shape((int)p.n, (int)p.t, (int)p.k - 8, 1);",
             "CUDA fold_linear: the CUTLASS GEMM stops 8 elements short of K", needs_gpu=True,
             tests=("tests/test_fold_linear.py",)),
    Mutation("cuda-fold-skip-last-slot", "csrc/cuda/fold_linear_sm90.cu",
             "hi_ = __ldg(slots_.seg_indptr + s1 + 1);",
             "hi_ = __ldg(slots_.seg_indptr + s1);",
             "CUDA fold_linear: a cluster whose last slot alone is used is skipped", needs_gpu=True,
             tests=("tests/test_fold_linear.py",)),
    Mutation("cuda-fold-skip-base-rows", "csrc/cuda/fold_linear_sm90.cu",
             "stops_ = __ballot_sync(0xffffffffu, !work.is_valid() || first < slots_.base_rows);",
             "stops_ = __ballot_sync(0xffffffffu, !work.is_valid() || first + kClusterRows <= slots_.base_rows);",
             "CUDA fold_linear: the cluster holding the last base rows and the first slots' is judged by its slots",
             needs_gpu=True, tests=("tests/test_fold_linear.py",)),
    Mutation("cuda-fold-skip-past-stop", "csrc/cuda/fold_linear_sm90.cu",
             "step(ahead != 0 ? __ffs(ahead) - 1 : kJudged - position_);",
             "step(ahead != 0 ? __ffs(ahead) : kJudged - position_);",
             "CUDA fold_linear: the walk passes the tile it should stop at, after a skipped one", needs_gpu=True,
             tests=("tests/test_fold_linear.py",)),
    Mutation("cuda-fold-lt-drops-bias", "csrc/cuda/registration.cpp",
             "cuda::fold_linear_lt(p, has_bias ? bias->data_ptr() : nullptr, device, stream)",
             "cuda::fold_linear_lt(p, nullptr, device, stream)",
             "CUDA fold_linear on cuBLASLt: the bias is not added", needs_gpu=True,
             tests=("tests/test_fold_linear.py",)),
    Mutation("cuda-fold-lt-unaligned-bias", "csrc/cuda/fold_linear_lt.cpp",
             "if (std::min({align.x, align.w, align.y, align.bias}) < 16 ||",
             "if (std::min({align.x, align.w, align.y}) < 16 ||",
             "CUDA fold_linear on cuBLASLt takes a bias that is not 16-byte aligned (a kernel never measured)",
             needs_gpu=True, tests=("tests/test_fold_linear.py",)),
    Mutation("cuda-fold-forced-blas-runs-cutlass", "csrc/cuda/registration.cpp",
             "if (!has_bias && preferred != FoldLinearKernel::Cublas &&",
             "if (!has_bias &&",
             "CUDA fold_linear: LORA_OPS_CUDA_LINEAR_KERNEL=cublas with cuBLASLt forced still runs the CUTLASS kernel up "
             "to 64 tokens", needs_gpu=True, tests=("tests/test_fold_linear.py",)),
    Mutation("cuda-fold-lt-never-automatic", "csrc/cuda/registration.cpp",
             "t > cuda::kFoldLinearMaxTokens && t <= cuda::kFoldLinearLtMaxTokens;",
             "t > cuda::kFoldLinearMaxTokens && t <= cuda::kFoldLinearMaxTokens;",
             "CUDA fold_linear: the automatic choice never takes cuBLASLt (past 64 tokens it is cuBLAS again)",
             needs_gpu=True, tests=("tests/test_fold_linear.py",)),
    Mutation("bench-runs-late-bound", "lora_ops/bench/ops.py",
             "calls = [functools.partial(fn, pb, yy) for pb, yy in zip(sets, ys)]",
             "calls = [(lambda pb=pb, yy=yy: fn(pb, yy)) for pb, yy in zip(sets, ys)]",
             "the op bench's runs call the last implementation's function under every name (session 42's eager bug)",
             tests=("tests/test_bench.py",)),
    Mutation("fold-route-without-segments", "lora_ops/serving/layer.py",
             "out = ops.fold_linear(x, m.w_cat, m.bias_cat, batch.seg_indptr, slot_rows)",
             "out = ops.fold_linear(x, m.w_cat, m.bias_cat)",
             "the serving layer's fold route computes every slot's h again (reads every slot's A)",
             tests=("tests/test_serving.py",)),
    Mutation("cuda-gg-expand-piece-rows", "csrc/cuda/grouped_gemm_expand.cu",
             "auto y_row_of = [&](int j) { return s_y[YP::r0() + j * YP::kRowStep]; };",
             "auto y_row_of = [&](int j) { return s_y[YP::r0() + j]; };",
             "CUDA grouped_gemm expand: a whole chunk's y pieces take the wrong rows of the tile", needs_gpu=True,
             tests=("tests/test_grouped_gemm_cuda.py",)),
    Mutation("cuda-gg-expand-fragments-late", "csrc/cuda/grouped_gemm_expand.cu",
             "        if (i == 0) {  // x has landed with the first chunk\n",
             "        if (i == 1) {  // x has landed with the first chunk\n",
             "CUDA grouped_gemm expand: a tile's first chunk multiplies x fragments not yet loaded", needs_gpu=True,
             tests=("tests/test_grouped_gemm_cuda.py",)),
    # ==== session 39: the narrow tiles' pieces ====
    Mutation("cuda-gg-pieces-tail-unclipped", "csrc/cuda/grouped_gemm.cuh",
             "    const int bytes = (int)clamp_index(valid_cols - P::c(), 0, P::kElems) * (int)sizeof(T);",
             "    const int bytes = 16;",
             "CUDA grouped_gemm narrow tiles, pieces: a K step reads whole pieces past the group's k_l", needs_gpu=True,
             tests=("tests/test_grouped_gemm_cuda.py",)),
    Mutation("cuda-gg-pieces-first-row-only", "csrc/cuda/grouped_gemm.cuh",
             "    for (int j = 0; j < P::kCount; ++j) rows[j] = P::in_tile(j) ? row_ptr(P::row(j)) : nullptr;",
             "    for (int j = 0; j < P::kCount; ++j) rows[j] = P::in_tile(j) ? row_ptr(P::row(0)) : nullptr;",
             "CUDA grouped_gemm narrow tiles, pieces: every piece of a thread stages its first piece's row",
             needs_gpu=True, tests=("tests/test_grouped_gemm_cuda.py",)),
    Mutation("cuda-gg-pieces-unaligned-w", "csrc/cuda/grouped_gemm_tile.cu",
             "    if (vec.x && vec.w) return",
             "    if (vec.x) return",
             "CUDA grouped_gemm narrow tiles, pieces: launched for w rows that are not 16-byte aligned", needs_gpu=True,
             tests=("tests/test_grouped_gemm_cuda.py",)),
    Mutation("report-routes-despite-failures", "lora_ops/bench/report.py",
             "            if result[\"failures\"]:\n",
             "            if False:\n",
             "report --routes writes a routes table from a run whose routes failed",
             tests=("tests/test_bench.py",)),
    Mutation("routes-table-first-record", "lora_ops/bench/decode_step.py",
             "timed.setdefault((r[\"model\"], r[\"T\"], r[\"adapters\"], r[\"rank\"]), {})[r[\"backend\"]] = r[\"us\"]",
             "timed.setdefault((r[\"model\"], r[\"T\"], r[\"adapters\"], r[\"rank\"]), {}).setdefault("
             "r[\"backend\"], r[\"us\"])",
             "the routes table takes a step's first record of a route, not the sweep's (the issue rows run first)",
             tests=("tests/test_bench.py",)),
    Mutation("route-choice-first-mix-only", "lora_ops/bench/decode_step.py",
             "ends = [mix[j] for mix in samples for j in",
             "ends = [mix[j] for mix in samples[:1] for j in",
             "each regime's route is chosen on the first adapter mix alone (the 70B shard's T=32 went to kext, 10% "
             "slower than fold with one adapter)",
             tests=("tests/test_bench.py",)),
    Mutation("pool-takes-the-first-routes-table", "lora_ops/routes.py",
             "    return min(range(len(_modules)), key=lambda i: (_distance(modules, _modules[i]), i))",
             "    return 0",
             "every pool takes the first model's routes table, whatever its modules",
             tests=("tests/test_routes.py",)),
    Mutation("routes-fallback-top-end-only", "lora_ops/routes.py",
             "others = [_other_timed(us) for us in below + r[\"us\"]]",
             "others = [_other_timed(us) for us in r[\"us\"]]",
             "a kext regime's fallback from its top end's times alone (the bench chooses from both ends)",
             tests=("tests/test_routes.py",)),
    Mutation("pool-routes-table-by-n-k", "lora_ops/serving/pool.py",
             "routes.NearestTable([(m.in_features, m.out_features) for m in self.modules.values()])",
             "routes.NearestTable([(m.out_features, m.in_features) for m in self.modules.values()])",
             "each pool takes the routes table nearest its modules' (N, K), not (K, N)",
             tests=("tests/test_routes.py",)),
    Mutation("layer-ignores-its-pools-routes-table", "lora_ops/serving/layer.py",
             "self._pool.route_table.index())",
             "0)",
             "the layers route by the first model's table, not their pool's",
             tests=("tests/test_routes.py",)),
    Mutation("pool-routes-table-kept-across-install", "lora_ops/routes.py",
             "        if self._of_tables is not _tables:\n",
             "        if False:\n",
             "a pool keeps the index of the table installed when it first asked, after another is installed",
             tests=("tests/test_routes.py",)),
    Mutation("bench-steps-past-the-pool", "lora_ops/bench/decode_step.py",
             "        if step.adapters > POOL_SLOTS:\n",
             "        if False:\n",
             "--steps accepts more adapters than the pool has slots (a smaller mix is timed under that name)",
             tests=("tests/test_bench.py",)),
    # ==== session 31: lora_linear (the kext route) and the pool's copy of B ====
    Mutation("composite-lora-linear-no-scales", "csrc/common/lora_linear.cpp",
             "  if (lora_scales.has_value()) h = h * lora_scales->index_select(0, own.view({T})).unsqueeze(1);\n",
             "",
             "lora_linear's composition ignores lora_scales", tests=("tests/test_lora_linear.py",)),
    Mutation("composite-lora-linear-invalid-slot-as-0", "csrc/common/lora_linear.cpp",
             "  h = at::where(valid, h, 0).to(x.scalar_type());",
             "  h = h.to(x.scalar_type());",
             "lora_linear's composition gives a row without a slot slot 0's delta", tests=("tests/test_lora_linear.py",)),
    Mutation("kext-shrink-slot-past-pool", "csrc/cuda/lora_linear_shrink.cu",
             "const bool has_slot = slot >= 0 && slot < a.num_slots;",
             "const bool has_slot = slot >= 0;",
             "CUDA lora_linear shrink: a slot >= L reads A past the pool (and writes no window of h for it)",
             needs_gpu=True, tests=("tests/test_lora_linear.py",)),
    Mutation("kext-shrink-ksplit-first-part-only", "csrc/cuda/lora_linear_shrink.cu",
             "    for (int i = 0; i < parts; ++i) sum += part_sum[warp + i];",
             "    for (int i = 0; i < 1; ++i) sum += part_sum[warp + i];",
             "CUDA lora_linear shrink, the K split: h from the first part of K alone", needs_gpu=True,
             tests=("tests/test_lora_linear.py",)),
    Mutation("kext-gemm-slot-mask-first-32-rows", "csrc/cuda/lora_linear_sm90.cu",
             "    for (int i = 0; i < kSlotWords; ++i) {\n      if (lane + 32 * i < p.ext.num_tokens)",
             "    for (int i = 0; i < 1; ++i) {\n      if (lane + 32 * i < p.ext.num_tokens)",
             "CUDA lora_linear GEMM: the slot mask reads rows 0-31 only (a slot only later rows use is skipped)",
             needs_gpu=True, tests=("tests/test_lora_linear.py",)),
    Mutation("kext-wide-tile-across-slices", "csrc/cuda/lora_linear_sm90.cu",
             "  if (!slices_end_on(p.slice_offsets + 1, p.num_slices, 128)) return false;",
             "  if (!slices_end_on(p.slice_offsets + 1, p.num_slices, 64)) return false;",
             "CUDA lora_linear GEMM: the 128-row tile asked for on slices bounded in 64s (its can_implement refuses "
             "it: the layer falls to the composition instead of the 64-row tile)", needs_gpu=True,
             tests=("tests/test_lora_linear.py",)),
    Mutation("kext-gemm-skips-every-b-block", "csrc/cuda/lora_linear_sm90.cu",
             "    return (used_ & window) == 0;",
             "    return true;",
             "CUDA lora_linear GEMM: every B block skipped as if no row used its slots (the delta is lost)",
             needs_gpu=True, tests=("tests/test_lora_linear.py",)),
    Mutation("kext-gemm-h-from-slice-0", "csrc/cuda/lora_linear_sm90.cu",
             "    const int h_tile0 = slice * p.slice_h_tiles;",
             "    const int h_tile0 = 0;",
             "CUDA lora_linear GEMM: every slice's rows multiply slice 0's h", needs_gpu=True,
             tests=("tests/test_lora_linear.py",)),
    Mutation("pool-b-copy-stale", "lora_ops/serving/pool.py",
             "            self.kext_lora_b[slot].copy_(self.lora_b[slot])\n",
             "            pass\n",
             "the pool's copy of B for lora_linear's CUDA kernels is never written (the kext route adds nothing; "
             "only sm_90 GPUs have the copy)", needs_gpu=True, tests=("tests/test_routes.py",)),
    Mutation("kext-route-drops-bias", "lora_ops/serving/layer.py",
             "                                   m.offsets_arg, self.base.bias)",
             "                                   m.offsets_arg, None)",
             "the kext route drops the base layer's bias", tests=SERVING_T),
    Mutation("routes-kext-beyond-its-kernels", "lora_ops/bench/decode_step.py",
             " or (kind == \"kext\" and step.T > route_table.KEXT_MAX_TOKENS):",
             ":",
             "the bench times the kext route past the tokens its kernels serve (its composition)",
             tests=("tests/test_bench.py",)),
    # ==== session 49: an op table per GPU model ====
    Mutation("op-table-ignores-the-gpu", "lora_ops/op_table.py",
             "    return setting or path_for(visible_gpu_name() if used else None)",
             "    return setting or path_for(None)",
             "every GPU gets the reference GPU's op table, an H100 too", tests=("tests/test_op_table.py",)),
    Mutation("routes-ignore-the-gpu", "lora_ops/routes.py",
             "    return op_table.path_for(op_table.visible_gpu_name(), TABLES_DIR)",
             "    return op_table.path_for(None, TABLES_DIR)",
             "every GPU gets the reference GPU's route table", tests=("tests/test_routes.py",)),
    Mutation("routes-split-where-the-mixes-disagree", "lora_ops/bench/decode_step.py",
             "                and within(below[\"us\"], names) and within(regime[\"us\"], names)):",
             "                ):",
             "the route sweep splits regimes where the mixes, not the ends, disagree (samples that help no choice)",
             tests=("tests/test_bench.py",)),
    Mutation("routes-split-least-bad-first", "lora_ops/bench/decode_step.py",
             "            return regimes, points[0]\n        sample_T = sorted(sample_T + [points[0]])",
             "            return regimes, points[-1]\n        sample_T = sorted(sample_T + [points[-1]])",
             "the route sweep spends its splits on the least bad regime first", tests=("tests/test_bench.py",)),
    Mutation("routes-split-one-too-many", "lora_ops/bench/decode_step.py",
             "len(route_table.REGIME_SAMPLES) >= route_table.SPLIT_MAX_SAMPLES:",
             "len(route_table.REGIME_SAMPLES) > route_table.SPLIT_MAX_SAMPLES:",
             "a class gets one split more than SPLIT_MAX_SAMPLES", tests=("tests/test_bench.py",)),
    Mutation("routes-split-untimed-sample", "lora_ops/bench/decode_step.py",
             "        if not complete(points[0]):",
             "        if False:",
             "a split not yet timed for every route and mix becomes a sample", tests=("tests/test_bench.py",)),
    Mutation("nvml-asked-every-time", "lora_ops/op_table.py",
             "@functools.lru_cache(maxsize=None)\ndef _nvml_device_name(",
             "def _nvml_device_name(",
             "NVML is initialised (every GPU attached) for each table that names the GPU",
             tests=("tests/test_op_table.py",)),
    Mutation("op-table-nvml-ignores-visible-devices", "lora_ops/op_table.py",
             '    first = visible.split(",")[0].strip() if visible is not None else "0"',
             '    first = "0"',
             "the op table is chosen by GPU 0 whatever CUDA_VISIBLE_DEVICES makes the process see",
             tests=("tests/test_op_table.py",)),
    Mutation("bench-drawn-spread-ignored", "lora_ops/bench/decode_step.py",
             'sizes = testing.drawn_sizes(step.T, step.adapters, gen) if step.spread == "drawn" else None',
             "sizes = None",
             "a decode step given /drawn spreads its rows evenly all the same", tests=("tests/test_bench.py",)),
    Mutation("testing-drawn-sizes-skip-one-each", "lora_ops/testing.py",
             "    sizes = [int(i < num_tokens) for i in range(num_adapters)]",
             "    sizes = [0] * num_adapters",
             "drawn adapter sizes leave some adapters of the step without a row",
             tests=("tests/test_testing.py", "tests/test_bench.py")),
    Mutation("routes-timed-takes-drawn-steps", "lora_ops/bench/decode_step.py",
             ' and r.get("spread", "even") == "even" and (',
             " and (",
             "a routes table is made of drawn adapter sizes' steps too (beside the sweep's even ones)",
             tests=("tests/test_bench_report.py",)),
    Mutation("bench-gg-composed-no-coefficients", "lora_ops/bench/ops.py",
             "        h.mul_(coef)\n",
             "",
             "the op bench's two-grouped_gemm sgmv leaves out the rows' adapter scales", tests=("tests/test_bench.py",)),
    Mutation("bench-gg-composed-first-slice-a", "lora_ops/bench/ops.py",
             "p.lora_a[:, s * R:s * R + r], p.seg_indptr",
             "p.lora_a[:, :r], p.seg_indptr",
             "the op bench's two-grouped_gemm sgmv shrinks every slice with the first slice's A",
             tests=("tests/test_bench.py",)),
    Mutation("bench-gg-composed-halves-swapped", "lora_ops/bench/ops.py",
             "    return pick(rank, K), [pick(n, rank) for n in widths]",
             "    return pick(K, rank), [pick(rank, n) for n in widths]",
             "the op bench's two-grouped_gemm sgmv puts each half on the backend of the other's regime",
             tests=("tests/test_bench.py",)),
    Mutation("report-drawn-beside-even", "lora_ops/bench/report.py",
             '(r["model"], r["T"], r["adapters"], r["rank"], r.get("spread", "even"))',
             '(r["model"], r["T"], r["adapters"], r["rank"], "even")',
             "the report's decode table puts a drawn step's routes in the even step's row",
             tests=("tests/test_bench_report.py",)),
]


# ---------------------------------------------------------------------------------------------------------------
def _read(path: str) -> str:
    with open(path, encoding="utf-8") as f:
        return f.read()


def _write(path: str, text: str) -> None:
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)


def worktree_files(root: str) -> List[str]:
    """The working tree's files that git tracks or would track (untracked but not ignored)."""
    out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=root,
                         capture_output=True, text=True, check=True).stdout
    return [p for p in out.split("\0") if p and os.path.isfile(os.path.join(root, p))]


def stale_reason(m: Mutation, root: str, files: Sequence[str]) -> Optional[str]:
    """None if m's snippet occurs exactly once in its file, else why the list is stale (and where it moved)."""
    missing_tests = [t for t in m.tests if not os.path.isfile(os.path.join(root, t))]
    if missing_tests:
        return f"its test files {missing_tests} do not exist"
    path = os.path.join(root, m.file)
    count = _read(path).count(m.original) if os.path.isfile(path) else 0
    if count == 1:
        return None
    if count > 1:
        return f"snippet occurs {count} times in {m.file}: add context to make it unique"
    elsewhere = [f for f in files if f != m.file and f != SELF and f.endswith(SOURCE_SUFFIXES)
                 and m.original in _read(os.path.join(root, f))]
    where = f"; it occurs in {', '.join(elsewhere)}" if elsewhere else ""
    missing = "" if os.path.isfile(path) else f" ({m.file} does not exist)"
    return f"snippet not found in {m.file}{missing}{where}"


def make_scratch(root: str, scratch: str, files: Sequence[str]) -> None:
    """Copy the tracked files and this checkout's build into scratch. A reused scratch keeps the files whose content
    is unchanged (their mtimes, so its C++ objects stay valid); a changed file gets a fresh mtime (rebuilt)."""
    for rel in files:
        src, dst = os.path.join(root, rel), os.path.join(scratch, rel)
        if os.path.isfile(dst) and open(src, "rb").read() == open(dst, "rb").read():
            continue
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        shutil.copyfile(src, dst)
        shutil.copymode(src, dst)
    built = [p for pattern in BUILT for p in glob.glob(os.path.join(root, pattern))]
    if not any(os.path.basename(p).startswith("_C") for p in built):
        sys.exit(f"mutate: no built lora_ops/_C*.so in {root}: build the extension first (see README)")
    for path in built:
        shutil.copyfile(path, os.path.join(scratch, os.path.relpath(path, root)))


ORIGINAL_SUFFIX = ".mutate-orig"


def restore_originals(tree: str) -> List[str]:
    """Put back every file that a killed run left mutated in tree (its original waits beside it), dated now: the
    build's objects were compiled from the mutated file, later than the original's date, so a build would keep them
    (a GPU run's baseline once failed that way, on the killed run's bug). Returns the restored paths."""
    restored = []
    for backup in sorted({tree + os.sep + m.file + ORIGINAL_SUFFIX for m in MUTATIONS}):
        if not os.path.exists(backup):
            continue
        path = backup[:-len(ORIGINAL_SUFFIX)]
        print(f"mutate: restoring {os.path.relpath(path, tree)}, left mutated by a run that did not finish")
        shutil.move(backup, path)
        os.utime(path)
        restored.append(path)
    return restored


def _env(seed: int, gpu: bool) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(PYTHONDONTWRITEBYTECODE="1", LORA_OPS_TEST_SEED=str(seed))
    if not gpu:
        env["LORA_OPS_NO_CUDA"] = "1"
    return env


def build(scratch: str, env: dict, log_path: str) -> bool:
    with open(log_path, "w") as log:
        run = subprocess.run([sys.executable, "setup.py", "build_ext", "--inplace", "-q"], cwd=scratch,
                             env=dict(env, MAX_JOBS=env.get("MAX_JOBS", str(os.cpu_count() or 1))),
                             stdout=log, stderr=subprocess.STDOUT)
    return run.returncode == 0


def test_files(files: Sequence[str], first: Sequence[str], only_first: bool) -> List[str]:
    """The tracked files `pytest tests` collects (tests/**/test_*.py, *_test.py), `first` leading (only those with
    only_first)."""
    if only_first and first:
        return list(first)
    found = sorted(f for f in files if f.startswith("tests/") and f.endswith(".py")
                   and (os.path.basename(f).startswith("test_") or f.endswith("_test.py")))
    return list(first) + [f for f in found if f not in first]


NO_TESTS_COLLECTED = 5  # pytest's exit status


def stop_on_sigterm() -> None:
    """`timeout` (a device call's limit) ends a run with SIGTERM, which by default ends Python without running its
    finally blocks: an in-place run then left its planted bug in the file and in the build, and the GPU tests after
    it failed on that bug (session 51). As SystemExit it unwinds through _run_one, which puts both back (and
    subprocess.run kills the pytest it waits for)."""
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))


def run_tests(scratch: str, env: dict, test_paths: Sequence[str], log_path: str, timeout: float, workers: int = 0,
              gpu: bool = False):
    """(pytest exit status or None on timeout, first failing test ids)."""
    cmd = [sys.executable, "-m", "pytest", *test_paths, "-q", "-x", "-p", "no:cacheprovider"]
    if gpu:
        cmd += ["-m", "gpu"]
    if workers:
        cmd += ["-n", str(workers)]
    with open(log_path, "w") as log:
        # A session of its own, so that a timeout ends pytest's xdist workers too: a planted bug that hangs a kernel
        # (an mbarrier that waits for bytes never sent) holds the GPU in a worker, and the next bugs' runs with it.
        proc = subprocess.Popen(cmd, cwd=scratch, env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            rc = None
        finally:
            if proc.poll() is None:  # timed out, or this run is being ended (SIGTERM, stop_on_sigterm)
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    failed = re.findall(r"^(?:FAILED|ERROR) (.+?)(?: - .*)?$", _read(log_path), flags=re.M)
    return rc, failed


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", nargs="+", metavar="ID", help="run only these mutations")
    ap.add_argument("--gpu", action="store_true", help="run the GPU-only mutations (on a GPU machine)")
    ap.add_argument("--fast", action="store_true", help="run each mutation's own test files, not the whole suite")
    ap.add_argument("--check", action="store_true", help="only check that every snippet applies")
    ap.add_argument("--restore", action="store_true",
                    help="only put back the files a killed --in-place run left mutated (a build recompiles them)")
    ap.add_argument("--list", action="store_true", help="print the mutation list")
    ap.add_argument("--skip-stale", action="store_true", help="report stale mutations and run the others")
    ap.add_argument("--scratch", help="scratch directory to (re)use; default: a new temporary one, removed after")
    ap.add_argument("--in-place", action="store_true",
                    help="mutate this checkout itself and rebuild with its build directory (a throwaway tree)")
    ap.add_argument("--log", help="also write the report to this file")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds per pytest run (default 1800)")
    ap.add_argument("--workers", type=int, default=0, help="pytest-xdist processes per run (needs pytest-xdist; default: none)")
    args = ap.parse_args(argv)

    if args.list:
        for m in MUTATIONS:
            print(f"{m.id:<38} {'GPU ' if m.needs_gpu else ''}{m.file}: {m.description}")
        return 0
    ids = {m.id for m in MUTATIONS}
    unknown = sorted(set(args.only or ()) - ids)
    if unknown:
        sys.exit(f"mutate: unknown mutation ids {unknown} (see --list)")
    chosen = [m for m in MUTATIONS if (not args.only or m.id in args.only)]

    if args.in_place and args.scratch:
        sys.exit("mutate: --in-place and --scratch exclude each other")
    if args.restore:
        restore_originals(ROOT)
        return 0
    stop_on_sigterm()
    restored = restore_originals(ROOT) if args.in_place else []  # before the snippets are looked for
    files = worktree_files(ROOT)
    stale = {m.id: why for m in chosen if (why := stale_reason(m, ROOT, files))}
    for mid, why in stale.items():
        print(f"STALE {mid}: {why}")
    if args.check:
        print(f"{len(chosen) - len(stale)} of {len(chosen)} mutations apply" + (" (list is stale)" if stale else ""))
        return 2 if stale else 0
    if stale and not args.skip_stale:
        print("mutate: the mutation list is stale (see above); refresh the snippets or pass --skip-stale")
        return 2

    seed = int(os.environ.get("LORA_OPS_TEST_SEED") or secrets.randbelow(1 << 32))
    env = _env(seed, args.gpu)
    if args.in_place:
        scratch, logs = ROOT, tempfile.mkdtemp(prefix="lora_ops_mutate_logs_")
    else:
        scratch = args.scratch or tempfile.mkdtemp(prefix="lora_ops_mutate_")
        os.makedirs(scratch, exist_ok=True)
        logs = os.path.join(scratch, "mutation_logs")
        os.makedirs(logs, exist_ok=True)
        make_scratch(ROOT, scratch, files)
    # the checkout's own build, CUDA too (a CPU run's mutations build without it): it is what stays
    full_build = {k: v for k, v in env.items() if k != "LORA_OPS_NO_CUDA"}
    if any(p.endswith(CPP_SUFFIXES) for p in restored):
        if not build(ROOT, full_build, os.path.join(logs, "restored.log")):
            print(f"mutate: the checkout with its restored files does not build; see {logs}/restored.log")
            return 2
    pristine = {p: open(p, "rb").read() for pattern in BUILT for p in glob.glob(os.path.join(scratch, pattern))}
    lines = [f"mutate: {ROOT} -> {scratch}; LORA_OPS_TEST_SEED={seed}; "
             f"{'--fast (own test files)' if args.fast else 'every test file, -q -x'}; {'GPU' if args.gpu else 'CPU'}"]
    print(lines[0], flush=True)

    t0 = time.time()
    runs = [m for m in chosen if m.id not in stale and m.needs_gpu == args.gpu]
    own = sorted({t for m in runs for t in m.tests}) if args.fast and all(m.tests for m in runs) else []
    rc, failed = run_tests(scratch, env, test_files(files, own, bool(own)), os.path.join(logs, "baseline.log"),
                           args.timeout, args.workers, args.gpu)
    if rc != 0:
        print(f"mutate: the UNMUTATED suite fails (exit {rc}: {failed[:3]}); see {logs}/baseline.log")
        return 2
    lines.append(f"baseline (unmutated{', ' + str(len(own)) + ' test files' if own else ''}): passed in "
                 f"{time.time() - t0:.0f} s")
    print(lines[-1], flush=True)

    results = []
    for m in chosen:
        if m.id in stale:
            results.append((m, "STALE", 0.0, stale[m.id]))
        elif m.needs_gpu != args.gpu:
            why = "needs a GPU (--gpu)" if m.needs_gpu else "CPU mutation (run without --gpu)"
            results.append((m, "not run", 0.0, why))
        else:
            results.append(_run_one(m, scratch, env, logs, args, pristine, files))
        m_, verdict, secs, detail = results[-1]
        print(f"{verdict:<9} {m.id:<38} {secs:5.0f} s  {detail}", flush=True)

    if args.in_place and any(m.file.endswith(CPP_SUFFIXES) for m in runs):
        # Only the linked libraries went back after each C++ bug: the build directory keeps the objects the last
        # one compiled, which a copy of this tree whose sources are dated before them (the GPU machine's, on its
        # next call) would link unchanged. Rebuilt now, while the restored sources are the newer.
        if not build(ROOT, full_build, os.path.join(logs, "rebuilt.log")):
            print(f"mutate: the checkout with its planted bugs taken out does not build; see {logs}/rebuilt.log")
            return 2
    lines += ["", f"{'result':<9} {'mutation':<38} {'time':>7}  detail", "-" * 100]
    lines += [f"{v:<9} {m.id:<38} {s:5.0f} s  {d}" for m, v, s, d in results]
    count = lambda v: sum(1 for r in results if r[1] == v)
    lines += ["", f"caught {count('caught')}, survived {count('survived')}, build failed {count('no build')}, "
                  f"stale {count('STALE')}, not run {count('not run')}; {time.time() - t0:.0f} s; logs in {logs}"]
    print("\n".join(lines[3:]))
    if args.log:
        _write(args.log, "\n".join(lines) + "\n")
    if not args.scratch and not args.in_place:
        shutil.rmtree(scratch, ignore_errors=True)
    return 1 if count("survived") or count("no build") else 0


def _run_one(m: Mutation, scratch: str, env: dict, logs: str, args, pristine: dict, files: Sequence[str]):
    path = os.path.join(scratch, m.file)
    original = _read(path)
    t0 = time.time()
    cpp = m.file.endswith(CPP_SUFFIXES)
    backup = path + ORIGINAL_SUFFIX
    try:
        _write(backup, original)  # what restore_originals puts back if this run is killed
        _write(path, original.replace(m.original, m.replacement, 1))
        if cpp and not build(scratch, env, os.path.join(logs, f"{m.id}.build.log")):
            return m, "no build", time.time() - t0, f"the mutated tree does not compile: {logs}/{m.id}.build.log"
        rc, failed = run_tests(scratch, env, test_files(files, m.tests, args.fast),
                               os.path.join(logs, f"{m.id}.log"), args.timeout, args.workers, args.gpu)
    finally:
        _write(path, original)
        os.remove(backup)
        if cpp:  # back to this checkout's build; the next C++ build recompiles the restored file as well
            for p, data in pristine.items():
                with open(p, "wb") as f:
                    f.write(data)
    secs = time.time() - t0
    if rc is None:
        return m, "caught", secs, f"timeout after {args.timeout:.0f} s (a hang)"
    if rc == 0:
        return m, "survived", secs, "every test passed"
    if rc == NO_TESTS_COLLECTED:  # not a catch: nothing ran
        return m, "survived", secs, "no test ran (none of its test files has a test of this run's selection)"
    what = f"exit {rc}" + (" (crash)" if rc < 0 else "")
    return m, "caught", secs, f"{what}: {failed[0] if failed else 'see ' + m.id + '.log'}"


if __name__ == "__main__":
    sys.exit(main())
