// The CPU model of the AscendC API (csrc/ascend/cpu_model) on its own: number formats, buffers and their limits,
// queues, data movement, the vector unit's mask/repeat/stride rules, the cube path, cross-core flags, and the
// hazard checker. Each "fails" test is a bug the model must catch before a kernel reaches hardware.
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "kernel_operator.h"

using namespace AscendC;
namespace cm = AscendC::cpu_model;

namespace {

// Runs `body` on `block_dim` cores of `type`; returns the model's error ("" when the kernel ran clean).
std::string RunKernel(KernelMetaType type, uint32_t block_dim, const std::function<void()>& body) {
  try {
    cm::Launch(type, block_dim, body);
  } catch (const cm::ModelError& e) {
    return e.what();
  }
  return "";
}

template <typename T>
void Declare(std::vector<T>& v, bool writable, const char* name) {
  cm::DeclareGm({reinterpret_cast<const uint8_t*>(v.data()), 1, 0, v.size() * sizeof(T), sizeof(T), writable, name});
}

template <typename T>
GlobalTensor<T> Gm(std::vector<T>& v) {
  GlobalTensor<T> g;
  g.SetGlobalBuffer(v.data(), v.size());
  return g;
}

uint32_t Bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

}  // namespace

// ------------------------------------------------------------------------------------------- number formats

TEST(AscendModelTypes, WideningIsExactForEveryPattern) {
  for (uint32_t b = 0; b < 65536; ++b) {
    half h;
    h.bits = static_cast<uint16_t>(b);
    bfloat16_t z;
    z.bits = static_cast<uint16_t>(b);
    const float ref_h = static_cast<float>(c10::Half(static_cast<uint16_t>(b), c10::Half::from_bits()));
    const float ref_z = static_cast<float>(c10::BFloat16(static_cast<uint16_t>(b), c10::BFloat16::from_bits()));
    if (std::isnan(ref_h)) {
      EXPECT_TRUE(std::isnan(float(h))) << b;
    } else {
      EXPECT_EQ(Bits(float(h)), Bits(ref_h)) << b;
    }
    if (std::isnan(ref_z)) {
      EXPECT_TRUE(std::isnan(float(z))) << b;
    } else {
      EXPECT_EQ(Bits(float(z)), Bits(ref_z)) << b;
    }
  }
}

TEST(AscendModelTypes, NarrowingRoundsToNearestEvenLikeTorch) {
  std::mt19937 gen(7);
  std::vector<float> values = {0.f, -0.f, 65504.f, 65519.99f, 65520.f, 1e-8f, 2.98e-8f, 5.96e-8f, 6.1e-5f,
                               1.f + 1.f / 2048, 1.f + 3.f / 2048, INFINITY, -INFINITY, 3.4e38f, 1e-40f};
  for (int i = 0; i < 200000; ++i) {
    uint32_t u = gen();
    float f;
    std::memcpy(&f, &u, 4);
    if (!std::isnan(f)) values.push_back(f);
  }
  for (int e = -30; e < 20; ++e) {
    for (int m = 0; m < 64; ++m) values.push_back(std::ldexp(1.f + m / 1024.f + 1.f / 4096, e));  // near ties
  }
  for (float f : values) {
    EXPECT_EQ(half(f).bits, c10::Half(f).x) << f;
    EXPECT_EQ(bfloat16_t(f).bits, c10::BFloat16(f).x) << f;
  }
  EXPECT_TRUE(std::isnan(float(half(NAN))));
  EXPECT_TRUE(std::isnan(float(bfloat16_t(NAN))));
}

// ------------------------------------------------------------------------------------------- buffers and cores

TEST(AscendModelBuffers, UnifiedBufferCapacityIsEnforced) {
  EXPECT_EQ(RunKernel(KERNEL_TYPE_AIV_ONLY, 1, [] {
              TPipe pipe;
              TBuf<TPosition::VECCALC> a, b;
              pipe.InitBuffer(a, 100 * 1024);
              pipe.InitBuffer(b, cm::kMemSpec[0].usable - 100 * 1024);  // exactly what is left
            }),
            "");
  const std::string err = RunKernel(KERNEL_TYPE_AIV_ONLY, 1, [] {
    TPipe pipe;
    TBuf<TPosition::VECCALC> a;
    pipe.InitBuffer(a, cm::kMemSpec[0].usable + 32);
  });
  EXPECT_NE(err.find("UB capacity exceeded"), std::string::npos) << err;
  EXPECT_NE(RunKernel(KERNEL_TYPE_AIV_ONLY, 1, [] {
              TPipe pipe;
              TBuf<TPosition::A1> l1;  // an AIV has no L1
              pipe.InitBuffer(l1, 64);
            }).find("has no L1"),
            std::string::npos);
}

