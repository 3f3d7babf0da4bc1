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

}  // namespace clef
