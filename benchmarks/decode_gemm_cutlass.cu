// The decode GEMM y = x . W^T (bf16, T <= 128 tokens) on CUTLASS 3.x's sm_90 warp-specialized kernels (TMA +
// wgmma, persistent CTAs), shaped like cuBLAS's nvjet kernels for these sizes (csrc/cuda/NOTES.md, session 15):
// W's rows as the GEMM's M (A = W [N, K], K-major), the tokens as its N (B = x [T, K], K-major), D = y^T (y [T, N]
// row-major is D column-major), tiles 64-128 W rows x 32-128 tokens, clusters of 2 along M (x multicast to both
// CTAs), split-K with CUTLASS's deterministic (turnstile) reduction where the tiles alone do not fill the GPU.
// The LoRA variants add each token's h . B_slot^T in the epilogue (a custom epilogue visitor node, Sm90LoraTerm;
// B read once per W tile and slot), in two modes:
//   given h (dgc_run_lora): h [T, R] float32 from elsewhere: what the epilogue costs over the plain GEMM;
//   fold (dgc_run_fold): the GEMM runs over [A of every slot; W] (M = S*R + N), so its first M tiles are h^T. The
//     tile scheduler rasters along N, so those tiles are the first work of as many CTAs (all resident: the grid
//     is persistent), whose epilogue writes h (float32) and counts its threads in; the W tiles' epilogues wait for
//     every h thread before reading h (acquire), add scale * h[n, slot window] . B[slot][m]^T, and the last W
//     thread resets the counters for the next launch (graph replay). One launch per linear layer.
// (NOTES, session 15.)
// A plain C ABI, so that decode_gemm_probe.py loads it with ctypes whatever torch the GPU machine has:
//   CUTLASS=$(python -c "import cutlass_library, os; print(os.path.dirname(cutlass_library.__file__))")/source
//   nvcc -std=c++17 -O3 -arch=sm_90a --expt-relaxed-constexpr -shared -Xcompiler -fPIC -I$CUTLASS/include \
//     -o build/decode_gemm_cutlass.so benchmarks/decode_gemm_cutlass.cu
#ifndef NDEBUG
#define NDEBUG
#endif
#include <cuda_runtime.h>

#include <vector>

#include <cute/tensor.hpp>
#include <cutlass/cutlass.h>
#include <cutlass/epilogue/collective/collective_builder.hpp>
#include <cutlass/gemm/collective/collective_builder.hpp>
#include <cutlass/gemm/device/gemm_universal_adapter.h>
#include <cutlass/gemm/dispatch_policy.hpp>
#include <cutlass/gemm/group_array_problem_shape.hpp>
#include <cutlass/gemm/kernel/gemm_universal.hpp>