TEST(AscendModelBuffers, LocalMemoryStartsPoisonedAndTensorsAreBoundsChecked) {
  std::vector<float> seen(1);
  EXPECT_EQ(RunKernel(KERNEL_TYPE_AIV_ONLY, 1, [&] {
              TPipe pipe;
              TBuf<TPosition::VECCALC> buf;
              pipe.InitBuffer(buf, 64);
              seen[0] = buf.Get<float>().GetValue(3);
            }),
            "");
  EXPECT_TRUE(std::isnan(seen[0]));
  const std::string err = RunKernel(KERNEL_TYPE_AIV_ONLY, 1, [] {
    TPipe pipe;
    TBuf<TPosition::VECCALC> buf;
    pipe.InitBuffer(buf, 64);
    buf.Get<float>().SetValue(16, 1.f);  // 64 bytes hold 16 floats
  });
  EXPECT_NE(err.find("exceed the tensor's 16"), std::string::npos) << err;
}

TEST(AscendModelBuffers, CoresRunOneAfterAnotherInBlockOrder) {
  std::vector<std::string> order;
  EXPECT_EQ(RunKernel(KERNEL_TYPE_MIX_AIC_1_2, 2,
                [&] { order.push_back((ASCEND_IS_AIC ? "c" : "v") + std::to_string(GetBlockIdx())); }),
            "");
  EXPECT_EQ(order, (std::vector<std::string>{"c0", "v0", "v1", "c1", "v2", "v3"}));
}

TEST(AscendModelBuffers, KernelTypeMustMatchTheLaunch) {
  const std::string err = RunKernel(KERNEL_TYPE_AIV_ONLY, 1, [] { KERNEL_TASK_TYPE_DEFAULT(KERNEL_TYPE_MIX_AIC_1_2); });
  EXPECT_NE(err.find("differs from the launched kernel type"), std::string::npos) << err;
}

// ------------------------------------------------------------------------------------------- queues

TEST(AscendModelQueues, FreeListDepthAndOwnershipAreEnforced) {
  auto fails_with = [](const std::function<void(TQue<TPosition::VECIN, 1>&)>& f, const char* what) {
    const std::string err = RunKernel(KERNEL_TYPE_AIV_ONLY, 1, [&] {
      TPipe pipe;
      TQue<TPosition::VECIN, 1> q;
      pipe.InitBuffer(q, 2, 64);
      f(q);
    });
    EXPECT_NE(err.find(what), std::string::npos) << err;
  };
  fails_with([](auto& q) {
    q.template AllocTensor<float>();
    q.template AllocTensor<float>();
    q.template AllocTensor<float>();
  }, "all 2 buffers are in use");
  fails_with([](auto& q) { q.template DeQue<float>(); }, "DeQue on an empty queue");
  fails_with([](auto& q) {
    auto a = q.template AllocTensor<float>();
    auto b = q.template AllocTensor<float>();
    q.EnQue(a);
    q.EnQue(b);  // depth 1
  }, "beyond the queue depth 1");
  fails_with([](auto& q) {
    auto a = q.template AllocTensor<float>();
    q.FreeTensor(a);
    q.FreeTensor(a);
  }, "free or still enqueued");
  // Every queue buffer holds an event id of its pipe pair: 8 per pair.
  const std::string ids = RunKernel(KERNEL_TYPE_AIV_ONLY, 1, [] {
    TPipe pipe;
    TQue<TPosition::VECIN, 1> a, b;
    pipe.InitBuffer(a, 5, 64);
    pipe.InitBuffer(b, 4, 64);
  });
  EXPECT_NE(ids.find("all 8 event ids of PIPE_MTE2->PIPE_V are taken"), std::string::npos) << ids;
  // Freed buffers come back in FIFO order.
  EXPECT_EQ(RunKernel(KERNEL_TYPE_AIV_ONLY, 1, [] {
              TPipe pipe;
              TQue<TPosition::VECIN, 2> q;
              pipe.InitBuffer(q, 2, 64);
              auto a = q.AllocTensor<float>();
              auto b = q.AllocTensor<float>();
              const uint32_t first = a.ref.addr;
              q.FreeTensor(a);
              q.FreeTensor(b);
              if (q.AllocTensor<float>().ref.addr != first) cm::Fail("free list is not FIFO");
            }),
            "");
}

