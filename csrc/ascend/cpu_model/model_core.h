// Runtime of the CPU model of the AscendC API (910B, NPU arch 2201): cores and their local memories, the
// scheduler that runs the AI cores one after another, global-memory bounds, and the pipeline hazard checker.
//
// Hazards. Every instruction runs on one pipe (S, V, M, MTE1, MTE2, MTE3, FIX) of one core. Each pipe keeps a
// vector clock over all (core, pipe) agents of the launch: what it knows to have completed. SetFlag/WaitFlag,
// queue EnQue/DeQue and FreeTensor/AllocTensor, PipeBarrier and CrossCoreSetFlag/WaitFlag move that knowledge
// along exactly as the hardware orders execution. Every 32-byte block of local memory (and every element of a
// written global buffer) remembers its last writer and readers; an access that is not ordered after them by that
// knowledge fails with a message naming both instructions. So a missing sync fails deterministically on the CPU
// even though the model executes each instruction to completion when it is issued.
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

// Kernel types, as kernel_utils_macros.h declares them.
enum KernelMetaType : uint8_t {
  KERNEL_TYPE_AIV_ONLY,
  KERNEL_TYPE_AIC_ONLY,
  KERNEL_TYPE_MIX_AIV_1_0,
  KERNEL_TYPE_MIX_AIC_1_0,
  KERNEL_TYPE_MIX_AIC_1_1,
  KERNEL_TYPE_MIX_AIC_1_2,
  KERNEL_TYPE_AICORE,
  KERNEL_TYPE_VECTORCORE,
  KERNEL_TYPE_MIX_AICORE,
  KERNEL_TYPE_MIX_VECTOR_CORE,
  KERNEL_TYPE_MAX,
};

// Hardware pipes, a compiler built-in on the device.
enum pipe_t : uint8_t { PIPE_S, PIPE_V, PIPE_M, PIPE_MTE1, PIPE_MTE2, PIPE_MTE3, PIPE_ALL, PIPE_FIX };

namespace AscendC::cpu_model {

class ModelError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// Throws ModelError naming the running core. Every API misuse the model detects ends here.
[[noreturn]] void Fail(const std::string& what);

enum class Mem : uint8_t { UB, L1, L0A, L0B, L0C };
constexpr int kMemCount = 5;

struct MemSpec {
  const char* name;
  uint32_t bytes;   // physical size
  uint32_t usable;  // what TPipe may hand out (the rest is reserved by the framework)
  uint32_t align;   // buffer start alignment
};

// NPU arch 2201 (Atlas A2/A3, "910B"): the per-core buffers and their reserved parts (asc-devkit, NPU架构版本2201).
constexpr MemSpec kMemSpec[kMemCount] = {
    {"UB", 192 * 1024, 192 * 1024 - 256 - 8 * 1024, 32},
    {"L1", 512 * 1024, 512 * 1024 - 256, 32},
    {"L0A", 64 * 1024, 64 * 1024, 512},
    {"L0B", 64 * 1024, 64 * 1024, 512},
    {"L0C", 128 * 1024, 128 * 1024, 64},
};

// Model pipe indices; PipeIndex maps a pipe_t (PIPE_ALL excluded).
enum PipeId : int { kPipeS, kPipeV, kPipeM, kPipeMte1, kPipeMte2, kPipeMte3, kPipeFix, kPipeCount };
int PipeIndex(pipe_t p);
const char* PipeName(int pipe);

enum class CoreType : uint8_t { AIC, AIV };

using Clock = std::vector<uint32_t>;

// One ordering event handed from a producer to a consumer: what the producer knew when it was recorded.
struct SyncToken {
  Clock clock;
};

class Machine;

class Core {
 public:
  Core(Machine& machine, int index, CoreType type, int block, int sub);
  void InitClocks(int num_agents);

  Machine& machine;
  const int index, block, sub;
  const CoreType type;