namespace dgc {  // named: an anonymous namespace next to cute's collides in nvcc's host stub

using cute::_1;
using cute::_128;
using cute::_2;
using cute::_32;
using cute::_64;
using cute::Int;
using cute::make_shape;
using cute::Shape;
using T = cutlass::bfloat16_t;
constexpr int kAlign = 8;  // elements per 16 bytes

struct Coop {
  using Mainloop = cutlass::gemm::KernelTmaWarpSpecializedCooperative;
  using Epilogue = cutlass::epilogue::TmaWarpSpecializedCooperative;
};
struct Pingpong {
  using Mainloop = cutlass::gemm::KernelTmaWarpSpecializedPingpong;
  using Epilogue = cutlass::epilogue::TmaWarpSpecialized;
};

// What the LoRA epilogue reads: token n's slot, its h (float32) at h[n * ld_h + slot * h_slot_stride + j], and
// B[slot][m - h_rows, :rank].
struct LoraParams {
  const int* token_slot;  // [T]; a slot outside [0, num_slots) adds nothing
  float* h;               // given mode: [T, rank] read; fold mode: [T, h_rows] written by the h tiles, then read
  const T* lora_b;        // [num_slots, N, >= rank], rows 16-byte aligned
  int64_t ld_h, h_slot_stride, b_stride_slot, b_stride_row;
  int rank;  // a multiple of 8
  int num_slots;
  float scale;
  // fold mode (h_rows > 0, a multiple of the tile's M): the first h_rows rows of the GEMM's M are h^T
  int h_rows;
  // grouped fold mode (h_groups > 0): a grouped GEMM whose groups 0 .. h_groups - 1 are the slots' h^T (rank rows
  // each, empty for a slot no token uses) and whose group h_groups is W
  int h_groups;
  int* counters;     // [2], zero before the first launch: h threads arrived, W threads done
  int h_arrivals;    // h tiles x epilogue warps per tile (lane 0 of each warp arrives)
  int w_arrivals;    // W tiles x epilogue warps per tile
  const int* h_arrivals_dev;  // grouped fold with the device prep: h_arrivals as written by the prep kernel
};

__device__ __forceinline__ uint64_t global_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__device__ __forceinline__ int load_acquire(const int* p) {
  int v;
  asm volatile("ld.acquire.gpu.global.b32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

// An epilogue visitor leaf: for each output element (m = W's row, n = token) of this thread's fragment, the dot of
// h[n, window] with B[slot(n)][m, :rank], read from global memory (L1 serves the rows a tile's tokens share).
struct Sm90LoraTerm {
  struct SharedStorage {};
  using Arguments = LoraParams;
  using Params = LoraParams;

  template <class ProblemShape>
  static constexpr Params to_underlying_arguments(ProblemShape const&, Arguments const& args, void*) {
    return args;
  }
  template <class ProblemShape>
  static bool can_implement(ProblemShape const&, Arguments const& args) {
    return args.rank % 8 == 0;
  }
  template <class ProblemShape>
  static size_t get_workspace_size(ProblemShape const&, Arguments const&) {
    return 0;
  }
  template <class ProblemShape>
  static cutlass::Status initialize_workspace(ProblemShape const&, Arguments const&, void*, cudaStream_t,
                                              cutlass::CudaHostAdapter* = nullptr) {
    return cutlass::Status::kSuccess;
  }
  CUTLASS_DEVICE bool is_producer_load_needed() const { return false; }
  CUTLASS_DEVICE bool is_C_load_needed() const { return false; }

  CUTLASS_HOST_DEVICE Sm90LoraTerm() {}
  CUTLASS_HOST_DEVICE Sm90LoraTerm(Params const& params, SharedStorage const&) : params(params) {}
  Params params;

  template <class... Args>
  CUTLASS_DEVICE auto get_producer_load_callbacks(cutlass::epilogue::fusion::ProducerLoadArgs<Args...> const&) {
    return cutlass::epilogue::fusion::EmptyProducerLoadCallbacks{};
  }

  template <class CTensor, class Residue>
  struct ConsumerStoreCallbacks : cutlass::epilogue::fusion::EmptyConsumerStoreCallbacks {
    CUTLASS_DEVICE ConsumerStoreCallbacks(CTensor coords, Residue residue, int m0, int n0, bool h_tile, bool counted,
                                          int group, Params const& params)
        : coords(coords), residue(residue), m0(m0), n0(n0), h_tile(h_tile), counted(counted), group(group),
          params(params) {}
    CTensor coords;  // (CPY, CPY_M, CPY_N, EPI_M, EPI_N): offsets from this thread's first element
    Residue residue;
    int m0, n0;      // this thread's first element, in the problem
    bool h_tile;     // fold mode: this tile's rows are h^T
    bool counted;    // the tile starts inside the problem (a scheduler's padding tile, if any, does not arrive)
    int group;       // grouped fold mode: the slot of an h tile
    Params const& params;

    CUTLASS_DEVICE bool folded() const { return params.h_rows > 0 || params.h_groups > 0; }

    // Wait for every h tile's warps (lane 0 polls; __syncwarp orders the warp's later loads after its acquire). A
    // padding tile (no element inside the problem) neither waits nor arrives. The wait gives up after 0.2 s (a
    // probe must not hang the device: the results are then wrong, and the error check says so).
    CUTLASS_DEVICE void begin() {
      if (folded() && !h_tile && counted) {
        if (threadIdx.x % 32 == 0) {
          const uint64_t start = global_ns();
          const int target = params.h_arrivals_dev ? *params.h_arrivals_dev : params.h_arrivals;
          while (load_acquire(params.counters) < target && global_ns() - start < 200000000ull) {
            __nanosleep(64);
          }
        }
        __syncwarp();
      }
    }

    CUTLASS_DEVICE void end() {
      if (!folded() || !counted) return;
      __syncwarp();  // the warp's h stores (h tile) or h loads (W tile) are done
      if (threadIdx.x % 32 != 0) return;
      if (h_tile) {
        __threadfence();
        atomicAdd(params.counters, 1);
      } else if (atomicAdd(params.counters + 1, 1) == params.w_arrivals - 1) {
        // the last W warp: every other W warp is past its wait and every h warp has arrived
        params.counters[0] = 0;
        params.counters[1] = 0;
        __threadfence();
      }
    }

    template <typename ElementAccumulator, int FragmentSize>
    CUTLASS_DEVICE cutlass::Array<float, FragmentSize> visit(
        cutlass::Array<ElementAccumulator, FragmentSize> const& frg_acc, int epi_v, int epi_m, int epi_n) {
      cutlass::Array<float, FragmentSize> out;
      auto coords_mn = coords(cute::_, cute::_, cute::_, epi_m, epi_n);
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < FragmentSize; ++i) {
        const auto c = coords_mn(epi_v * FragmentSize + i);
        float sum = 0.f;
        if (cute::elem_less(c, residue)) {
          const int m = m0 + int(cute::get<0>(c)), n = n0 + int(cute::get<1>(c));
          if (h_tile) {
            // D's rows here are h^T (D gets acc + 0); grouped: group = the slot, m its rank row
            params.h[n * params.ld_h + group * params.h_slot_stride + m] = float(frg_acc[i]);
          } else {
            const int slot = params.token_slot[n];
            if (slot >= 0 && slot < params.num_slots) {
              const T* b = params.lora_b + slot * params.b_stride_slot + (m - params.h_rows) * params.b_stride_row;
              // (grouped: h_rows = 0, m is W's row)
              const float* h = params.h + n * params.ld_h + slot * params.h_slot_stride;
              for (int r = 0; r < params.rank; r += 8) {
                const uint4 raw = *reinterpret_cast<const uint4*>(b + r);
                const T* bv = reinterpret_cast<const T*>(&raw);
                const float4 h0 = __ldcg(reinterpret_cast<const float4*>(h + r));  // L2: written in this launch
                const float4 h1 = __ldcg(reinterpret_cast<const float4*>(h + r + 4));
                sum += float(bv[0]) * h0.x + float(bv[1]) * h0.y + float(bv[2]) * h0.z + float(bv[3]) * h0.w +
                       float(bv[4]) * h1.x + float(bv[5]) * h1.y + float(bv[6]) * h1.z + float(bv[7]) * h1.w;
              }
              sum *= params.scale;
            }
          }
        }
        out[i] = sum;
      }
      return out;
    }
  };

  template <bool ReferenceSrc, class... Args>
  CUTLASS_DEVICE auto get_consumer_store_callbacks(cutlass::epilogue::fusion::ConsumerStoreArgs<Args...> const& args) {
    const int m0 = int(cute::get<0>(args.problem_shape_mnkl)) - int(cute::get<0>(args.residue_tCcD));
    const int n0 = int(cute::get<1>(args.problem_shape_mnkl)) - int(cute::get<1>(args.residue_tCcD));
    const int tile_m0 = int(cute::get<0>(args.tile_coord_mnkl)) * int(cute::get<0>(args.tile_shape_mnk));
    const int tile_n0 = int(cute::get<1>(args.tile_coord_mnkl)) * int(cute::get<1>(args.tile_shape_mnk));
    const bool counted = tile_m0 < int(cute::get<0>(args.problem_shape_mnkl)) &&
                         tile_n0 < int(cute::get<1>(args.problem_shape_mnkl));
    const int group = params.h_groups > 0 ? int(cute::get<3>(args.tile_coord_mnkl)) : 0;
    const bool h_tile = params.h_groups > 0 ? group < params.h_groups : tile_m0 < params.h_rows;
    return ConsumerStoreCallbacks<decltype(args.tCcD), decltype(args.residue_tCcD)>(
        args.tCcD, args.residue_tCcD, m0, n0, h_tile, counted, group, params);
  }
};

// D = acc + the LoRA term, rounded once to bf16.
using LoraFusion = cutlass::epilogue::fusion::Sm90EVT<
    cutlass::epilogue::fusion::Sm90Compute<cutlass::plus, T, float, cutlass::FloatRoundStyle::round_to_nearest>,
    cutlass::epilogue::fusion::Sm90AccFetch, Sm90LoraTerm>;

// D = alpha * acc, no C (the builder's default fusion for a void C, named so that Gemm can default to it).
using PlainFusion = cutlass::epilogue::fusion::LinearCombination<T, float, void, float>;

// The collectives of every configuration, dense or ptr-array (grouped): A = the weight rows (RowMajor), B = x (the
// ColumnMajor K x N view of [T, K]), D column-major (y [T, M] row-major); the ptr-array kernels take each layout
// as a pointer type.
template <class Tile, class Cluster, class Schedule, class Fusion, bool kPtrArray>
struct Collectives {
  template <class L>
  using Layout = std::conditional_t<kPtrArray, L*, L>;
  using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Tile, Cluster,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float, void, Layout<cutlass::layout::ColumnMajor>,
      kAlign, T, Layout<cutlass::layout::ColumnMajor>, kAlign, typename Schedule::Epilogue, Fusion>::CollectiveOp;
  using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, T, Layout<cutlass::layout::RowMajor>, kAlign, T,
      Layout<cutlass::layout::ColumnMajor>, kAlign, float, Tile, Cluster,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(sizeof(typename Epilogue::SharedStorage))>,
      typename Schedule::Mainloop>::CollectiveOp;
  // threads that store each tile: both consumer warpgroups (cooperative) or one (ping-pong)
  static constexpr int kEpilogueWarps = int(cute::size(typename Mainloop::TiledMma{})) / 32;
};

template <class Tile, class Cluster, class Schedule, class Scheduler, class Fusion = PlainFusion>
struct Gemm : Collectives<Tile, Cluster, Schedule, Fusion, false> {
  using TileShape = Tile;
  using Base = Collectives<Tile, Cluster, Schedule, Fusion, false>;
  using Kernel = cutlass::gemm::kernel::GemmUniversal<Shape<int, int, int, int>, typename Base::Mainloop,
                                                      typename Base::Epilogue, Scheduler>;
  using Device = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
  static constexpr bool kStreamK = std::is_same_v<Scheduler, cutlass::gemm::StreamKScheduler>;
  static constexpr bool kLora = std::is_same_v<Fusion, LoraFusion>;
};

template <class G>
typename G::Device::Arguments arguments(const void* x, const void* w, void* y, int t, int n, int k, int splits,
                                       const LoraParams* lora) {
  using K = typename G::Kernel;
  typename G::Device::Arguments args{};
  args.mode = cutlass::gemm::GemmUniversalMode::kGemm;
  args.problem_shape = make_shape(n, t, k, 1);  // M = W's rows, N = tokens
  args.mainloop.ptr_A = static_cast<const T*>(w);
  args.mainloop.dA = typename K::StrideA{int64_t(k), Int<1>{}, int64_t(n) * k};
  args.mainloop.ptr_B = static_cast<const T*>(x);
  args.mainloop.dB = typename K::StrideB{int64_t(k), Int<1>{}, int64_t(t) * k};
  if constexpr (G::kLora) {
    args.epilogue.thread = {{}, *lora, {}};  // children in order (acc, LoRA term), then the node (plus)
  } else {
    args.epilogue.thread.alpha = 1.f;
    args.epilogue.thread.beta = 0.f;
  }
  args.epilogue.ptr_C = nullptr;
  args.epilogue.dC = typename K::StrideC{Int<1>{}, int64_t(n), int64_t(n) * t};
  args.epilogue.ptr_D = static_cast<T*>(y);
  args.epilogue.dD = typename K::StrideD{Int<1>{}, int64_t(n), int64_t(n) * t};
  int device = 0;
  cudaGetDevice(&device);
  args.hw_info = cutlass::KernelHardwareInfo::make_kernel_hardware_info<K>(device);
  if constexpr (G::kLora) {  // fold mode needs the h tiles (the first M tiles) first in every N column's order
    args.scheduler.raster_order = cutlass::gemm::kernel::detail::RasterOrderOptions::AlongN;
  }
  if constexpr (G::kStreamK) {
    using Mode = cutlass::gemm::kernel::detail::DecompositionMode;
    args.scheduler.splits = splits;
    args.scheduler.decomposition_mode = splits > 1 ? Mode::SplitK : Mode::DataParallel;
    args.scheduler.reduction_mode = cutlass::gemm::kernel::detail::ReductionMode::Deterministic;
  }
  return args;
}

// need != nullptr: only the workspace size. Returns 0 or a negative step number.
template <class G>
int run(const void* x, const void* w, void* y, int t, int n, int k, int splits, void* workspace, size_t bytes,
        cudaStream_t stream, size_t* need, const LoraParams* lora) {
  if (G::kLora && lora == nullptr) return -8;
  if (!G::kStreamK && splits != 1) return -5;  // no split-K scheduler
  LoraParams fold{};
  if (G::kLora && lora->h_rows > 0) {  // the arrivals each side waits for, in this configuration's tiles
    constexpr int kTileM = cute::size<0>(typename G::TileShape{}), kTileN = cute::size<1>(typename G::TileShape{});
    if (lora->h_rows % kTileM != 0 || splits != 1) return -7;
    const int n_tiles = (t + kTileN - 1) / kTileN;
    const int h_tiles = lora->h_rows / kTileM * n_tiles;
    fold = *lora;
    fold.h_arrivals = h_tiles * G::kEpilogueWarps;
    fold.w_arrivals = (n - lora->h_rows + kTileM - 1) / kTileM * n_tiles * G::kEpilogueWarps;
    lora = &fold;
  }
  auto args = arguments<G>(x, w, y, t, n, k, splits, lora);
  if (G::kLora && lora->h_rows > 0) {  // each h tile must be the first tile of a CTA of the (persistent) grid
    const dim3 grid = G::Device::get_grid_shape(args);
    if (lora->h_arrivals / G::kEpilogueWarps > int(grid.x * grid.y * grid.z)) return -6;
  }
  const size_t want = G::Device::get_workspace_size(args);
  if (need) return *need = want, 0;
  if (want > bytes) return -1;
  typename G::Device op;
  if (op.can_implement(args) != cutlass::Status::kSuccess) return -2;
  if (op.initialize(args, workspace, stream) != cutlass::Status::kSuccess) return -3;
  return op.run(stream) == cutlass::Status::kSuccess ? 0 : -4;
}

using Cluster2 = Shape<_2, _1, _1>;
using Cluster1 = Shape<_1, _1, _1>;
// CUTLASS 4.2's stream-K scheduler does not compile with CUTLASS_ENABLE_GDC_FOR_SM90 (its is_last_tile binds a
// const member to a non-const reference): that build's cooperative kernels are data-parallel, one K split only.
#ifdef CUTLASS_ENABLE_GDC_FOR_SM90
using SK = cutlass::gemm::PersistentScheduler;
#else
using SK = cutlass::gemm::StreamKScheduler;
#endif
using PS = cutlass::gemm::PersistentScheduler;
using Config0 = Gemm<Shape<_128, _32, _64>, Cluster2, Coop, SK>;
using Config1 = Gemm<Shape<_128, _32, _64>, Cluster1, Coop, SK>;
using Config2 = Gemm<Shape<_64, _32, _64>, Cluster2, Pingpong, PS>;
using Config3 = Gemm<Shape<_128, _64, _64>, Cluster2, Coop, SK>;
using Config4 = Gemm<Shape<_128, _128, _64>, Cluster2, Coop, SK>;
using Config5 = Gemm<Shape<_64, _32, _64>, Cluster2, Pingpong, PS, LoraFusion>;
using Config6 = Gemm<Shape<_128, _32, _64>, Cluster1, Coop, SK, LoraFusion>;
using Config7 = Gemm<Shape<_128, _128, _64>, Cluster2, Coop, SK, LoraFusion>;
constexpr int kConfigs = 8;

// ---- The fold as a grouped GEMM: only the A of the slots present is read ----
// Groups 0 .. S-1: slot s's h^T = A_s . x^T (rank x T; empty where no token uses s), written by the epilogue as
// float32; group S: W . x^T + the LoRA term. The grouped scheduler hands out group 0's tiles first, so the h tiles
// are the first tiles of as many CTAs. The per-group arrays live on the device (graph-safe); here the host writes
// them once per input set (in the op, a prep kernel would, once per decode step for every layer).
using GroupShape = cutlass::gemm::GroupProblemShape<Shape<int, int, int>>;
struct PtrCoop {
  using Mainloop = cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperative;
  using Epilogue = cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative;
};
struct PtrPingpong {
  using Mainloop = cutlass::gemm::KernelPtrArrayTmaWarpSpecializedPingpong;
  using Epilogue = cutlass::epilogue::PtrArrayTmaWarpSpecializedPingpong;
};

template <class Tile, class Cluster, class Schedule>
struct GroupedFold : Collectives<Tile, Cluster, Schedule, LoraFusion, true> {
  using Base = Collectives<Tile, Cluster, Schedule, LoraFusion, true>;
  using Kernel = cutlass::gemm::kernel::GemmUniversal<GroupShape, typename Base::Mainloop, typename Base::Epilogue>;
  using Device = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
  using TileShape = Tile;
  static constexpr int kClusterM = cute::size<0>(Cluster{});  // the scheduler pads each group's M tiles to it
};
using GroupedFold0 = GroupedFold<Shape<_64, _32, _64>, Cluster2, PtrPingpong>;
using GroupedFold1 = GroupedFold<Shape<_128, _32, _64>, Cluster1, PtrCoop>;
constexpr int kGroupedConfigs = 2;

// The device arrays of one call, carved from one buffer.
template <class G>
struct GroupArrays {
  using K = typename G::Kernel;
  using MNK = typename GroupShape::UnderlyingProblemShape;
  MNK* shapes;
  const T** a;
  const T** b;
  T** d;
  typename K::InternalStrideA* stride_a;
  typename K::InternalStrideB* stride_b;
  typename K::InternalStrideD* stride_d;

  static size_t carve(int groups, unsigned char* base, GroupArrays* out) {
    size_t offset = 0;
    auto take = [&](auto*& ptr, size_t bytes) {
      using P = std::remove_reference_t<decltype(ptr)>;
      ptr = base ? reinterpret_cast<P>(base + offset) : nullptr;
      offset += (bytes + 127) / 128 * 128;
    };
    take(out->shapes, groups * sizeof(MNK));
    take(out->a, groups * sizeof(void*));
    take(out->b, groups * sizeof(void*));
    take(out->d, groups * sizeof(void*));
    take(out->stride_a, groups * sizeof(typename K::InternalStrideA));
    take(out->stride_b, groups * sizeof(typename K::InternalStrideB));
    take(out->stride_d, groups * sizeof(typename K::InternalStrideD));
    take(out->h_arrivals, sizeof(int));
    return offset;
  }
  int* h_arrivals;  // written by grouped_prep_kernel
};

// Once per decode step in the op (here: before each GEMM, the worst case): which slots the tokens use, from the
// token slots on the device, as the h groups' problem shapes (rank x T x K, or empty), and how many h-tile warps
// the W tiles wait for. One CTA; slots <= 1024.
template <class G>
__global__ void grouped_prep_kernel(GroupArrays<G> arr, const int* token_slot, int t, int k, int rank, int slots,
                                    int arrivals_per_slot) {
  __shared__ int present[1024];
  __shared__ int count;
  for (int s = threadIdx.x; s < slots; s += blockDim.x) present[s] = 0;
  if (threadIdx.x == 0) count = 0;
  __syncthreads();
  for (int i = threadIdx.x; i < t; i += blockDim.x) {
    const int s = token_slot[i];
    if (s >= 0 && s < slots) present[s] = 1;
  }
  __syncthreads();
  using MNK = typename GroupArrays<G>::MNK;
  for (int s = threadIdx.x; s < slots; s += blockDim.x) {
    arr.shapes[s] = present[s] ? MNK(rank, t, k) : MNK(0, 0, 0);
    if (present[s]) atomicAdd(&count, 1);
  }
  __syncthreads();
  if (threadIdx.x == 0) *arr.h_arrivals = count * arrivals_per_slot;
}

template <class G>
typename G::Device::Arguments grouped_arguments(const GroupArrays<G>& arr, int groups, const LoraParams* lora) {
  typename G::Device::Arguments args{};
  args.mode = cutlass::gemm::GemmUniversalMode::kGrouped;
  args.problem_shape = GroupShape{groups, arr.shapes, nullptr};
  args.mainloop.ptr_A = arr.a;
  args.mainloop.dA = arr.stride_a;
  args.mainloop.ptr_B = arr.b;
  args.mainloop.dB = arr.stride_b;
  args.epilogue.thread = {{}, *lora, {}};
  args.epilogue.ptr_C = nullptr;
  args.epilogue.dC = arr.stride_d;
  args.epilogue.ptr_D = arr.d;
  args.epilogue.dD = arr.stride_d;
  int device = 0;
  cudaGetDevice(&device);
  args.hw_info = cutlass::KernelHardwareInfo::make_kernel_hardware_info<typename G::Kernel>(device);
  return args;
}

// Host: the arrays for x [T, K], A of the slots [S, rank, K] (contiguous), W [N, K], y [T, N], d_scratch
// [S, T, rank] (the h groups' D, unused), present[S] (0/1) into `arrays` (device; arrays_bytes from need).
template <class G>
int grouped_setup(const void* x, const void* a_slots, const void* w, void* y, void* d_scratch, int t, int n, int k,
                  int rank, int slots, const int* present, void* arrays, size_t bytes, size_t* need) {
  using K = typename G::Kernel;
  const int groups = slots + 1;
  GroupArrays<G> none{};
  const size_t used = GroupArrays<G>::carve(groups, nullptr, &none);
  if (need) return *need = used, 0;
  if (used > bytes) return -1;
  std::vector<unsigned char> host(used);
  GroupArrays<G> h{};
  GroupArrays<G>::carve(groups, host.data(), &h);
  const T* xa = static_cast<const T*>(x);
  for (int g = 0; g < groups; ++g) {
    const bool w_group = g == slots;
    const int m = w_group ? n : (present[g] ? rank : 0);
    h.shapes[g] = typename GroupArrays<G>::MNK(m, m ? t : 0, m ? k : 0);
    h.a[g] = w_group ? static_cast<const T*>(w) : static_cast<const T*>(a_slots) + int64_t(g) * rank * k;
    h.b[g] = xa;
    h.d[g] = w_group ? static_cast<T*>(y) : static_cast<T*>(d_scratch) + int64_t(g) * t * rank;
    h.stride_a[g] = typename K::InternalStrideA{int64_t(k), Int<1>{}, cute::Int<0>{}};
    h.stride_b[g] = typename K::InternalStrideB{int64_t(k), Int<1>{}, cute::Int<0>{}};
    h.stride_d[g] = typename K::InternalStrideD{Int<1>{}, int64_t(w_group ? n : rank), cute::Int<0>{}};
  }
  return cudaMemcpy(arrays, host.data(), used, cudaMemcpyHostToDevice) == cudaSuccess ? 0 : -2;
}

// present_count < 0: the device prep kernel runs first and decides (from the token slots).
template <class G>
int grouped_run(void* arrays, int slots, int t, int n, int k, void* workspace, size_t bytes, cudaStream_t stream,
                const LoraParams& lora_in, int present_count, size_t* need) {
  const int groups = slots + 1;
  GroupArrays<G> arr{};
  GroupArrays<G>::carve(groups, static_cast<unsigned char*>(arrays), &arr);
  constexpr int kTileM = cute::size<0>(typename G::TileShape{}), kTileN = cute::size<1>(typename G::TileShape{});
  LoraParams lora = lora_in;
  if (lora.rank > kTileM) return -7;  // one real M tile per present slot
  const int n_tiles = (t + kTileN - 1) / kTileN;
  const bool device_prep = present_count < 0;
  lora.h_arrivals = (device_prep ? 0 : present_count) * n_tiles * G::kEpilogueWarps;
  lora.h_arrivals_dev = device_prep ? arr.h_arrivals : nullptr;
  lora.w_arrivals = (n + kTileM - 1) / kTileM * n_tiles * G::kEpilogueWarps;
  if (device_prep && slots > 1024) return -7;
  auto args = grouped_arguments<G>(arr, groups, &lora);
  const size_t want = G::Device::get_workspace_size(args);
  if (need) return *need = want, 0;
  if (want > bytes) return -1;
  const dim3 grid = G::Device::get_grid_shape(args);
  // every h tile (and a cluster's padding tiles beside it) must be the first tile of a CTA of the persistent grid
  // (with the device prep, for every slot present: the host does not know which are)
  if (G::kClusterM * (device_prep ? slots : present_count) * n_tiles > int(grid.x * grid.y * grid.z)) return -6;
  if (device_prep) {
    grouped_prep_kernel<G><<<1, 256, 0, stream>>>(arr, lora.token_slot, t, k, lora.rank, slots,
                                                  n_tiles * G::kEpilogueWarps);
    if (cudaGetLastError() != cudaSuccess) return -5;
  }
  typename G::Device op;
  if (op.can_implement(args) != cutlass::Status::kSuccess) return -2;
  if (op.initialize(args, workspace, stream) != cutlass::Status::kSuccess) return -3;
  return op.run(stream) == cutlass::Status::kSuccess ? 0 : -4;
}

int dispatch(int config, const void* x, const void* w, void* y, int t, int n, int k, int splits, void* workspace,
             size_t bytes, cudaStream_t stream, size_t* need, const LoraParams* lora) {
  switch (config) {
    case 0: return run<Config0>(x, w, y, t, n, k, splits, workspace, bytes, stream, need, lora);
    case 1: return run<Config1>(x, w, y, t, n, k, splits, workspace, bytes, stream, need, lora);
    case 2: return run<Config2>(x, w, y, t, n, k, splits, workspace, bytes, stream, need, lora);
    case 3: return run<Config3>(x, w, y, t, n, k, splits, workspace, bytes, stream, need, lora);
    case 4: return run<Config4>(x, w, y, t, n, k, splits, workspace, bytes, stream, need, lora);
    case 5: return run<Config5>(x, w, y, t, n, k, splits, workspace, bytes, stream, need, lora);
    case 6: return run<Config6>(x, w, y, t, n, k, splits, workspace, bytes, stream, need, lora);
    case 7: return run<Config7>(x, w, y, t, n, k, splits, workspace, bytes, stream, need, lora);
    default: return -9;
  }
}

}  // namespace dgc

extern "C" {
// What each config is, for the probe's report; configs from 5 on take the LoRA epilogue (dgc_run_lora).
const char* dgc_config_name(int config) {
  static const char* names[] = {"coop 128x32 cluster 2",        "coop 128x32 cluster 1",
                                "pingpong 64x32 cluster 2",     "coop 128x64 cluster 2",
                                "coop 128x128 cluster 2",       "pingpong 64x32 cluster 2 + LoRA",
                                "coop 128x32 cluster 1 + LoRA", "coop 128x128 cluster 2 + LoRA"};
  return config >= 0 && config < dgc::kConfigs ? names[config] : nullptr;
}
int dgc_lora_configs_from() { return 5; }
size_t dgc_workspace(int config, int t, int n, int k, int splits) {
  size_t need = 0;
  const dgc::LoraParams none{};
  dgc::dispatch(config, nullptr, nullptr, nullptr, t, n, k, splits, nullptr, 0, nullptr, &need, &none);
  return need;
}
int dgc_run(int config, const void* x, const void* w, void* y, int t, int n, int k, int splits, void* workspace,
            size_t bytes, void* stream) {
  return dgc::dispatch(config, x, w, y, t, n, k, splits, workspace, bytes, static_cast<cudaStream_t>(stream),
                       nullptr, nullptr);
}
int dgc_run_lora(int config, const void* x, const void* w, void* y, int t, int n, int k, int splits,
                 void* workspace, size_t bytes, void* stream, const int* token_slot, const float* h,
                 const void* lora_b, int64_t ld_h, int64_t b_stride_slot, int64_t b_stride_row, int rank,
                 int num_slots) {
  dgc::LoraParams lora{};
  lora.token_slot = token_slot;
  lora.h = const_cast<float*>(h);  // read only: h_rows = 0
  lora.lora_b = static_cast<const dgc::T*>(lora_b);
  lora.ld_h = ld_h;
  lora.b_stride_slot = b_stride_slot;
  lora.b_stride_row = b_stride_row;
  lora.rank = rank;
  lora.num_slots = num_slots;
  lora.scale = 1.f;
  return dgc::dispatch(config, x, w, y, t, n, k, splits, workspace, bytes, static_cast<cudaStream_t>(stream),
                       nullptr, &lora);
}
// Fold mode: w = [A of every slot (h_rows = slots x rank rows); W], y = [T, h_rows + N] (y's last N columns are the
// layer's output), h = float32 scratch [T, h_rows], counters = 2 ints, zero before the first launch.
int dgc_run_fold(int config, const void* x, const void* w, void* y, int t, int m, int k, void* workspace,
                 size_t bytes, void* stream, const int* token_slot, float* h, const void* lora_b,
                 int64_t b_stride_slot, int64_t b_stride_row, int rank, int num_slots, float scale, int h_rows,
                 int* counters) {
  dgc::LoraParams lora{};
  lora.token_slot = token_slot;
  lora.h = h;
  lora.lora_b = static_cast<const dgc::T*>(lora_b);
  lora.ld_h = h_rows;
  lora.h_slot_stride = rank;
  lora.b_stride_slot = b_stride_slot;
  lora.b_stride_row = b_stride_row;
  lora.rank = rank;
  lora.num_slots = num_slots;
  lora.scale = scale;
  lora.h_rows = h_rows;
  lora.counters = counters;
  return dgc::dispatch(config, x, w, y, t, m, k, 1, workspace, bytes, static_cast<cudaStream_t>(stream), nullptr,
                       &lora);
}
// The grouped fold (only the present slots' A): configs 0 = ping-pong 64x32 cluster 2, 1 = cooperative 128x32.
const char* dgc_grouped_name(int config) {
  static const char* names[] = {"pingpong 64x32 cluster 2 + LoRA, grouped fold",
                                "coop 128x32 cluster 1 + LoRA, grouped fold"};
  return config >= 0 && config < dgc::kGroupedConfigs ? names[config] : nullptr;
}
int dgc_grouped_setup(int config, const void* x, const void* a_slots, const void* w, void* y, void* d_scratch, int t,
                      int n, int k, int rank, int slots, const int* present, void* arrays, size_t bytes,
                      size_t* need) {
  switch (config) {
    case 0:
      return dgc::grouped_setup<dgc::GroupedFold0>(x, a_slots, w, y, d_scratch, t, n, k, rank, slots, present, arrays,
                                                   bytes, need);
    case 1:
      return dgc::grouped_setup<dgc::GroupedFold1>(x, a_slots, w, y, d_scratch, t, n, k, rank, slots, present, arrays,
                                                   bytes, need);
    default: return -9;
  }
}
// need != nullptr: only the workspace size (arrays must already be set up). present_count >= 0 must be the number
// of slots marked present at setup (the W tiles wait for that many slots' h tiles; more: they time out after
// 0.2 s); present_count < 0 runs the device prep kernel first, which rewrites the h groups' shapes and the count
// from token_slot (what the op would do).
int dgc_grouped_run(int config, void* arrays, int slots, int t, int n, int k, void* workspace, size_t bytes,
                    void* stream,
                    const int* token_slot, float* h, const void* lora_b, int64_t b_stride_slot, int64_t b_stride_row,
                    int rank, float scale, int present_count, int* counters, size_t* need) {
  dgc::LoraParams lora{};
  lora.token_slot = token_slot;
  lora.h = h;
  lora.lora_b = static_cast<const dgc::T*>(lora_b);
  lora.ld_h = int64_t(slots) * rank;
  lora.h_slot_stride = rank;
  lora.b_stride_slot = b_stride_slot;
  lora.b_stride_row = b_stride_row;
  lora.rank = rank;
  lora.num_slots = slots;
  lora.scale = scale;
  lora.h_groups = slots;
  lora.counters = counters;
  const auto s = static_cast<cudaStream_t>(stream);
  switch (config) {
    case 0:
      return dgc::grouped_run<dgc::GroupedFold0>(arrays, slots, t, n, k, workspace, bytes, s, lora, present_count,
                                                 need);
    case 1:
      return dgc::grouped_run<dgc::GroupedFold1>(arrays, slots, t, n, k, workspace, bytes, s, lora, present_count,
                                                 need);
    default: return -9;
  }
}
}
