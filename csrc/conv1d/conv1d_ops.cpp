// Host entries of the conv1d family: check every argument, fill Conv1dParams, dispatch.
#include "common/torch_glue.h"
#include "conv1d/conv1d_launch.h"
#include "ops.h"

namespace clef {
namespace {

Conv1dParams conv1d_params(const char* op, const at::Tensor& x, const at::Tensor& weight,
                           const std::optional<at::Tensor>& bias, at::Tensor& conv_states, const at::Tensor& state_indices,
                           bool silu, at::Tensor& out) {
  check_dim(x, 2, op, "x", "[num_tokens, channels]");
  activation_kind(x, op, "x");
  check_last_dim_contiguous(x, op, "x");
  const int64_t num_tokens = x.size(0);
  const int64_t channels = x.size(1);
  check_dim(weight, 2, op, "weight", "[channels, width]");
  const int64_t width = weight.size(1);
  check_shape(weight, {channels, width}, op, "weight");
  TORCH_CHECK_VALUE(width >= 2 && width <= kConvMaxWidth, op, ": conv width must be in [2, ", kConvMaxWidth, "], got ",
                    width);
  check_dtype(weight, at::kFloat, op, "weight");
  check_contiguous(weight, op, "weight");
  check_device(weight, x, op, "weight");
  if (bias.has_value()) {
    check_shape(*bias, {channels}, op, "bias");
    check_dtype(*bias, at::kFloat, op, "bias");
    check_contiguous(*bias, op, "bias");
    check_device(*bias, x, op, "bias");
  }
  check_dim(conv_states, 3, op, "conv_states", "[num_slots, channels, width - 1]");
  check_shape(conv_states, {conv_states.size(0), channels, width - 1}, op, "conv_states");
  check_dtype(conv_states, x.scalar_type(), op, "conv_states");
  check_contiguous(conv_states, op, "conv_states");
  check_device(conv_states, x, op, "conv_states");
  check_dim(state_indices, 1, op, "state_indices", "[batch]");
  check_dtype(state_indices, at::kInt, op, "state_indices");
  check_contiguous(state_indices, op, "state_indices");
  check_device(state_indices, x, op, "state_indices");
  check_shape(out, {num_tokens, channels}, op, "out");
  check_dtype(out, x.scalar_type(), op, "out");
  check_contiguous(out, op, "out");
  check_device(out, x, op, "out");
  check_state_indices_values(state_indices, conv_states.size(0), op);
  if (x.is_cuda() && cuda_build())
    TORCH_CHECK_VALUE(conv1d_cuda_supports_width(static_cast<int>(width)), op,
                      ": the CUDA kernels are compiled for conv width 4, got ", width);

  Conv1dParams p;
  p.x = x.data_ptr();
  p.x_token_stride = x.stride(0);
  p.weight = weight.data_ptr<float>();
  p.bias = bias.has_value() ? bias->data_ptr<float>() : nullptr;
  p.conv_states = conv_states.data_ptr();
  p.out = out.data_ptr();
  p.state_indices = state_indices.data_ptr<int32_t>();
  p.num_tokens = num_tokens;
  p.batch = checked_int32(state_indices.size(0), op, "batch");
  p.channels = checked_int32(channels, op, "channels");
  p.width = static_cast<int>(width);
  p.num_slots = checked_int32(conv_states.size(0), op, "num_slots");
  p.silu = silu;
  return p;
}

void run_conv1d(const char* op, const Conv1dParams& p, const at::Tensor& x) {
  const ScalarKind kind = activation_kind(x, op, "x");
  run_on_device(
      x, op, [&](void* stream) { return conv1d_fwd_cuda(p, kind, stream); }, [&] { conv1d_fwd_cpu(p, kind); });
}

}  // namespace

void causal_conv1d_fwd(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                       at::Tensor& conv_states, const at::Tensor& cu_seqlens, const at::Tensor& state_indices,
                       const at::Tensor& has_initial_state, bool silu, at::Tensor& out) {
  const char* op = "causal_conv1d_fwd";
  Conv1dParams p = conv1d_params(op, x, weight, bias, conv_states, state_indices, silu, out);
  check_pack(cu_seqlens, has_initial_state, state_indices.size(0), x.size(0), x, op);
  p.cu_seqlens = cu_seqlens.data_ptr<int32_t>();
  p.has_initial_state = has_initial_state.data_ptr<bool>();
  run_conv1d(op, p, x);
}

void causal_conv1d_update(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                          at::Tensor& conv_states, const at::Tensor& state_indices, bool silu, at::Tensor& out) {
  const char* op = "causal_conv1d_update";
  Conv1dParams p = conv1d_params(op, x, weight, bias, conv_states, state_indices, silu, out);
  check_shape(state_indices, {x.size(0)}, op, "state_indices");
  run_conv1d(op, p, x);
}

}  // namespace clef