// ------------------------------------------------------------------------------------------- data movement

TEST(AscendModelCopies, DataCopyPadPadsWithTheFirstElementAndChecksAlignment) {
  std::vector<float> src(20), dst(20, -1.f);
  for (int i = 0; i < 20; ++i) src[i] = float(i + 1);
  std::vector<float> ub(16);
  Declare(src, false, "src");
  Declare(dst, true, "dst");
  EXPECT_EQ(RunKernel(KERNEL_TYPE_AIV_ONLY, 1, [&] {
              TPipe pipe;
              TQue<TPosition::VECIN, 1> q;
              pipe.InitBuffer(q, 1, 64);
              auto t = q.AllocTensor<float>();
              // 2 blocks of 5 floats, 3 floats apart in GM: each padded to 8 floats (32 bytes) in UB.
              DataCopyPad(t, Gm(src)[1], DataCopyExtParams{2, 20, 12, 0, 0}, DataCopyPadExtParams<float>{});
              q.EnQue(t);
              t = q.DeQue<float>();
              for (int i = 0; i < 16; ++i) ub[i] = t.GetValue(i);
              PipeBarrier<PIPE_ALL>();
              DataCopyPad(Gm(dst)[2], t, DataCopyExtParams{2, 20, 0, 4, 0});  // 5 floats, then skip 1
              q.FreeTensor(t);
            }),
            "");
  EXPECT_EQ(ub, (std::vector<float>{2, 3, 4, 5, 6, 2, 2, 2, 10, 11, 12, 13, 14, 10, 10, 10}));
  EXPECT_EQ(dst, (std::vector<float>{-1, -1, 2, 3, 4, 5, 6, -1, 10, 11, 12, 13, 14, -1, -1, -1, -1, -1, -1, -1}));
  Declare(src, false, "src");
  const std::string err = RunKernel(KERNEL_TYPE_AIV_ONLY, 1, [&] {
    TPipe pipe;
    TQue<TPosition::VECIN, 1> q;
    pipe.InitBuffer(q, 1, 64);
    auto t = q.AllocTensor<float>();
    DataCopyPad(t[2], Gm(src), DataCopyExtParams{1, 8, 0, 0, 0}, DataCopyPadExtParams<float>{});
  });
  EXPECT_NE(err.find("not 32-byte aligned"), std::string::npos) << err;
}

TEST(AscendModelCopies, GlobalAccessesStayInsideDeclaredBuffers) {
  std::vector<float> a(10), b(10);
  auto run = [&](int first, int count, bool write) {
    Declare(a, false, "a");
    Declare(b, true, "b");
    return RunKernel(KERNEL_TYPE_AIV_ONLY, 1, [&] {
      TPipe pipe;
      TQue<TPosition::VECIN, 1> q;
      pipe.InitBuffer(q, 1, 64);
      auto t = q.AllocTensor<float>();
      GlobalTensor<float> g;
      g.SetGlobalBuffer(a.data());  // unsized: only the declared buffers bound it
      if (write) {
        DataCopyPad(g[first], t, DataCopyExtParams{1, uint32_t(count * 4), 0, 0, 0});
      } else {
        DataCopyPad(t, g[first], DataCopyExtParams{1, uint32_t(count * 4), 0, 0, 0}, DataCopyPadExtParams<float>{});
      }
    });
  };
  EXPECT_EQ(run(2, 8, false), "");
  EXPECT_NE(run(3, 8, false).find("outside every buffer"), std::string::npos);
  EXPECT_NE(run(-1, 2, false).find("outside every buffer"), std::string::npos);
  EXPECT_NE(run(0, 2, true).find("read-only global buffer 'a'"), std::string::npos);
}

