// CPU reference kernels: plain C++ over the params structs, parallel over (segment, row block).
#pragma once
#include "../common/params.h"

namespace lora_ops::cpu {

void sgmv(const SgmvParams& p);
void lora_expand(const ExpandParams& p);
void grouped_gemm(const GroupedGemmParams& p);
void build_segments(const BuildSegmentsParams& p);

}  // namespace lora_ops::cpu
