// Stand-in for CANN's acl/acl.h in the CPU-model build: the one query registration.cpp makes. The model is a
// 910B2-like device with 24 AI cores; LORA_OPS_ASCEND_MODEL_AI_CORES overrides the count.
#pragma once
#include <cstdint>
#include <cstdlib>

using aclError = int;
constexpr aclError ACL_SUCCESS = 0;
enum aclDeviceInfo { ACL_DEVICE_INFO_AI_CORE_NUM = 0, ACL_DEVICE_INFO_VECTOR_CORE_NUM = 1 };

inline aclError aclGetDeviceCapability(uint32_t, aclDeviceInfo info, int64_t* value) {
  const char* env = std::getenv("LORA_OPS_ASCEND_MODEL_AI_CORES");
  const int64_t cores = env != nullptr ? std::atoll(env) : 24;
  *value = info == ACL_DEVICE_INFO_AI_CORE_NUM ? cores : 2 * cores;
  return ACL_SUCCESS;
}