TEST(AscendModelCopies, Nd2NzPlacesRowsInFractalsAndZeroPadsTheLastGroup) {
  std::vector<half> src(3 * 20);
  for (int i = 0; i < 60; ++i) src[i] = half(float(i));
  std::vector<float> got(2 * 16 * 16);
  Declare(src, false, "src");
  EXPECT_EQ(RunKernel(KERNEL_TYPE_AIC_ONLY, 1, [&] {
              TPipe pipe;
              TQue<TPosition::A1, 1> q;
              pipe.InitBuffer(q, 1, 2 * 16 * 16 * 2);
              auto t = q.AllocTensor<half>();
              Fill(t, InitConstValueParams<half>{1, 32, 0, half(-1.f)});
              PipeBarrier<PIPE_MTE2>();
              // rows 0..2 of a 3 x 18 window (row stride 20) into a 16-row NZ matrix
              DataCopy(t, Gm(src), Nd2NzParams{1, 3, 18, 0, 20, 16, 1, 0});
              PipeBarrier<PIPE_ALL>();
              for (int i = 0; i < 512; ++i) got[i] = float(t.GetValue(i));
            }),
            "");
  for (int r = 0; r < 16; ++r) {
    for (int c = 0; c < 32; ++c) {
      const float v = got[(c / 16) * 256 + r * 16 + c % 16];
      const float want = r >= 3 ? -1.f : (c < 18 ? float(r * 20 + c) : 0.f);
      EXPECT_EQ(v, want) << r << "," << c;
    }
  }
}

// ------------------------------------------------------------------------------------------- vector unit

TEST(AscendModelVector, MaskRepeatAndStridesSelectLanes) {
  std::vector<float> out(256);
  EXPECT_EQ(RunKernel(KERNEL_TYPE_AIV_ONLY, 1, [&] {
              TPipe pipe;
              TBuf<TPosition::VECCALC> buf;
              pipe.InitBuffer(buf, 3 * 256 * 4);
              auto all = buf.Get<float>();
              auto a = all, b = all[256], d = all[512];
              for (int i = 0; i < 256; ++i) {
                a.SetValue(i, float(i));
                b.SetValue(i, 1000.f);
                d.SetValue(i, -1.f);
              }
              // 2 repeats; dst blocks 2 apart (every other 8-float block), 16 blocks between repeats; sources
              // contiguous; bit mask: lanes 0..3 and 60..63 of each repeat.
              uint64_t mask[2] = {0xF00000000000000FULL, 0};
              Add(d, a, b, mask, 2, BinaryRepeatParams{2, 1, 1, 16, 8, 8});
              for (int i = 0; i < 256; ++i) out[i] = d.GetValue(i);
            }),
            "");
  std::vector<float> want(256, -1.f);
  for (int r = 0; r < 2; ++r) {
    for (int lane : {0, 1, 2, 3, 60, 61, 62, 63}) {
      want[r * 128 + (lane / 8) * 16 + lane % 8] = float(r * 64 + lane) + 1000.f;
    }
  }
  EXPECT_EQ(out, want);
}

TEST(AscendModelVector, SubInCounterModeTakesTheFirstCountElements) {
  std::vector<float> out(80);
  EXPECT_EQ(RunKernel(KERNEL_TYPE_AIV_ONLY, 1, [&] {
              TPipe pipe;
              TBuf<TPosition::VECCALC> buf;
              pipe.InitBuffer(buf, 3 * 80 * 4);
              auto all = buf.Get<float>();
              auto a = all, b = all[80], d = all[160];
              for (int i = 0; i < 80; ++i) {
                a.SetValue(i, float(i));
                b.SetValue(i, 0.25f * float(i) + 3.f);
                d.SetValue(i, -1.f);
              }
              Sub(d, a, b, 70);  // two repeats of 64 lanes, the second one partial
              for (int i = 0; i < 80; ++i) out[i] = d.GetValue(i);
            }),
            "");
  for (int i = 0; i < 80; ++i) EXPECT_EQ(out[i], i < 70 ? float(i) - (0.25f * float(i) + 3.f) : -1.f) << i;
}

