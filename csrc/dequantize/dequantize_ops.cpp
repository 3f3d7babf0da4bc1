// Host entry of the dequantize family: check every argument, fill DequantizeParams, dispatch.
#include "common/torch_glue.h"
#include "dequantize/dequantize_launch.h"
#include "ops.h"

namespace clef {

void dequantize_int8(const at::Tensor& qweight, const at::Tensor& scale, at::Tensor& out) {
  const char* op = "dequantize_int8";
  check_dim(qweight, 2, op, "qweight", "[rows, cols]");
  check_dtype(qweight, at::kChar, op, "qweight");
  check_contiguous(qweight, op, "qweight");
  const int64_t rows = qweight.size(0), cols = qweight.size(1);
  check_shape(scale, {rows}, op, "scale");
  check_dtype(scale, at::kFloat, op, "scale");
  check_contiguous(scale, op, "scale");
  check_device(scale, qweight, op, "scale");
  check_shape(out, {rows, cols}, op, "out");
  const ScalarKind kind = activation_kind(out, op, "out");
  check_contiguous(out, op, "out");
  check_device(out, qweight, op, "out");
  if (cols % kDequantizeVector == 0 && rows > 0 && cols > 0)
    TORCH_CHECK_VALUE(aligned_16_bytes(qweight.data_ptr()) && aligned_16_bytes(out.data_ptr()), op,
                      ": qweight and out must be 16-byte aligned (pass whole tensors, not offset views)");

  DequantizeParams p;
  p.qweight = qweight.data_ptr<int8_t>();
  p.scale = scale.data_ptr<float>();
  p.out = out.data_ptr();
  p.rows = rows;
  p.cols = cols;
  run_on_device(
      qweight, op, [&](void* stream) { return dequantize_int8_cuda(p, kind, stream); },
      [&] { dequantize_int8_cpu(p, kind); });
}

void int8_linear(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scale, at::Tensor& out) {
  const char* op = "int8_linear";
  check_dim(x, 2, op, "x", "[rows, in_features]");
  const ScalarKind kind = activation_kind(x, op, "x");
  check_last_dim_contiguous(x, op, "x");
  TORCH_CHECK_VALUE(x.size(0) <= kInt8LinearMaxRows, op, ": at most ", kInt8LinearMaxRows, " rows a call, got ",
                    x.size(0), " (larger steps run dequantize_int8 + GEMM)");
  check_dim(qweight, 2, op, "qweight", "[out_features, in_features]");
  check_dtype(qweight, at::kChar, op, "qweight");
  check_contiguous(qweight, op, "qweight");
  check_device(qweight, x, op, "qweight");
  TORCH_CHECK_VALUE(qweight.size(1) == x.size(1), op, ": qweight has ", qweight.size(1), " in_features, x has ",
                    x.size(1));
  check_shape(scale, {qweight.size(0)}, op, "scale");
  check_dtype(scale, at::kFloat, op, "scale");
  check_contiguous(scale, op, "scale");
  check_device(scale, x, op, "scale");
  check_shape(out, {x.size(0), qweight.size(0)}, op, "out");
  check_dtype(out, x.scalar_type(), op, "out");
  check_contiguous(out, op, "out");
  check_device(out, x, op, "out");
  check_no_overlap(out, x, op, "out", "x", false);

  Int8LinearParams p;
  p.x = x.data_ptr();
  p.x_row_stride = x.size(0) > 1 ? x.stride(0) : x.size(1);
  p.qweight = qweight.data_ptr<int8_t>();
  p.scale = scale.data_ptr<float>();
  p.out = out.data_ptr();
  p.rows = static_cast<int>(x.size(0));
  p.in_features = x.size(1);
  p.out_features = qweight.size(0);
  run_on_device(
      x, op, [&](void* stream) { return int8_linear_cuda(p, kind, stream); }, [&] { int8_linear_cpu(p, kind); });
}

}  // namespace clef
