// TPipe, TQue, TBuf and the synchronisation calls of the CPU model. A TQue is a set of buffers with a free list
// and a FIFO of enqueued tensors; like the framework on the device it orders its producer pipe before its consumer
// pipe (EnQue -> DeQue) and the consumer before the next producer of a buffer (FreeTensor -> AllocTensor).
#pragma once
#include <deque>
#include <string>
#include <vector>

#include "model_tensor.h"

// Event ids, a compiler built-in on the device.
enum event_t : int8_t { EVENT_ID0, EVENT_ID1, EVENT_ID2, EVENT_ID3, EVENT_ID4, EVENT_ID5, EVENT_ID6, EVENT_ID7 };

namespace AscendC {

using TEventID = int8_t;

// src_dst pipe pairs, as kernel_event.h declares them (the subset the model knows).
enum class HardEvent : uint8_t {
  MTE2_MTE1, MTE1_MTE2, MTE1_M, M_MTE1, MTE2_V, V_MTE2, MTE3_V, V_MTE3, M_V, V_M, V_V, MTE3_MTE1, MTE1_MTE3,
  MTE1_V, MTE2_M, M_MTE2, V_MTE1, M_FIX, FIX_M, MTE3_MTE2, MTE2_MTE3, S_V, V_S, S_MTE2, MTE2_S, S_MTE3, MTE3_S,
  MTE2_FIX, FIX_MTE2, FIX_S, M_S, FIX_MTE3, MTE1_FIX, FIX_MTE1, FIX_FIX,
};

namespace cpu_model {

struct EventPipes {
  int src, dst;
};

inline EventPipes PipesOf(HardEvent e) {
  switch (e) {
    case HardEvent::MTE2_MTE1: return {kPipeMte2, kPipeMte1};
    case HardEvent::MTE1_MTE2: return {kPipeMte1, kPipeMte2};
    case HardEvent::MTE1_M: return {kPipeMte1, kPipeM};
    case HardEvent::M_MTE1: return {kPipeM, kPipeMte1};
    case HardEvent::MTE2_V: return {kPipeMte2, kPipeV};
    case HardEvent::V_MTE2: return {kPipeV, kPipeMte2};
    case HardEvent::MTE3_V: return {kPipeMte3, kPipeV};
    case HardEvent::V_MTE3: return {kPipeV, kPipeMte3};
    case HardEvent::M_V: return {kPipeM, kPipeV};
    case HardEvent::V_M: return {kPipeV, kPipeM};
    case HardEvent::V_V: return {kPipeV, kPipeV};
    case HardEvent::MTE3_MTE1: return {kPipeMte3, kPipeMte1};
    case HardEvent::MTE1_MTE3: return {kPipeMte1, kPipeMte3};
    case HardEvent::MTE1_V: return {kPipeMte1, kPipeV};
    case HardEvent::MTE2_M: return {kPipeMte2, kPipeM};
    case HardEvent::M_MTE2: return {kPipeM, kPipeMte2};
    case HardEvent::V_MTE1: return {kPipeV, kPipeMte1};
    case HardEvent::M_FIX: return {kPipeM, kPipeFix};
    case HardEvent::FIX_M: return {kPipeFix, kPipeM};
    case HardEvent::MTE3_MTE2: return {kPipeMte3, kPipeMte2};
    case HardEvent::MTE2_MTE3: return {kPipeMte2, kPipeMte3};
    case HardEvent::S_V: return {kPipeS, kPipeV};
    case HardEvent::V_S: return {kPipeV, kPipeS};
    case HardEvent::S_MTE2: return {kPipeS, kPipeMte2};
    case HardEvent::MTE2_S: return {kPipeMte2, kPipeS};
    case HardEvent::S_MTE3: return {kPipeS, kPipeMte3};
    case HardEvent::MTE3_S: return {kPipeMte3, kPipeS};
    case HardEvent::MTE2_FIX: return {kPipeMte2, kPipeFix};
    case HardEvent::FIX_MTE2: return {kPipeFix, kPipeMte2};
    case HardEvent::FIX_S: return {kPipeFix, kPipeS};
    case HardEvent::M_S: return {kPipeM, kPipeS};
    case HardEvent::FIX_MTE3: return {kPipeFix, kPipeMte3};
    case HardEvent::MTE1_FIX: return {kPipeMte1, kPipeFix};
    case HardEvent::FIX_MTE1: return {kPipeFix, kPipeMte1};
    case HardEvent::FIX_FIX: return {kPipeFix, kPipeFix};
  }
  Fail("unknown HardEvent");
}

// The pipe that fills a queue's buffers and the one that drains them, by position (as the framework pairs them).
inline EventPipes QueuePipes(TPosition pos) {
  switch (pos) {
    case TPosition::VECIN: return {kPipeMte2, kPipeV};
    case TPosition::VECOUT: return {kPipeV, kPipeMte3};
    case TPosition::A1: case TPosition::B1: return {kPipeMte2, kPipeMte1};
    case TPosition::A2: case TPosition::B2: return {kPipeMte1, kPipeM};
    case TPosition::CO1: return {kPipeM, kPipeFix};
    default: Fail("a TQue at TPosition " + std::to_string(static_cast<int>(pos)) + " is not modelled");
  }
}

class QueueState {
 public:
  void Init(TPosition pos, int depth, uint32_t num, uint32_t len, uint32_t base) {
    if (!bufs_.empty()) Fail("TPipe::InitBuffer called twice for one queue");
    if (num == 0) Fail("TPipe::InitBuffer with 0 buffers");
    pos_ = pos;
    depth_ = depth;
    pipes_ = QueuePipes(pos);
    owner_ = &Current();
    for (uint32_t i = 0; i < num; ++i) {
      Buffer b;
      b.addr = base + i * len;
      b.len = len;
      bufs_.push_back(b);
      free_.push_back(static_cast<int>(i));
    }
  }