TEST(AscendModelVector, CastCountsLanesByTheWiderTypeAndRoundsToNearestEven) {
  std::vector<uint16_t> bits(80);
  EXPECT_EQ(RunKernel(KERNEL_TYPE_AIV_ONLY, 1, [&] {
              TPipe pipe;
              TBuf<TPosition::VECCALC> f, h;
              pipe.InitBuffer(f, 80 * 4);
              pipe.InitBuffer(h, 80 * 2);
              auto src = f.Get<float>();
              auto dst = h.Get<half>();
              for (int i = 0; i < 80; ++i) {
                src.SetValue(i, 1.f + float(i) / 4096.f);  // odd i: halfway between two halves
                dst.SetValue(i, half(-2.f));
              }
              Cast(dst, src, RoundMode::CAST_RINT, uint64_t(40), 1, UnaryRepeatParams{1, 1, 4, 8});  // 40 lanes
              for (int i = 0; i < 80; ++i) bits[i] = dst.GetValue(i).bits;
            }),
            "");
  for (int i = 0; i < 80; ++i) {
    EXPECT_EQ(bits[i], i < 40 ? c10::Half(1.f + float(i) / 4096.f).x : c10::Half(-2.f).x) << i;
  }
  const std::string err = RunKernel(KERNEL_TYPE_AIV_ONLY, 1, [] {
    TPipe pipe;
    TBuf<TPosition::VECCALC> f, h;
    pipe.InitBuffer(f, 256);
    pipe.InitBuffer(h, 256);
    Cast(h.Get<bfloat16_t>(), f.Get<float>(), RoundMode::CAST_NONE, 8);  // not listed for float -> bf16
  });
  EXPECT_NE(err.find("CAST_RINT"), std::string::npos) << err;
}

// ------------------------------------------------------------------------------------------- cube

namespace {

// A[m x k] . B[k x n] through GM -> L1 (NZ) -> L0A (Zz) / L0B (Zn) -> Mmad -> Fixpipe -> GM, B given as W = B^T.
struct CubeOptions {
  int mmad_m = 0;       // the m given to Mmad (0: m rounded up to a fractal)
  bool split_k = true;  // two accumulating Mmads over halves of k (A must be one 16-row band)
  bool barrier = true;  // PipeBarrier<PIPE_M> between them
};

template <typename T>
std::string CubeMatmul(std::vector<T>& a, std::vector<T>& w, std::vector<float>& c, int m, int n, int k,
                       CubeOptions opt = {}) {
  Declare(a, false, "a");
  Declare(w, false, "w");
  Declare(c, true, "c");
  return RunKernel(KERNEL_TYPE_AIC_ONLY, 1, [&] {
    constexpr int c0 = 32 / sizeof(T), frac = 512 / sizeof(T);
    const int mp = (m + 15) / 16 * 16, np = (n + 15) / 16 * 16, kf = (k + c0 - 1) / c0;
    TPipe pipe;
    TQue<TPosition::A1, 1> a1;
    TQue<TPosition::B1, 1> b1;
    TQue<TPosition::A2, 1> a2;
    TQue<TPosition::B2, 1> b2;
    TQue<TPosition::CO1, 1> co1;
    pipe.InitBuffer(a1, 1, mp * kf * 32);
    pipe.InitBuffer(b1, 1, np * kf * 32);
    pipe.InitBuffer(a2, 1, mp * kf * 32);
    pipe.InitBuffer(b2, 1, np * kf * 32);
    pipe.InitBuffer(co1, 1, mp * np * 4);
    auto la = a1.AllocTensor<T>();
    auto lw = b1.AllocTensor<T>();
    DataCopy(la, Gm(a), Nd2NzParams{1, uint16_t(m), uint16_t(k), 0, uint16_t(k), uint16_t(mp), 1, 0});
    DataCopy(lw, Gm(w), Nd2NzParams{1, uint16_t(n), uint16_t(k), 0, uint16_t(k), uint16_t(np), 1, 0});
    a1.EnQue(la);
    b1.EnQue(lw);
    la = a1.DeQue<T>();
    lw = b1.DeQue<T>();
    auto za = a2.AllocTensor<T>();
    auto zb = b2.AllocTensor<T>();
    for (int mb = 0; mb < mp / 16; ++mb) {
      LoadData(za[mb * kf * frac], la[mb * frac], LoadData2DParams{0, uint8_t(kf), uint16_t(mp / 16), 0, 0, false, 0});
    }
    LoadData(zb, lw, LoadData2DParams{0, uint8_t(kf * np / 16), 1, 0, 0, false, 0});
    a2.EnQue(za);
    b2.EnQue(zb);
    za = a2.DeQue<T>();
    zb = b2.DeQue<T>();
    auto acc = co1.AllocTensor<float>();
    // two half-k Mmads accumulating (k split at a fractal boundary when possible)
    const int k1 = opt.split_k && k > c0 ? (k / 2 + c0 - 1) / c0 * c0 : k;
    Mmad(acc, za, zb, MmadParams{uint16_t(opt.mmad_m ? opt.mmad_m : mp), uint16_t(n), uint16_t(k1), 0, false, true});
    if (k1 < k) {
      if (opt.barrier) PipeBarrier<PIPE_M>();
      // The rest of k: its fractals start k1 / c0 fractals in, per row band of A and per k band of B.
      Mmad(acc, za[k1 / c0 * frac], zb[k1 / c0 * (np / 16) * frac],
           MmadParams{uint16_t(mp), uint16_t(n), uint16_t(k - k1), 0, false, false});
    }
    co1.EnQue(acc);
    acc = co1.DeQue<float>();
    Fixpipe(Gm(c), acc, FixpipeParamsV220{uint16_t(n), uint16_t(m), uint16_t(mp), uint32_t(n), false,
                                          QuantMode_t::NoQuant, 0, 1, 0, 0, 0});
    co1.FreeTensor(acc);
  });
}

}  // namespace

