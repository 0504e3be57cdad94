// What the op files need of torch and no more: the Tensor, its checks, at::parallel_for and the few ops
// they call (empty, empty_like, cat, linear). No file includes <torch/extension.h> (pybind11 and the whole
// C++ frontend): each file that did took about 20 s longer to compile, and a first start compiles every file;
// bindings.cpp takes torch's pybind11 type casters alone.
#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/linear.h>

namespace torch {  // the extension API's names the op files use (torch/types.h's, without its includes)
using namespace at;
constexpr auto kUInt8 = at::kByte;
constexpr auto kInt8 = at::kChar;
constexpr auto kInt32 = at::kInt;
constexpr auto kInt64 = at::kLong;
constexpr auto kFloat16 = at::kHalf;
constexpr auto kFloat32 = at::kFloat;
}  // namespace torch