  LocalRef Alloc() {
    Core& core = Owner("AllocTensor");
    if (free_.empty()) {
      Fail("TQue::AllocTensor: all " + std::to_string(bufs_.size()) + " buffers are in use (a FreeTensor missing?)");
    }
    Buffer& b = bufs_[free_.front()];
    free_.pop_front();
    if (b.freed) core.Merge(pipes_.src, b.freed_token);
    b.state = State::Allocated;
    return LocalRef{pos_, b.addr, b.len, &core};
  }

  void EnQue(const LocalRef& ref) {
    Core& core = Owner("EnQue");
    Buffer& b = Find(ref, "EnQue");
    if (b.state != State::Allocated) Fail("TQue::EnQue of a tensor that is not freshly allocated");
    if (static_cast<int>(ready_.size()) >= depth_) {
      Fail("TQue::EnQue beyond the queue depth " + std::to_string(depth_));
    }
    b.state = State::Enqueued;
    ready_.push_back({static_cast<int>(&b - bufs_.data()), core.Record(pipes_.src)});
  }

  LocalRef DeQue() {
    Core& core = Owner("DeQue");
    if (ready_.empty()) Fail("TQue::DeQue on an empty queue: the consumer would wait forever");
    auto [index, token] = ready_.front();
    ready_.pop_front();
    core.Merge(pipes_.dst, token);
    Buffer& b = bufs_[index];
    b.state = State::Dequeued;
    return LocalRef{pos_, b.addr, b.len, &core};
  }

  void Free(const LocalRef& ref) {
    Core& core = Owner("FreeTensor");
    Buffer& b = Find(ref, "FreeTensor");
    if (b.state != State::Allocated && b.state != State::Dequeued) {
      Fail("TQue::FreeTensor of a tensor that is free or still enqueued");
    }
    b.state = State::Free;
    b.freed = true;
    b.freed_token = core.Record(pipes_.dst);
    free_.push_back(static_cast<int>(&b - bufs_.data()));
  }

