#include "model_core.h"

#include <algorithm>
#include <condition_variable>
#include <cstdio>
#include <deque>
#include <mutex>
#include <thread>

namespace AscendC::cpu_model {
namespace {

constexpr int S = kPipeS, V = kPipeV, M = kPipeM, MTE1 = kPipeMte1, MTE2 = kPipeMte2, MTE3 = kPipeMte3, FIX = kPipeFix;
constexpr int kEventIds = 8, kCrossFlags = 16, kCrossCounterMax = 15;
constexpr uint64_t kBlock = 32;

bool IsDma(int pipe) { return pipe == MTE1 || pipe == MTE2 || pipe == MTE3 || pipe == FIX; }

std::string Hex(uint64_t v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "0x%llx", static_cast<unsigned long long>(v));
  return buf;
}

thread_local Core* t_core = nullptr;
thread_local std::vector<GmRegion> t_pending;

// Thrown into the cores still waiting when another one failed: unwinds them without a second error.
struct AbortSignal {};

struct GmShadow {
  uint32_t write_agent = 0;  // agent + 1; 0: not written in this launch
  uint32_t write_time = 0;
  uint32_t read_agent[2] = {0, 0};
  uint32_t read_time[2] = {0, 0};
};

}  // namespace

class Machine {
 public:
  Machine(KernelMetaType type, uint32_t block_dim, std::vector<GmRegion> regions);
  void Run(const std::function<void()>& body);
  void WaitUntil(Core& core, const std::function<bool()>& ready, const std::string& what);
  void CrossSet(Core& core, uint8_t mode, int pipe, uint16_t flag);
  void CrossWait(Core& core, uint16_t flag);
  void AccessGm(Core& core, int pipe, uint32_t time, const uint8_t* ptr, uint64_t bytes, bool write);

  const KernelMetaType type;
  const uint32_t block_dim;
  int num_agents = 0;

 private:
  struct CoreState {
    bool done = false;
    std::function<bool()> ready;  // set while waiting
    std::string waiting_for;
  };
  struct Flags {  // one block's cross-core flags (mode 2)
    std::deque<SyncToken> to_aic[kCrossFlags];
    std::deque<SyncToken> to_aiv[2][kCrossFlags];
    std::deque<SyncToken> from_aiv[2][kCrossFlags];  // an AIV's set, waiting for its partner's
  };
  void CoreMain(int i, const std::function<void()>& body);
  bool HandOff(int from);  // with mu_ held: picks the next runnable core; false on deadlock
  void RecordError(const std::string& what);
  std::string Deadlock() const;

  std::vector<std::unique_ptr<Core>> cores_;
  std::vector<GmRegion> regions_;
  std::vector<std::vector<GmShadow>> gm_shadow_;  // per writable region
  std::vector<Flags> flags_;

  std::mutex mu_;
  std::condition_variable cv_;
  int running_ = -1;
  bool abort_ = false;
  std::string error_;
  std::vector<CoreState> state_;
};

// ---------------------------------------------------------------------------------------------------- errors

void Fail(const std::string& what) { throw ModelError(t_core ? t_core->Name() + ": " + what : what); }

int PipeIndex(pipe_t p) {
  switch (p) {
    case PIPE_S: return S;
    case PIPE_V: return V;
    case PIPE_M: return M;
    case PIPE_MTE1: return MTE1;
    case PIPE_MTE2: return MTE2;
    case PIPE_MTE3: return MTE3;
    case PIPE_FIX: return FIX;
    default: Fail("PIPE_ALL is not a single pipe here");
  }
}

const char* PipeName(int pipe) {
  static const char* names[kPipeCount] = {"PIPE_S", "PIPE_V", "PIPE_M", "PIPE_MTE1", "PIPE_MTE2", "PIPE_MTE3",
                                          "PIPE_FIX"};
  return names[pipe];
}

Core& Current() {
  if (t_core == nullptr) throw ModelError("AscendC API called outside a kernel launch");
  return *t_core;
}

// ---------------------------------------------------------------------------------------------------- Core

Core::Core(Machine& machine, int index, CoreType type, int block, int sub)
    : machine(machine), index(index), block(block), sub(sub), type(type),
      events_(kPipeCount * kPipeCount * kEventIds) {}

