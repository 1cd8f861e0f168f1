"""The bench's names of lora_ops' own implementations, shared by the op bench (ops.py) and the report (report.py,
which keeps its imports light)."""

# The C++ prefill sgmv kernels forced one at a time, by the variables that force them, at the cases of
# op_table.MMA_MIN_POSITIONS positions or more: cuda-wgmma, the sm_90a kernel (sgmv_wgmma.cu) at every rank tile
# (timed by default); cuda-mma, mma.sync's (sgmv_mma.cu); cuda-wgmma-rows64 / -rows128, the sm_90a kernel in tiles of
# 64 / 128 positions at a rank tile of 128 (these three only where --impls names them). Their rows across batch
# sizes are what the automatic choice's bounds come from (kWgmmaMinRankTile, kWgmmaMinPositions: csrc/cuda/kernels.h).
FORCED_PREFILL = {
    "cuda-wgmma": {"LORA_OPS_CUDA_SGMV_KERNEL": "wgmma"},
    "cuda-mma": {"LORA_OPS_CUDA_SGMV_KERNEL": "mma"},
    "cuda-wgmma-rows64": {"LORA_OPS_CUDA_SGMV_KERNEL": "wgmma", "LORA_OPS_CUDA_SGMV_WGMMA_ROWS": "64"},
    "cuda-wgmma-rows128": {"LORA_OPS_CUDA_SGMV_KERNEL": "wgmma", "LORA_OPS_CUDA_SGMV_WGMMA_ROWS": "128"},
}
ON_REQUEST = ("cuda-mma", "cuda-wgmma-rows64", "cuda-wgmma-rows128")  # timed only where --impls names them

# Our implementations, in the report's column order: a wrong result or an exception from one of these fails the
# bench (-rows: lora_expand's rows form).
OURS = ("cpu", "cuda", *FORCED_PREFILL, "cpu-rows", "cuda-rows", "triton", "triton-rows")