 private:
  enum class State { Free, Allocated, Enqueued, Dequeued };
  struct Buffer {
    uint32_t addr = 0, len = 0;
    State state = State::Free;
    bool freed = false;
    SyncToken freed_token;
  };
  Core& Owner(const char* api) {
    if (bufs_.empty()) Fail(std::string("TQue::") + api + " before TPipe::InitBuffer");
    if (owner_ != &Current()) Fail(std::string("TQue::") + api + " on another core's queue");
    return Current();
  }
  Buffer& Find(const LocalRef& ref, const char* api) {
    for (Buffer& b : bufs_) {
      if (ref.addr >= b.addr && ref.addr < b.addr + b.len) return b;
    }
    Fail(std::string("TQue::") + api + " of a tensor that does not belong to this queue");
  }

  TPosition pos_ = TPosition::MAX;
  int depth_ = 0;
  EventPipes pipes_{};
  const Core* owner_ = nullptr;
  std::vector<Buffer> bufs_;
  std::deque<int> free_;
  std::deque<std::pair<int, SyncToken>> ready_;
};

}  // namespace cpu_model

template <TPosition pos, int32_t depth, auto mask = 0>
class TQue {
 public:
  TQue() = default;
  template <typename T>
  LocalTensor<T> AllocTensor() {
    LocalTensor<T> t;
    t.ref = state_.Alloc();
    return t;
  }
  template <typename T>
  void FreeTensor(LocalTensor<T>& tensor) { state_.Free(tensor.ref); }
  template <typename T>
  bool EnQue(const LocalTensor<T>& tensor) {
    state_.EnQue(tensor.ref);
    return true;
  }
  template <typename T>
  LocalTensor<T> DeQue() {
    LocalTensor<T> t;
    t.ref = state_.DeQue();
    return t;
  }

  static constexpr TPosition kPosition = pos;
  static constexpr int32_t kDepth = depth;
  cpu_model::QueueState state_;
};

template <TPosition pos = TPosition::LCM>
class TBuf {
 public:
  TBuf() = default;
  template <typename T>
  LocalTensor<T> Get() { return Get<T>(ref_.bytes / sizeof(T)); }
  template <typename T>
  LocalTensor<T> Get(uint32_t len) {
    if (ref_.owner != &cpu_model::Current()) cpu_model::Fail("TBuf::Get before TPipe::InitBuffer or on another core");
    if (len * sizeof(T) > ref_.bytes) cpu_model::Fail("TBuf::Get of more elements than the buffer holds");
    LocalTensor<T> t;
    t.ref = ref_;
    t.ref.bytes = len * sizeof(T);
    return t;
  }

  static constexpr TPosition kPosition = pos;
  cpu_model::LocalRef ref_;
};

class TPipe {
 public:
  TPipe() = default;

  // Each queue buffer holds a sync event of its pipe pair in each direction: at most 8 per pair on arch 2201
  // (TQue buffer limit), shared with AllocEventID.
  template <class T>
  bool InitBuffer(T& que, uint8_t num, uint32_t len) {
    const uint32_t rounded = (len + 31) / 32 * 32;
    const cpu_model::EventPipes p = cpu_model::QueuePipes(T::kPosition);
    for (uint8_t i = 0; i < num; ++i) {
      TakeEventId(p.src, p.dst, "TPipe::InitBuffer (queue buffers)");
      TakeEventId(p.dst, p.src, "TPipe::InitBuffer (queue buffers)");
    }
    que.state_.Init(T::kPosition, T::kDepth, num, rounded, Allocate(cpu_model::MemOf(T::kPosition), num * rounded));
    return true;
  }

  template <TPosition pos>
  bool InitBuffer(TBuf<pos>& buf, uint32_t len) {
    const uint32_t rounded = (len + 31) / 32 * 32;
    buf.ref_ = cpu_model::LocalRef{pos, Allocate(cpu_model::MemOf(pos), rounded), rounded, &cpu_model::Current()};
    return true;
  }