std::string Core::Name() const {
  return (type == CoreType::AIC ? "AIC of block " : "AIV of block ") + std::to_string(block) +
         (type == CoreType::AIV ? "." + std::to_string(sub) : "");
}

bool Core::Has(Mem m) const { return type == CoreType::AIV ? m == Mem::UB : m != Mem::UB; }

uint8_t* Core::Bytes(Mem m, uint64_t addr, uint64_t bytes) {
  const int i = static_cast<int>(m);
  if (!Has(m)) Fail(std::string("an ") + (type == CoreType::AIC ? "AIC" : "AIV") + " core has no " + kMemSpec[i].name);
  if (addr + bytes > kMemSpec[i].bytes) {
    Fail(std::string(kMemSpec[i].name) + " access [" + Hex(addr) + ", " + Hex(addr + bytes) + ") exceeds its " +
         std::to_string(kMemSpec[i].bytes) + " bytes");
  }
  if (mem_[i].empty()) {
    mem_[i].assign(kMemSpec[i].bytes, 0xFF);
    shadow_[i].assign(kMemSpec[i].bytes / kBlock, Shadow{});
  }
  return mem_[i].data() + addr;
}

int Core::Agent(int pipe) const { return index * kPipeCount + pipe; }

void Core::InitClocks(int num_agents) { clock_.assign(kPipeCount, Clock(num_agents, 0)); }

uint32_t Core::Issue(int pipe) { return ++issued_[pipe]; }

// Pipe pairs whose syncs the compiler inserts on its own on an AIV (--cce-auto-sync, on by default): the scalar
// unit with V, MTE2 and MTE3. On the AIC it inserts none.
bool Core::AutoSynced(int a, int b) const {
  if (type != CoreType::AIV) return false;
  const int other = a == S ? b : (b == S ? a : -1);
  return other == V || other == MTE2 || other == MTE3;
}

bool Core::Knows(int pipe, int agent, uint32_t time) {
  if (agent == Agent(pipe)) {
    // In-order issue orders S, V (the compiler inserts PIPE_V barriers) and M; a DMA pipe's own transfers may
    // overlap until a PipeBarrier (or a sync from a pipe that saw them complete).
    return !IsDma(pipe) || clock_[pipe][agent] >= time;
  }
  if (agent / kPipeCount == index && AutoSynced(pipe, agent % kPipeCount)) {
    Merge(pipe, Record(agent % kPipeCount));  // the SetFlag/WaitFlag pair the compiler inserts
    return true;
  }
  return clock_[pipe][agent] >= time;
}

bool Core::Ordered(int pipe, int writer_pipe, uint32_t write_time) {
  return Knows(pipe, Agent(writer_pipe), write_time);
}

void Core::Check(int pipe, uint32_t time, Mem m, uint64_t addr, uint64_t bytes, bool write) {
  if (bytes == 0) return;
  Bytes(m, addr, bytes);
  auto& shadow = shadow_[static_cast<int>(m)];
  auto where = [&](uint64_t b) {
    return std::string(kMemSpec[static_cast<int>(m)].name) + "[" + Hex(b * kBlock) + ", " + Hex((b + 1) * kBlock) + ")";
  };
  for (uint64_t b = addr / kBlock; b <= (addr + bytes - 1) / kBlock; ++b) {
    Shadow& sh = shadow[b];
    // Readers first: a compiler-synced reader (see AutoSynced) may be what orders this write after the last one.
    for (int q = 0; write && q < kPipeCount; ++q) {
      if (q != pipe && sh.read_time[q] != 0 && !Ordered(pipe, q, sh.read_time[q])) {
        Fail("WAR hazard on " + where(b) + ": " + PipeName(pipe) + " #" + std::to_string(time) + " overwrites what " +
             PipeName(q) + " #" + std::to_string(sh.read_time[q]) + " reads, with no sync ordering them");
      }
    }
    if (sh.write_time != 0 && !Ordered(pipe, sh.write_pipe, sh.write_time)) {
      Fail(std::string(write ? "WAW" : "RAW") + " hazard on " + where(b) + ": " + PipeName(pipe) + " #" +
           std::to_string(time) + (write ? " overwrites" : " reads") + " what " + PipeName(sh.write_pipe) + " #" +
           std::to_string(sh.write_time) + " wrote, with no sync ordering them (SetFlag/WaitFlag, a queue, or " +
           "PipeBarrier)");
    }
    if (write) {
      sh = Shadow{};
      sh.write_time = time;
      sh.write_pipe = static_cast<uint8_t>(pipe);
    } else {
      sh.read_time[pipe] = time;
    }
  }
}