  std::string Name() const;
  bool Has(Mem m) const;
  // Pointer to [addr, addr + bytes) of a local memory, allocated and poisoned (0xFF: NaN in every float format)
  // on first use; fails when the range leaves the memory.
  uint8_t* Bytes(Mem m, uint64_t addr, uint64_t bytes);

  // Starts an instruction on `pipe` and returns its time on that pipe.
  uint32_t Issue(int pipe);
  // Hazard checks of an instruction (pipe, time) on a local range.
  void Read(int pipe, uint32_t time, Mem m, uint64_t addr, uint64_t bytes);
  void Write(int pipe, uint32_t time, Mem m, uint64_t addr, uint64_t bytes);
  // RAW on L0C between accumulating Mmads: ordered only after PipeBarrier<PIPE_M> unless the tile is large.
  void ReadAccumulator(uint32_t time, uint64_t addr, uint64_t bytes, bool large_tile);

  // Whether `pipe` is ordered after `agent`'s instruction at `time`. A pipe pair the compiler syncs on its own
  // (see AutoSynced) gets that sync here: `pipe` learns all `agent` has done.
  bool Knows(int pipe, int agent, uint32_t time);
  int Agent(int pipe) const;

  SyncToken Record(int pipe) const;  // everything `pipe` knows, including all its own issued instructions
  void Merge(int pipe, const SyncToken& token);
  void Barrier(int pipe);  // PipeBarrier<pipe>
  void BarrierAll();       // PipeBarrier<PIPE_ALL>

  // SetFlag/WaitFlag state per (src pipe, dst pipe, event id).
  void SetEvent(int src, int dst, int id);
  void WaitEvent(int src, int dst, int id);
  // End of the kernel on this core: every SetFlag was waited.
  void Finish();

 private:
  struct Shadow {
    uint32_t write_time = 0;
    uint8_t write_pipe = 0;
    uint32_t read_time[kPipeCount] = {};
  };
  bool AutoSynced(int a, int b) const;
  bool Ordered(int pipe, int writer_pipe, uint32_t write_time);
  void Check(int pipe, uint32_t time, Mem m, uint64_t addr, uint64_t bytes, bool write);

  std::vector<uint8_t> mem_[kMemCount];
  std::vector<Shadow> shadow_[kMemCount];
  std::vector<Clock> clock_;  // [pipe] -> clock over all agents
  uint32_t issued_[kPipeCount] = {};
  struct Event {
    bool set = false;
    SyncToken token;
  };
  std::vector<Event> events_;  // [src][dst][id]
};

// The core running on this thread (fails outside a launch).
Core& Current();

// A global-memory buffer a kernel may touch: `rows` rows of `row_bytes` bytes, `row_stride` bytes apart.
struct GmRegion {
  const uint8_t* base;
  uint64_t rows, row_stride, row_bytes;
  uint32_t elem_bytes;
  bool writable;
  std::string name;
};

// Declares a buffer for the next launch on this thread. Accesses outside every declared buffer fail, writes to a
// read-only one fail, and the elements of writable ones are hazard-tracked across cores.
void DeclareGm(const GmRegion& region);

// GM access by an instruction on the current core: bounds, then hazards.
void AccessGm(int pipe, uint32_t time, const void* ptr, uint64_t bytes, bool write);

// Runs `body` once per AI core of a `type` launch with `block_dim` blocks (MIX_AIC_1_2: one AIC and two AIVs per
// block), one core after another: a core runs until it finishes or waits on a cross-core flag that is not set.
// Throws ModelError with the first failure (or a deadlock).
void Launch(KernelMetaType type, uint32_t block_dim, const std::function<void()>& body);

// Kernel-side hooks.
void CheckKernelType(KernelMetaType type);  // KERNEL_TASK_TYPE_DEFAULT must match the launch
int64_t BlockIdx();
int64_t BlockNum();
int64_t SubBlockIdx();
int64_t SubBlockNum();
void CrossCoreSet(uint8_t mode, int pipe, uint16_t flag);
void CrossCoreWait(uint16_t flag);

}  // namespace AscendC::cpu_model