  // Event ids handed out per src_dst pair, lowest first, so a kernel's own flags never collide with the queues'.
  template <HardEvent evt>
  TEventID AllocEventID() {
    const cpu_model::EventPipes p = cpu_model::PipesOf(evt);
    return TakeEventId(p.src, p.dst, "TPipe::AllocEventID");
  }

  template <HardEvent evt>
  void ReleaseEventID(TEventID id) {
    const cpu_model::EventPipes p = cpu_model::PipesOf(evt);
    uint8_t& used = event_ids_[p.src][p.dst];
    if (id < 0 || id >= 8 || !(used & (1u << id))) cpu_model::Fail("TPipe::ReleaseEventID of an id not allocated");
    used &= uint8_t(~(1u << id));
  }

 private:
  TEventID TakeEventId(int src, int dst, const char* api) {
    uint8_t& used = event_ids_[src][dst];
    for (int id = 0; id < 8; ++id) {
      if (!(used & (1u << id))) {
        used |= uint8_t(1u << id);
        return static_cast<TEventID>(id);
      }
    }
    cpu_model::Fail(std::string(api) + ": all 8 event ids of " + cpu_model::PipeName(src) + "->" +
                    cpu_model::PipeName(dst) + " are taken");
  }

  uint32_t Allocate(cpu_model::Mem m, uint32_t bytes) {
    const int i = static_cast<int>(m);
    if (!cpu_model::Current().Has(m)) {
      cpu_model::Fail(std::string("TPipe::InitBuffer: this core has no ") + cpu_model::kMemSpec[i].name);
    }
    const uint32_t align = cpu_model::kMemSpec[i].align;
    const uint32_t start = (next_[i] + align - 1) / align * align;
    if (static_cast<uint64_t>(start) + bytes > cpu_model::kMemSpec[i].usable) {
      cpu_model::Fail(std::string("TPipe::InitBuffer: ") + cpu_model::kMemSpec[i].name + " capacity exceeded (" +
                      std::to_string(start + uint64_t(bytes)) + " > " +
                      std::to_string(cpu_model::kMemSpec[i].usable) + " usable bytes)");
    }
    next_[i] = start + bytes;
    return start;
  }
  uint32_t next_[cpu_model::kMemCount] = {};
  uint8_t event_ids_[cpu_model::kPipeCount][cpu_model::kPipeCount] = {};
};

template <HardEvent event>
inline void SetFlag(int32_t eventID) {
  const auto p = cpu_model::PipesOf(event);
  cpu_model::Current().SetEvent(p.src, p.dst, eventID);
}

template <HardEvent event>
inline void WaitFlag(int32_t eventID) {
  const auto p = cpu_model::PipesOf(event);
  cpu_model::Current().WaitEvent(p.src, p.dst, eventID);
}

template <pipe_t pipe>
inline void PipeBarrier() {
  if (pipe == PIPE_ALL) {
    cpu_model::Current().BarrierAll();
  } else {
    cpu_model::Current().Barrier(cpu_model::PipeIndex(pipe));
  }
}

template <uint8_t modeId, pipe_t pipe>
inline void CrossCoreSetFlag(uint16_t flagId) {
  cpu_model::CrossCoreSet(modeId, cpu_model::PipeIndex(pipe), flagId);
}

template <uint8_t modeId = 0, pipe_t pipe = PIPE_S>
inline void CrossCoreWaitFlag(uint16_t flagId) {
  cpu_model::CrossCoreWait(flagId);
}

inline int64_t GetBlockIdx() { return cpu_model::BlockIdx(); }
inline int64_t GetBlockNum() { return cpu_model::BlockNum(); }
inline int64_t GetSubBlockIdx() { return cpu_model::SubBlockIdx(); }
inline int64_t GetSubBlockNum() { return cpu_model::SubBlockNum(); }

}  // namespace AscendC