TEST(AscendModelCube, MmadMatchesAMatmulForEachOperandType) {
  std::mt19937 gen(3);
  std::normal_distribution<float> nd;
  const int m = 20, n = 24, k = 40;
  std::vector<half> ah(m * k), wh(n * k);
  std::vector<bfloat16_t> ab(m * k), wb(n * k);
  std::vector<float> af(m * k), wf(n * k), ch(m * n), cb(m * n), cf(m * n);
  for (int i = 0; i < m * k; ++i) af[i] = nd(gen), ah[i] = af[i], ab[i] = af[i];
  for (int i = 0; i < n * k; ++i) wf[i] = nd(gen), wh[i] = wf[i], wb[i] = wf[i];
  // One Mmad: a k split would change the Zz row-band stride of a two-band A.
  ASSERT_EQ(CubeMatmul(ah, wh, ch, m, n, k, CubeOptions{0, false, true}), "");
  ASSERT_EQ(CubeMatmul(ab, wb, cb, m, n, k, CubeOptions{0, false, true}), "");
  ASSERT_EQ(CubeMatmul(af, wf, cf, m, n, k, CubeOptions{0, false, true}), "");
  for (int i = 0; i < m; ++i) {
    for (int j = 0; j < n; ++j) {
      double rh = 0, rb = 0, rf = 0;
      for (int kk = 0; kk < k; ++kk) {
        rh += double(float(ah[i * k + kk])) * float(wh[j * k + kk]);
        rb += double(float(ab[i * k + kk])) * float(wb[j * k + kk]);
        rf += double(af[i * k + kk]) * wf[j * k + kk];
      }
      EXPECT_NEAR(ch[i * n + j], rh, 1e-5 * (1 + std::abs(rh)));
      EXPECT_NEAR(cb[i * n + j], rb, 1e-5 * (1 + std::abs(rb)));
      EXPECT_NEAR(cf[i * n + j], rf, 1e-5 * (1 + std::abs(rf)));
    }
  }
}

TEST(AscendModelCube, AccumulatingSmallTilesNeedsAPipeMBarrier) {
  std::vector<half> a(16 * 64, half(1.f)), w(16 * 64, half(1.f));
  std::vector<float> c(16 * 16);
  EXPECT_EQ(CubeMatmul(a, w, c, 16, 16, 64), "");
  EXPECT_EQ(c[0], 64.f);
  const std::string err = CubeMatmul(a, w, c, 16, 16, 64, CubeOptions{0, true, false});
  EXPECT_NE(err.find("without PipeBarrier<PIPE_M>"), std::string::npos) << err;
}