void Core::Read(int pipe, uint32_t time, Mem m, uint64_t addr, uint64_t bytes) {
  Check(pipe, time, m, addr, bytes, false);
}

void Core::Write(int pipe, uint32_t time, Mem m, uint64_t addr, uint64_t bytes) {
  Check(pipe, time, m, addr, bytes, true);
}

void Core::ReadAccumulator(uint32_t time, uint64_t addr, uint64_t bytes, bool large_tile) {
  Bytes(Mem::L0C, addr, bytes);
  if (!large_tile) {
    auto& shadow = shadow_[static_cast<int>(Mem::L0C)];
    for (uint64_t b = addr / kBlock; b <= (addr + bytes - 1) / kBlock; ++b) {
      if (shadow[b].write_time != 0 && shadow[b].write_pipe == M && clock_[M][Agent(M)] < shadow[b].write_time) {
        Fail("Mmad #" + std::to_string(time) + " accumulates into L0C[" + Hex(b * kBlock) + "] written by Mmad #" +
             std::to_string(shadow[b].write_time) + " without PipeBarrier<PIPE_M> between them (required when " +
             "(m/16)*(n/16) < 10)");
      }
    }
  }
  Read(M, time, Mem::L0C, addr, bytes);
}

SyncToken Core::Record(int pipe) const {
  SyncToken token{clock_[pipe]};
  token.clock[Agent(pipe)] = issued_[pipe];
  return token;
}

void Core::Merge(int pipe, const SyncToken& token) {
  Clock& c = clock_[pipe];
  for (size_t i = 0; i < c.size(); ++i) c[i] = std::max(c[i], token.clock[i]);
}

void Core::Barrier(int pipe) {
  Issue(pipe);
  clock_[pipe][Agent(pipe)] = issued_[pipe];
}

void Core::BarrierAll() {
  Issue(S);
  Clock all(machine.num_agents, 0);
  for (int p = 0; p < kPipeCount; ++p) {
    clock_[p][Agent(p)] = issued_[p];
    for (size_t i = 0; i < all.size(); ++i) all[i] = std::max(all[i], clock_[p][i]);
  }
  for (int p = 0; p < kPipeCount; ++p) clock_[p] = all;
}

void Core::SetEvent(int src, int dst, int id) {
  if (id < 0 || id >= kEventIds) Fail("event id " + std::to_string(id) + " outside [0, 8)");
  Issue(src);
  Event& e = events_[(src * kPipeCount + dst) * kEventIds + id];
  if (e.set) {
    Fail(std::string("SetFlag ") + PipeName(src) + "->" + PipeName(dst) + " id " + std::to_string(id) +
         " set twice without a WaitFlag in between");
  }
  e.set = true;
  e.token = Record(src);
}

void Core::WaitEvent(int src, int dst, int id) {
  if (id < 0 || id >= kEventIds) Fail("event id " + std::to_string(id) + " outside [0, 8)");
  Issue(dst);
  Event& e = events_[(src * kPipeCount + dst) * kEventIds + id];
  if (!e.set) {
    Fail(std::string("WaitFlag ") + PipeName(src) + "->" + PipeName(dst) + " id " + std::to_string(id) +
         " without a matching SetFlag: the pipe would stall forever");
  }
  e.set = false;
  Merge(dst, e.token);
}

