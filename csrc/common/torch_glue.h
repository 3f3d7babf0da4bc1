// Torch-side helpers for the host entries (*_ops.cpp): argument checks with messages a user can act on,
// and the CPU/CUDA dispatch. Never included by kernel files.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <string>
#include <utility>

#include "common/hd.h"

#ifdef CLEF_WITH_CUDA
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

namespace clef {

inline ScalarKind activation_kind(const at::Tensor& t, const char* op, const char* name) {
  switch (t.scalar_type()) {
    case at::kFloat:
      return ScalarKind::F32;
    case at::kHalf:
      return ScalarKind::F16;
    case at::kBFloat16:
      return ScalarKind::BF16;
    default:
      TORCH_CHECK_TYPE(false, op, ": ", name, " must be float32, float16 or bfloat16, got ", t.scalar_type());
  }
}

inline void check_dtype(const at::Tensor& t, at::ScalarType dtype, const char* op, const char* name) {
  TORCH_CHECK_TYPE(t.scalar_type() == dtype, op, ": ", name, " must be ", dtype, ", got ", t.scalar_type());
}

inline void check_device(const at::Tensor& t, const at::Tensor& ref, const char* op, const char* name) {
  TORCH_CHECK(t.device() == ref.device(), op, ": ", name, " is on ", t.device(), " but the inputs are on ", ref.device());
}

inline void check_shape(const at::Tensor& t, at::IntArrayRef expected, const char* op, const char* name) {
  TORCH_CHECK_VALUE(t.sizes() == expected, op, ": ", name, " must have shape ", expected, ", got ", t.sizes());
}

inline void check_dim(const at::Tensor& t, int64_t dim, const char* op, const char* name, const char* layout) {
  TORCH_CHECK_VALUE(t.dim() == dim, op, ": ", name, " must be ", layout, " (", dim, " dims), got shape ", t.sizes());
}

inline void check_contiguous(const at::Tensor& t, const char* op, const char* name) {
  TORCH_CHECK_VALUE(t.is_contiguous(), op, ": ", name, " must be contiguous (strides ", t.strides(), ")");
}

inline void check_last_dim_contiguous(const at::Tensor& t, const char* op, const char* name) {
  TORCH_CHECK_VALUE(t.size(-1) <= 1 || t.stride(-1) == 1, op, ": ", name,
                    " must have a contiguous last dimension (strides ", t.strides(), ")");
}

// The bytes [first, last] a tensor's elements span (strides may be any non-negative values).
inline std::pair<const char*, const char*> byte_span(const at::Tensor& t) {
  const char* first = static_cast<const char*>(t.data_ptr());
  int64_t last = 0;
  for (int64_t d = 0; d < t.dim(); ++d) last += (t.size(d) - 1) * t.stride(d);
  return {first, first + (last + 1) * t.element_size() - 1};
}

// `out` written by a kernel while `input` is read: refused when their memory overlaps, unless the op reads
// each element before writing it in the same thread (`identical_ok`) and out is input itself (same
// address, shape and strides). A partial overlap would race: a kernel thread could read a value another
// has already overwritten.
inline void check_no_overlap(const at::Tensor& out, const at::Tensor& input, const char* op, const char* out_name,
                             const char* input_name, bool identical_ok) {
  if (out.numel() == 0 || input.numel() == 0) return;
  const auto [out_first, out_last] = byte_span(out);
  const auto [in_first, in_last] = byte_span(input);
  if (out_last < in_first || in_last < out_first) return;
  const bool identical = out.data_ptr() == input.data_ptr() && out.sizes() == input.sizes() &&
                         out.strides() == input.strides() && out.scalar_type() == input.scalar_type();
  TORCH_CHECK_VALUE(identical && identical_ok, op, ": ", out_name, " overlaps ", input_name, " in memory",
                    identical_ok ? " (in place, it must be " : " (it must be a separate tensor", identical_ok ? input_name : "",
                    identical_ok ? " itself: same address, shape and strides)" : ")");
}

inline int32_t checked_int32(int64_t v, const char* op, const char* what) {
  TORCH_CHECK_VALUE(v >= 0 && v <= INT32_MAX, op, ": ", what, " = ", v, " does not fit the kernels' int32 indexing");
  return static_cast<int32_t>(v);
}

// Metadata checks that need the values: cheap on CPU tensors, so done there; on a GPU they would
// cost a device-to-host copy per call, so the CUDA kernels instead treat out-of-range metadata as empty.
inline void check_cu_seqlens_values(const at::Tensor& cu_seqlens, int64_t num_tokens, const char* op, const char* name) {
  if (!cu_seqlens.is_cpu()) return;
  const int32_t* cu = cu_seqlens.data_ptr<int32_t>();
  const int64_t n = cu_seqlens.numel();
  TORCH_CHECK_VALUE(n >= 1 && cu[0] == 0, op, ": ", name, "[0] must be 0");
  for (int64_t i = 1; i < n; ++i)
    TORCH_CHECK_VALUE(cu[i] >= cu[i - 1], op, ": ", name, " must be non-decreasing, but ", name, "[", i, "] = ", cu[i],
                      " < ", name, "[", i - 1, "] = ", cu[i - 1]);
  TORCH_CHECK_VALUE(cu[n - 1] == num_tokens, op, ": ", name, "[-1] = ", cu[n - 1], " must equal the number of tokens (",
                    num_tokens, ")");
}

// cu_seqlens [batch + 1] and has_initial_state [batch] of a pack of num_tokens tokens (see PackedSeq).
inline void check_pack(const at::Tensor& cu_seqlens, const at::Tensor& has_initial_state, int64_t batch,
                       int64_t num_tokens, const at::Tensor& ref, const char* op) {
  check_dim(cu_seqlens, 1, op, "cu_seqlens", "[batch + 1]");
  check_shape(cu_seqlens, {batch + 1}, op, "cu_seqlens");
  check_dtype(cu_seqlens, at::kInt, op, "cu_seqlens");
  check_contiguous(cu_seqlens, op, "cu_seqlens");
  check_device(cu_seqlens, ref, op, "cu_seqlens");
  check_shape(has_initial_state, {batch}, op, "has_initial_state");
  check_dtype(has_initial_state, at::kBool, op, "has_initial_state");
  check_contiguous(has_initial_state, op, "has_initial_state");
  check_device(has_initial_state, ref, op, "has_initial_state");
  check_cu_seqlens_values(cu_seqlens, num_tokens, op, "cu_seqlens");
}

inline void check_state_indices_values(const at::Tensor& state_indices, int64_t num_slots, const char* op) {
  if (!state_indices.is_cpu()) return;
  const int32_t* idx = state_indices.data_ptr<int32_t>();
  const int64_t n = state_indices.numel();
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK_VALUE(idx[i] < num_slots, op, ": state_indices[", i, "] = ", idx[i], " is out of range for ", num_slots,
                      " state slots (negative means 'no slot')");
    for (int64_t j = 0; j < i && idx[i] >= 0; ++j)
      TORCH_CHECK_VALUE(idx[j] != idx[i], op, ": sequences ", j, " and ", i, " share state slot ", idx[i],
                        "; every sequence in a batch needs its own slot");
  }
}