TEST(AscendModelCube, OneRowSelectsGemvAndFp32ChannelSplitToL1IsRejected) {
  // m = 1 reads L0A as one ND row. With k = 16 a Zz row band's first row is that row; with k = 32 the second
  // fractal of the band is not where an ND row continues, so a Zz-loaded operand gives a different product.
  std::vector<half> a(32), w(16 * 32);
  for (int i = 0; i < 32; ++i) a[i] = half(float(i % 7));
  for (int i = 0; i < 16 * 32; ++i) w[i] = half(float(i % 5));
  auto reference = [&](int k) {
    double r = 0;
    for (int kk = 0; kk < k; ++kk) r += float(a[kk]) * float(w[kk]);
    return r;
  };
  std::vector<half> a16(a.begin(), a.begin() + 16), w16(16 * 16);
  for (int j = 0; j < 16; ++j) std::copy(w.begin() + j * 32, w.begin() + j * 32 + 16, w16.begin() + j * 16);
  std::vector<float> c(16);
  ASSERT_EQ(CubeMatmul(a16, w16, c, 1, 16, 16, CubeOptions{1, false, true}), "");
  EXPECT_EQ(c[0], reference(16));
  ASSERT_EQ(CubeMatmul(a, w, c, 1, 16, 32, CubeOptions{1, false, true}), "");
  EXPECT_FALSE(c[0] == reference(32));
  const std::string err = RunKernel(KERNEL_TYPE_AIC_ONLY, 1, [] {
    TPipe pipe;
    TQue<TPosition::CO1, 1> co1;
    TBuf<TPosition::A1> l1;
    pipe.InitBuffer(co1, 1, 1024);
    pipe.InitBuffer(l1, 1024);
    auto acc = co1.AllocTensor<float>();
    Fixpipe<float, float, CFG_NZ>(l1.Get<float>(), acc,
                                  FixpipeParamsV220{16, 16, 16, 16, false, QuantMode_t::NoQuant, 0, 1, 0, 0, 0});
  });
  EXPECT_NE(err.find("no fp32 channel split towards L1"), std::string::npos) << err;
}

// ------------------------------------------------------------------------------------------- hazards and flags

TEST(AscendModelHazards, MissingSyncBetweenPipesIsReported) {
  std::vector<float> src(64, 1.f);
  auto run = [&](bool sync) {
    Declare(src, false, "src");
    return RunKernel(KERNEL_TYPE_AIV_ONLY, 1, [&] {
      TPipe pipe;
      TBuf<TPosition::VECIN> in;  // a TBuf has no queue: ordering is the kernel's job
      pipe.InitBuffer(in, 256);
      auto t = in.Get<float>();
      DataCopyPad(t, Gm(src), DataCopyExtParams{1, 256, 0, 0, 0}, DataCopyPadExtParams<float>{});
      if (sync) {
        SetFlag<HardEvent::MTE2_V>(EVENT_ID0);
        WaitFlag<HardEvent::MTE2_V>(EVENT_ID0);
      }
      Muls(t, t, 2.f, 64);
    });
  };
  EXPECT_EQ(run(true), "");
  const std::string err = run(false);
  EXPECT_NE(err.find("RAW hazard on UB"), std::string::npos) << err;
  EXPECT_NE(err.find("PIPE_V"), std::string::npos) << err;
  EXPECT_NE(err.find("PIPE_MTE2"), std::string::npos) << err;
}

