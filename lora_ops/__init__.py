"""lora_ops: multi-LoRA custom ops for PyTorch (sgmv, lora_expand, grouped_gemm, build_segments, fold_linear,
lora_linear).

Importing the package loads the compiled op library `_C` (schemas, CPU/CUDA kernels, Meta kernels) and
registers the Triton backend for CUDA where the C++ CUDA kernels are absent or LORA_OPS_BACKEND=triton.
"""
import glob as _glob
import os as _os

import torch as _torch

_here = _os.path.dirname(_os.path.abspath(__file__))
_libs = sorted(_glob.glob(_os.path.join(_here, "_C*.so")) + _glob.glob(_os.path.join(_here, "_C*.pyd")))
if not _libs:
    raise ImportError(f"lora_ops: compiled library _C not found in {_here}; build it with "
                      "`pip install --no-build-isolation -e .`")
LIBRARY_PATH = _libs[0]
_torch.ops.load_library(LIBRARY_PATH)

from .ops import Segments, build_segments, fold_linear, grouped_gemm, lora_expand, lora_linear, sgmv  # noqa: E402
from . import backends as _backends  # noqa: E402

_backends.register_triton_where_needed()

__all__ = ["sgmv", "lora_expand", "grouped_gemm", "build_segments", "fold_linear", "lora_linear", "Segments",
           "LIBRARY_PATH"]
__version__ = "0.1.0"