inline bool cuda_build() {
#ifdef CLEF_WITH_CUDA
  return true;
#else
  return false;
#endif
}

// CPU tensors run the one CPU implementation (except under the CUDA simulator, which runs the CUDA
// launcher on them): a forced CUDA kernel there would silently test nothing.
inline bool runs_cuda_launcher(const at::Tensor& t) {
#ifdef CLEF_CUDA_SIM
  return t.is_cpu();
#else
  return t.is_cuda();
#endif
}

// Runs the CUDA launcher for CUDA tensors and the CPU implementation for CPU tensors. Under the
// test-only CUDA simulator (CLEF_CUDA_SIM) CPU tensors go through the CUDA launcher instead.
template <typename CudaLaunch, typename CpuRun>
void run_on_device(const at::Tensor& ref, const char* op, CudaLaunch&& cuda_launch, CpuRun&& cpu_run) {
  if (ref.is_cuda()) {
#ifdef CLEF_WITH_CUDA
    c10::cuda::CUDAGuard guard(ref.device());
    const char* err = cuda_launch(static_cast<void*>(c10::cuda::getCurrentCUDAStream(ref.device().index()).stream()));
    TORCH_CHECK(err == nullptr, op, ": CUDA launch failed: ", err);
#else
    TORCH_CHECK(false, op, ": clef_cuda._C was built without CUDA kernels; rebuild it with a CUDA toolchain (README)");
#endif
    return;
  }
  TORCH_CHECK(ref.is_cpu(), op, ": unsupported device ", ref.device());
#ifdef CLEF_CUDA_SIM
  const char* err = cuda_launch(nullptr);
  TORCH_CHECK(err == nullptr, op, ": simulated CUDA launch failed: ", err);
  (void)cpu_run;
#else
  cpu_run();
#endif
}

}  // namespace clef
