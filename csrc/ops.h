// Host entries of every op, as registered in bindings.cpp. Each checks its arguments (shape, dtype,
// device, layout) with messages a user can act on, then runs the CPU or CUDA implementation.
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>
#include <string>
#include <vector>

#include <c10/util/string_view.h>

namespace clef {

void causal_conv1d_fwd(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                       at::Tensor& conv_states, const at::Tensor& cu_seqlens, const at::Tensor& state_indices,
                       const at::Tensor& has_initial_state, bool silu, at::Tensor& out);
void causal_conv1d_update(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                          at::Tensor& conv_states, const at::Tensor& state_indices, bool silu, at::Tensor& out);

void gated_delta_rule_chunk(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
                            const at::Tensor& beta, at::Tensor& states, const at::Tensor& cu_seqlens,
                            const at::Tensor& state_indices, const at::Tensor& has_initial_state, double scale,
                            bool use_qk_l2norm, at::Tensor& out, c10::string_view kernel);
// Which kernel gated_delta_rule_chunk would run for a pack of these tensors: "chunked", "serial" or "cpu" (kernel:
// "auto", or a forced one, which raises when it cannot run them).
std::string gated_delta_rule_dispatch(const at::Tensor& q, const at::Tensor& v, const at::Tensor& cu_seqlens,
                                      c10::string_view kernel);
// The same with the chunked kernel's state-pass variant named: "chunked:s32", "chunked:d128", ..., else as above.
std::string gated_delta_rule_variant(const at::Tensor& q, const at::Tensor& v, const at::Tensor& cu_seqlens,
                                     c10::string_view kernel);
void gated_delta_rule_recurrent(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
                                const at::Tensor& beta, at::Tensor& states, const at::Tensor& state_indices,
                                double scale, bool use_qk_l2norm, at::Tensor& out);

void reshape_and_cache(const at::Tensor& key, const at::Tensor& value, at::Tensor& key_cache, at::Tensor& value_cache,
                       const at::Tensor& slot_mapping);
void paged_attention(const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
                     const at::Tensor& cu_seqlens_q, const at::Tensor& context_lens, const at::Tensor& block_tables,
                     double scale, at::Tensor& out, c10::string_view kernel, int64_t max_query_len);
// Which kernel paged_attention would run for these arguments: "wmma", "wmma2", "simt" or "cpu" (kernel:
// "auto", or a forced one, which raises when it cannot run them).
std::string paged_attention_dispatch(const at::Tensor& query, const at::Tensor& key_cache,
                                     const at::Tensor& value_cache, const at::Tensor& cu_seqlens_q,
                                     const at::Tensor& context_lens, const at::Tensor& block_tables,
                                     c10::string_view kernel);

// The trunk's glue, fused (glue/glue.h has the layouts and formulas).
void add_rms_norm(at::Tensor& x, const std::optional<at::Tensor>& delta, const at::Tensor& scale, double eps,
                  at::Tensor& out);
void silu_mul(const at::Tensor& gate_up, at::Tensor& out);
void gated_rms_norm(const at::Tensor& core, const at::Tensor& z, const at::Tensor& weight, double eps, at::Tensor& out);
void rms_norm_rope(const at::Tensor& x, const at::Tensor& scale, const at::Tensor& cos, const at::Tensor& sin,
                   double eps, at::Tensor& out);
void sigmoid_gate(const at::Tensor& attn, const at::Tensor& gate, at::Tensor& out);

// The attention tiles a device gets for a head dim (paged_attention.h's rule), in words: the tensor-core
// tile where there is one, and the SIMT tile.
std::string paged_attention_tiles(int64_t head_dim, int64_t compute_capability, int64_t smem_limit);

// out[r, c] = qweight[r, c] * scale[r] in out's dtype (int8 weights with per-row fp32 scales).
void dequantize_int8(const at::Tensor& qweight, const at::Tensor& scale, at::Tensor& out);
// The fused W8A16 GEMM for at most 64 rows: out = (x @ qweight^T) * scale, read int8 once, no scratch.
void int8_linear(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scale, at::Tensor& out);

// The CPU kernels' instruction-set variant (common/cpu_kernel.h): "avx512", "avx2" or "baseline".
std::vector<std::string> supported_cpu_isas();  // best first
std::string get_cpu_isa();
// Per variant (avx512, avx2, baseline), how many CPU kernel calls ran it since the library loaded.
std::vector<int64_t> cpu_isa_calls();
// name: "auto" (the best supported) or one of supported_cpu_isas(); returns the previous choice.
std::string set_cpu_isa(c10::string_view name);

}  // namespace clef