// Fixpipe's store to GM and an MTE2 load of it on the same AIC (sgmv's fp32 h on its way back into L1) are two
// pipes of one core: the element-wise GM tracking orders them like any other pair, so the load needs FIX -> MTE2.
TEST(AscendModelHazards, GlobalMemoryBetweenPipesOfOneCoreNeedsASync) {
  std::vector<float> ws(64);
  auto run = [&](bool sync) {
    Declare(ws, true, "ws");
    return RunKernel(KERNEL_TYPE_AIC_ONLY, 1, [&] {
      TPipe pipe;
      TQue<TPosition::CO1, 1> co1;
      TBuf<TPosition::A1> l1;
      pipe.InitBuffer(co1, 1, 16 * 16 * 4);
      pipe.InitBuffer(l1, 16 * 16 * 4);
      auto acc = co1.AllocTensor<float>();
      Fixpipe(Gm(ws), acc, FixpipeParamsV220{16, 4, 16, 16, false, QuantMode_t::NoQuant, 0, 1, 0, 0, 0});
      if (sync) {
        SetFlag<HardEvent::FIX_MTE2>(EVENT_ID0);
        WaitFlag<HardEvent::FIX_MTE2>(EVENT_ID0);
      }
      DataCopy(l1.Get<float>(), Gm(ws), Nd2NzParams{1, 4, 16, 0, 16, 16, 1, 0});
      co1.FreeTensor(acc);
    });
  };
  EXPECT_EQ(run(true), "");
  const std::string race = run(false);
  EXPECT_NE(race.find("RAW hazard on 'ws'"), std::string::npos) << race;
  EXPECT_NE(race.find("PIPE_MTE2 of AIC of block 0"), std::string::npos) << race;
  EXPECT_NE(race.find("PIPE_FIX"), std::string::npos) << race;
}

TEST(AscendModelHazards, FlagsMustPair) {
  EXPECT_NE(RunKernel(KERNEL_TYPE_AIV_ONLY, 1, [] { WaitFlag<HardEvent::V_MTE3>(EVENT_ID1); }).find("stall forever"),
            std::string::npos);
  EXPECT_NE(RunKernel(KERNEL_TYPE_AIV_ONLY, 1, [] { SetFlag<HardEvent::V_MTE3>(EVENT_ID1); }).find("never waited"),
            std::string::npos);
  EXPECT_NE(RunKernel(KERNEL_TYPE_AIV_ONLY, 1, [] {
              SetFlag<HardEvent::V_MTE3>(EVENT_ID1);
              SetFlag<HardEvent::V_MTE3>(EVENT_ID1);
            }).find("set twice"),
            std::string::npos);
}

TEST(AscendModelHazards, CrossCoreFlagsOrderGlobalMemoryAndDeadlocksAreReported) {
  std::vector<float> ws(64);
  auto run = [&](bool wait) {
    Declare(ws, true, "ws");
    return RunKernel(KERNEL_TYPE_MIX_AIC_1_2, 1, [&] {
      if (ASCEND_IS_AIC) {
        TPipe pipe;
        TQue<TPosition::CO1, 1> co1;
        pipe.InitBuffer(co1, 1, 16 * 16 * 4);
        auto acc = co1.AllocTensor<float>();
        Fixpipe(Gm(ws), acc, FixpipeParamsV220{16, 4, 16, 16, false, QuantMode_t::NoQuant, 0, 1, 0, 0, 0});
        CrossCoreSetFlag<2, PIPE_FIX>(5);
      } else {
        TPipe pipe;
        TQue<TPosition::VECIN, 1> q;
        pipe.InitBuffer(q, 1, 256);
        if (wait) CrossCoreWaitFlag(5);
        auto t = q.AllocTensor<float>();
        DataCopyPad(t, Gm(ws), DataCopyExtParams{1, 256, 0, 0, 0}, DataCopyPadExtParams<float>{});
        q.FreeTensor(t);
      }
    });
  };
  EXPECT_EQ(run(true), "");
  const std::string race = run(false);
  EXPECT_NE(race.find("RAW hazard on 'ws'"), std::string::npos) << race;
  const std::string deadlock = RunKernel(KERNEL_TYPE_MIX_AIC_1_2, 1, [] {
    if (ASCEND_IS_AIV) CrossCoreWaitFlag(3);
  });
  EXPECT_NE(deadlock.find("deadlock"), std::string::npos) << deadlock;
  EXPECT_NE(deadlock.find("CrossCoreWaitFlag(3)"), std::string::npos) << deadlock;
  const std::string overflow = RunKernel(KERNEL_TYPE_MIX_AIC_1_2, 1, [] {
    if (ASCEND_IS_AIC) {
      for (int i = 0; i < 16; ++i) CrossCoreSetFlag<2, PIPE_FIX>(1);
    }
  });
  EXPECT_NE(overflow.find("counter exceeds 15"), std::string::npos) << overflow;
}
