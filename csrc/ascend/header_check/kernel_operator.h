// The header check's kernel_operator.h: the basic-API part of asc-devkit's (the kernels use nothing of the
// advanced, tensor or SIMT APIs, whose headers need more of the compiler than the stand-ins provide).
#pragma once
#define __ASCENDC_INCLUDE_INTERNAL_HEADERS__
#include "kernel_tpipe.h"
#include "kernel_tensor.h"
#include "kernel_type.h"
#include "kernel_operator_data_copy_intf.h"
#include "kernel_operator_fixpipe_intf.h"
#include "kernel_operator_mm_intf.h"
#include "kernel_operator_common_intf.h"
#include "kernel_operator_vec_binary_intf.h"
#include "kernel_operator_vec_binary_scalar_intf.h"
#include "kernel_operator_vec_duplicate_intf.h"
#include "kernel_operator_vec_vconv_intf.h"
#include "kernel_operator_scalar_intf.h"
#include "kernel_operator_sys_var_intf.h"
#include "kernel_operator_utils_intf.h"
