// The op table's C++ side (csrc/common/op_table.h), in every build: identical tables are kept once, and a table
// that sends a regime to a Triton twin without a CUDA kernel is refused (no Python here, so no Triton twin has one).
// The lookup at every class edge and the setter's other checks are tested from Python (tests/test_op_table.py).
#include <c10/util/Exception.h>
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "common/op_table.h"

namespace op_table = lora_ops::op_table;

namespace {

// sgmv with one bound per axis (16 regimes): positions <= bound, rank <= 16, slices <= 1, true_ranks <= 1.
void set_sgmv(int64_t positions_bound, const std::vector<int64_t>& triton) {
  op_table::set_table("sgmv", "positions,rank,slices,true_ranks", std::vector<int64_t>{1, 1, 1, 1},
                      std::vector<int64_t>{positions_bound, 16, 1, 1}, triton);
}

void clear(const char* op) { op_table::set_table(op, "", {}, {}, {}); }

}  // namespace

TEST(OpTable, AnIdenticalTableIsKeptOnce) {
  const std::vector<int64_t> all_cuda(16, 0);
  set_sgmv(16, all_cuda);
  const size_t kept = op_table::kept_tables();
  for (int i = 0; i < 50; ++i) {  // as install() and disabled() do, over and over
    clear("sgmv");
    set_sgmv(16, all_cuda);
    op_table::set_table("lora_expand", "positions,rank,slices,true_ranks", std::vector<int64_t>{1, 1, 1, 1},
                        std::vector<int64_t>{16, 16, 1, 1}, all_cuda);
  }
  EXPECT_EQ(op_table::kept_tables(), kept);
  set_sgmv(17, all_cuda);  // a different table is kept as well
  EXPECT_EQ(op_table::kept_tables(), kept + 1);
  EXPECT_EQ(op_table::choice("sgmv", std::vector<int64_t>{17, 16, 1, 2}), "cuda");
  clear("sgmv");
  clear("lora_expand");
}

TEST(OpTable, TritonRegimesWithoutATritonTwinAreRefused) {
  std::vector<int64_t> one_triton(16, 0);
  one_triton[0] = 1;
  const size_t kept = op_table::kept_tables();
  try {
    set_sgmv(16, one_triton);
    FAIL() << "a Triton regime was accepted without a CUDA kernel of lora_ops::_triton_sgmv";
  } catch (const c10::Error& e) {
    EXPECT_NE(e.msg().find("lora_ops::_triton_sgmv, which has no CUDA kernel (Triton absent)"), std::string::npos)
        << e.msg();
  }
  EXPECT_EQ(op_table::kept_tables(), kept);
  EXPECT_EQ(op_table::choice("sgmv", std::vector<int64_t>{1, 1, 1, 1}), "cuda");
}

TEST(OpTable, ChoiceNamesAnUnknownOpAndAWrongValueCount) {
  EXPECT_THROW(op_table::choice("bgmv", std::vector<int64_t>{1, 1, 1}), c10::ValueError);
  EXPECT_THROW(op_table::choice("sgmv", std::vector<int64_t>{1, 1, 1}), c10::ValueError);  // sgmv has 4 axes
  EXPECT_THROW(op_table::choice("grouped_gemm", std::vector<int64_t>{1, 1, 1, 1}), c10::ValueError);  // 3
}