void Core::Finish() {
  for (int src = 0; src < kPipeCount; ++src) {
    for (int dst = 0; dst < kPipeCount; ++dst) {
      for (int id = 0; id < kEventIds; ++id) {
        if (events_[(src * kPipeCount + dst) * kEventIds + id].set) {
          Fail(std::string("SetFlag ") + PipeName(src) + "->" + PipeName(dst) + " id " + std::to_string(id) +
               " was never waited before the kernel ended");
        }
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------------- Machine

Machine::Machine(KernelMetaType type, uint32_t block_dim, std::vector<GmRegion> regions)
    : type(type), block_dim(block_dim), regions_(std::move(regions)), flags_(block_dim) {
  for (uint32_t b = 0; b < block_dim; ++b) {
    const int next = static_cast<int>(cores_.size());
    switch (type) {
      case KERNEL_TYPE_AIV_ONLY: cores_.push_back(std::make_unique<Core>(*this, next, CoreType::AIV, b, 0)); break;
      case KERNEL_TYPE_AIC_ONLY: cores_.push_back(std::make_unique<Core>(*this, next, CoreType::AIC, b, 0)); break;
      case KERNEL_TYPE_MIX_AIC_1_2:
        cores_.push_back(std::make_unique<Core>(*this, next, CoreType::AIC, b, 0));
        cores_.push_back(std::make_unique<Core>(*this, next + 1, CoreType::AIV, b, 0));
        cores_.push_back(std::make_unique<Core>(*this, next + 2, CoreType::AIV, b, 1));
        break;
      default: throw ModelError("kernel type " + std::to_string(type) + " is not modelled");
    }
  }
  num_agents = static_cast<int>(cores_.size()) * kPipeCount;
  for (auto& core : cores_) core->InitClocks(num_agents);
  state_.resize(cores_.size());
  for (const GmRegion& r : regions_) {
    gm_shadow_.emplace_back(r.writable ? r.rows * (r.row_bytes / r.elem_bytes) : 0);
  }
}

void Machine::RecordError(const std::string& what) {
  std::lock_guard<std::mutex> lk(mu_);
  if (error_.empty()) error_ = what;
  abort_ = true;
  cv_.notify_all();
}

std::string Machine::Deadlock() const {
  std::string what = "deadlock: every unfinished core waits on a cross-core flag nobody will set:";
  for (size_t i = 0; i < cores_.size(); ++i) {
    if (!state_[i].done) what += " [" + cores_[i]->Name() + " in " + state_[i].waiting_for + "]";
  }
  return what;
}

bool Machine::HandOff(int from) {
  const int n = static_cast<int>(cores_.size());
  bool all_done = true;
  for (int k = 1; k <= n; ++k) {
    const int j = (from + k) % n;
    if (state_[j].done) continue;
    all_done = false;
    if (!state_[j].ready || state_[j].ready()) {
      running_ = j;
      cv_.notify_all();
      return true;
    }
  }
  if (all_done) {
    running_ = -1;
    cv_.notify_all();
    return true;
  }
  if (error_.empty()) error_ = Deadlock();
  abort_ = true;
  cv_.notify_all();
  return false;
}

void Machine::CoreMain(int i, const std::function<void()>& body) {
  {
    std::unique_lock<std::mutex> lk(mu_);
    cv_.wait(lk, [&] { return running_ == i || abort_; });
    if (abort_) {
      state_[i].done = true;
      return;
    }
  }
  t_core = cores_[i].get();
  try {
    body();
    cores_[i]->Finish();
  } catch (const AbortSignal&) {
  } catch (const std::exception& e) {
    RecordError(e.what());
  }
  t_core = nullptr;
  std::unique_lock<std::mutex> lk(mu_);
  state_[i].done = true;
  if (!abort_) HandOff(i);
}

void Machine::Run(const std::function<void()>& body) {
  std::vector<std::thread> threads;
  for (size_t i = 0; i < cores_.size(); ++i) threads.emplace_back([this, i, &body] { CoreMain(int(i), body); });
  {
    std::lock_guard<std::mutex> lk(mu_);
    running_ = 0;
    cv_.notify_all();
  }
  for (auto& t : threads) t.join();
  if (!error_.empty()) throw ModelError(error_);
  for (uint32_t b = 0; b < block_dim; ++b) {
    for (int f = 0; f < kCrossFlags; ++f) {
      bool left = !flags_[b].to_aic[f].empty();
      for (int s = 0; s < 2; ++s) left = left || !flags_[b].to_aiv[s][f].empty() || !flags_[b].from_aiv[s][f].empty();
      if (left) {
        throw ModelError("block " + std::to_string(b) + ": CrossCoreSetFlag(" + std::to_string(f) +
                         ") was never waited before the kernel ended");
      }
    }
  }
}

void Machine::WaitUntil(Core& core, const std::function<bool()>& ready, const std::string& what) {
  if (ready()) return;
  std::unique_lock<std::mutex> lk(mu_);
  state_[core.index].ready = ready;
  state_[core.index].waiting_for = what;
  HandOff(core.index);
  cv_.wait(lk, [&] { return running_ == core.index || abort_; });
  if (abort_) throw AbortSignal{};
  state_[core.index].ready = nullptr;
}

void Machine::CrossSet(Core& core, uint8_t mode, int pipe, uint16_t flag) {
  if (type != KERNEL_TYPE_MIX_AIC_1_2) {
    Fail("CrossCoreSetFlag needs a MIX kernel: AIC_ONLY/AIV_ONLY launches run without the cross-core scheduler");
  }
  if (mode != 2) Fail("CrossCoreSetFlag mode " + std::to_string(mode) + " is not modelled (only mode 2)");
  if (pipe == S) Fail("CrossCoreSetFlag does not take PIPE_S");
  if (flag >= kCrossFlags) Fail("cross-core flag " + std::to_string(flag) + " outside [0, 16)");
  core.Issue(pipe);
  SyncToken token = core.Record(pipe);
  Flags& fl = flags_[core.block];
  auto push = [&](std::deque<SyncToken>& q, SyncToken t) {
    if (q.size() >= kCrossCounterMax) Fail("cross-core flag " + std::to_string(flag) + " counter exceeds 15");
    q.push_back(std::move(t));
  };
  if (core.type == CoreType::AIC) {
    push(fl.to_aiv[0][flag], token);
    push(fl.to_aiv[1][flag], token);
    return;
  }
  push(fl.from_aiv[core.sub][flag], std::move(token));
  auto& mine = fl.from_aiv[0][flag];
  auto& other = fl.from_aiv[1][flag];
  if (!mine.empty() && !other.empty()) {
    SyncToken both = mine.front();
    for (size_t i = 0; i < both.clock.size(); ++i) both.clock[i] = std::max(both.clock[i], other.front().clock[i]);
    mine.pop_front();
    other.pop_front();
    push(fl.to_aic[flag], std::move(both));
  }
}

void Machine::CrossWait(Core& core, uint16_t flag) {
  if (flag >= kCrossFlags) Fail("cross-core flag " + std::to_string(flag) + " outside [0, 16)");
  Flags& fl = flags_[core.block];
  std::deque<SyncToken>& q = core.type == CoreType::AIC ? fl.to_aic[flag] : fl.to_aiv[core.sub][flag];
  WaitUntil(core, [&q] { return !q.empty(); }, "CrossCoreWaitFlag(" + std::to_string(flag) + ")");
  // On arch 2201 the wait blocks every pipe of the core.
  for (int p = 0; p < kPipeCount; ++p) {
    core.Issue(p);
    core.Merge(p, q.front());
  }
  q.pop_front();
}

void Machine::AccessGm(Core& core, int pipe, uint32_t time, const uint8_t* ptr, uint64_t bytes, bool write) {
  if (bytes == 0) return;
  for (size_t r = 0; r < regions_.size(); ++r) {
    const GmRegion& g = regions_[r];
    if (ptr < g.base) continue;
    const uint64_t off = static_cast<uint64_t>(ptr - g.base);
    const uint64_t row = g.rows > 1 ? off / g.row_stride : 0, col = off - row * g.row_stride;
    if (row >= g.rows || col + bytes > g.row_bytes) continue;
    if (write && !g.writable) Fail("writes the read-only global buffer '" + g.name + "'");
    if (!g.writable) return;
    if (col % g.elem_bytes != 0 || bytes % g.elem_bytes != 0) {
      Fail("access to '" + g.name + "' not aligned to its " + std::to_string(g.elem_bytes) + "-byte elements");
    }
    const int me = core.Agent(pipe);
    const uint64_t first = row * (g.row_bytes / g.elem_bytes) + col / g.elem_bytes;
    for (uint64_t e = first; e < first + bytes / g.elem_bytes; ++e) {
      GmShadow& sh = gm_shadow_[r][e];
      auto where = [&] { return "'" + g.name + "' element " + std::to_string(e); };
      for (int k = 0; write && k < 2; ++k) {
        if (sh.read_agent[k] != 0 && int(sh.read_agent[k] - 1) != me &&
            !core.Knows(pipe, int(sh.read_agent[k] - 1), sh.read_time[k])) {
          Fail("WAR hazard on " + where() + ": " + PipeName(pipe) + " of " + core.Name() +
               " overwrites it before a read by agent " + std::to_string(sh.read_agent[k] - 1) + " is known done");
        }
      }
      if (sh.write_agent != 0 && !core.Knows(pipe, int(sh.write_agent - 1), sh.write_time)) {
        Fail(std::string(write ? "WAW" : "RAW") + " hazard on " + where() + ": " + PipeName(pipe) + " of " +
             core.Name() + " is not ordered after the write by agent " + std::to_string(sh.write_agent - 1) +
             " (core " + std::to_string((sh.write_agent - 1) / kPipeCount) + ", " +
             PipeName(int(sh.write_agent - 1) % kPipeCount) + ")");
      }
      if (write) {
        sh = GmShadow{};
        sh.write_agent = uint32_t(me + 1);
        sh.write_time = time;
      } else {
        // Keep the last two readers (older ones are forgotten: a WAR race with three readers can go unnoticed).
        const int slot = sh.read_agent[0] == uint32_t(me + 1) || sh.read_agent[0] == 0 ? 0 : 1;
        if (slot == 1 && sh.read_agent[1] != 0 && sh.read_agent[1] != uint32_t(me + 1)) {
          sh.read_agent[0] = sh.read_agent[1];
          sh.read_time[0] = sh.read_time[1];
        }
        sh.read_agent[slot] = uint32_t(me + 1);
        sh.read_time[slot] = time;
      }
    }
    return;
  }
  Fail(std::string("global memory ") + (write ? "write" : "read") + " of " + std::to_string(bytes) +
       " bytes at " + Hex(reinterpret_cast<uintptr_t>(ptr)) + " is outside every buffer of the launch");
}

// ---------------------------------------------------------------------------------------------------- entry points

void DeclareGm(const GmRegion& region) {
  if (region.elem_bytes == 0 || region.row_bytes % region.elem_bytes != 0) {
    throw ModelError("DeclareGm('" + region.name + "'): row bytes must be a multiple of the element size");
  }
  if (region.rows > 0 && region.row_bytes > 0) t_pending.push_back(region);
}

void AccessGm(int pipe, uint32_t time, const void* ptr, uint64_t bytes, bool write) {
  Core& core = Current();
  core.machine.AccessGm(core, pipe, time, static_cast<const uint8_t*>(ptr), bytes, write);
}

void Launch(KernelMetaType type, uint32_t block_dim, const std::function<void()>& body) {
  std::vector<GmRegion> regions;
  regions.swap(t_pending);
  if (block_dim == 0) throw ModelError("kernel launched with block_dim 0");
  Machine machine(type, block_dim, std::move(regions));
  machine.Run(body);
}

void CheckKernelType(KernelMetaType type) {
  Core& core = Current();
  if (type != core.machine.type) {
    Fail("KERNEL_TASK_TYPE_DEFAULT(" + std::to_string(type) + ") differs from the launched kernel type " +
         std::to_string(core.machine.type));
  }
}

int64_t BlockIdx() {
  Core& c = Current();
  return c.type == CoreType::AIV && c.machine.type == KERNEL_TYPE_MIX_AIC_1_2 ? c.block * 2 + c.sub : c.block;
}

int64_t BlockNum() {
  Core& c = Current();
  if (c.type == CoreType::AIV && c.machine.type == KERNEL_TYPE_MIX_AIC_1_2) {
    Fail("GetBlockNum on an AIV of a MIX kernel: the docs leave open whether it counts AIVs or blocks; pass the "
         "block count in the tiling");
  }
  return c.machine.block_dim;
}

int64_t SubBlockIdx() { return Current().sub; }

int64_t SubBlockNum() {
  Core& c = Current();
  return c.type == CoreType::AIV && c.machine.type == KERNEL_TYPE_MIX_AIC_1_2 ? 2 : 1;
}

void CrossCoreSet(uint8_t mode, int pipe, uint16_t flag) {
  Core& core = Current();
  core.machine.CrossSet(core, mode, pipe, flag);
}

void CrossCoreWait(uint16_t flag) {
  Core& core = Current();
  core.machine.CrossWait(core, flag);
}

}  // namespace AscendC::cpu_model
