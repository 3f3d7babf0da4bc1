// The op schemas (namespace `clef`) and their CPU/CUDA registrations. No math here.
//
// Every op writes into tensors the caller allocated (clef_cuda/ops.py does) and returns nothing;
// `Tensor(a!)` marks what it mutates so torch.compile and functionalization know.
#include <Python.h>
#include <torch/library.h>

#include "ops.h"

// The test-only CUDA simulator builds this same file into a second module whose ops run the CUDA
// kernels on CPU tensors; it registers them under `clef_sim` so both can be loaded side by side.
#ifdef CLEF_CUDA_SIM
#define CLEF_NS clef_sim
#else
#define CLEF_NS clef
#endif
#define CLEF_LIBRARY(ns, m) TORCH_LIBRARY(ns, m)
#define CLEF_LIBRARY_IMPL(ns, key, m) TORCH_LIBRARY_IMPL(ns, key, m)

// setup.py passes the compiled archs as a bare token (shell-quoting a string literal through ninja is
// fragile), e.g. CLEF_CUDA_ARCH_TOKEN=75_80_90_100_120 (SASS) and CLEF_CUDA_PTX_TOKEN=90 (the archs whose
// PTX is embedded for the driver to JIT on newer cards); they are stringified below.
#ifndef CLEF_CUDA_ARCH_TOKEN
#define CLEF_CUDA_ARCH_TOKEN none
#endif
#ifndef CLEF_CUDA_PTX_TOKEN
#define CLEF_CUDA_PTX_TOKEN none
#endif

CLEF_LIBRARY(CLEF_NS, m) {
  m.def(
      "causal_conv1d_fwd(Tensor x, Tensor weight, Tensor? bias, Tensor(a!) conv_states, Tensor cu_seqlens, "
      "Tensor state_indices, Tensor has_initial_state, bool silu, Tensor(b!) out) -> ()");
  m.def(
      "causal_conv1d_update(Tensor x, Tensor weight, Tensor? bias, Tensor(a!) conv_states, Tensor state_indices, "
      "bool silu, Tensor(b!) out) -> ()");
  m.def(
      "gated_delta_rule_chunk(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, Tensor(a!) states, "
      "Tensor cu_seqlens, Tensor state_indices, Tensor has_initial_state, float scale, bool use_qk_l2norm, "
      "Tensor(b!) out, str kernel=\"auto\") -> ()");
  m.def("gated_delta_rule_dispatch(Tensor q, Tensor v, Tensor cu_seqlens, str kernel=\"auto\") -> str");
  m.def("gated_delta_rule_variant(Tensor q, Tensor v, Tensor cu_seqlens, str kernel=\"auto\") -> str");
  m.def(
      "gated_delta_rule_recurrent(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, Tensor(a!) states, "
      "Tensor state_indices, float scale, bool use_qk_l2norm, Tensor(b!) out) -> ()");
  m.def(
      "reshape_and_cache(Tensor key, Tensor value, Tensor(a!) key_cache, Tensor(b!) value_cache, "
      "Tensor slot_mapping) -> ()");
  m.def(
      "paged_attention(Tensor query, Tensor key_cache, Tensor value_cache, Tensor cu_seqlens_q, "
      "Tensor context_lens, Tensor block_tables, float scale, Tensor(a!) out, str kernel=\"auto\", "
      "int max_query_len=0) -> ()");
  m.def(
      "paged_attention_dispatch(Tensor query, Tensor key_cache, Tensor value_cache, Tensor cu_seqlens_q, "
      "Tensor context_lens, Tensor block_tables, str kernel=\"auto\") -> str");
  m.def("dequantize_int8(Tensor qweight, Tensor scale, Tensor(a!) out) -> ()");
  m.def("int8_linear(Tensor x, Tensor qweight, Tensor scale, Tensor(a!) out) -> ()");
  m.def("add_rms_norm(Tensor(a!) x, Tensor? delta, Tensor scale, float eps, Tensor(b!) out) -> ()");
  m.def("silu_mul(Tensor gate_up, Tensor(a!) out) -> ()");
  m.def("gated_rms_norm(Tensor core, Tensor z, Tensor weight, float eps, Tensor(a!) out) -> ()");
  m.def("rms_norm_rope(Tensor x, Tensor scale, Tensor cos, Tensor sin, float eps, Tensor(a!) out) -> ()");
  m.def("sigmoid_gate(Tensor attn, Tensor gate, Tensor(a!) out) -> ()");
  // No tensors: one kernel for every dispatch key.
  m.def("paged_attention_tiles(int head_dim, int compute_capability, int smem_limit) -> str",
        &clef::paged_attention_tiles);
  m.def("supported_cpu_isas() -> str[]", &clef::supported_cpu_isas);
  m.def("cpu_isa() -> str", &clef::get_cpu_isa);
  m.def("cpu_isa_calls() -> int[]", &clef::cpu_isa_calls);
  m.def("set_cpu_isa(str isa) -> str", &clef::set_cpu_isa);
}

#define CLEF_REGISTER_IMPLS(m)                                             \
  m.impl("causal_conv1d_fwd", &clef::causal_conv1d_fwd);                   \
  m.impl("causal_conv1d_update", &clef::causal_conv1d_update);             \
  m.impl("gated_delta_rule_chunk", &clef::gated_delta_rule_chunk);         \
  m.impl("gated_delta_rule_dispatch", &clef::gated_delta_rule_dispatch);   \
  m.impl("gated_delta_rule_variant", &clef::gated_delta_rule_variant);     \
  m.impl("gated_delta_rule_recurrent", &clef::gated_delta_rule_recurrent); \
  m.impl("reshape_and_cache", &clef::reshape_and_cache);                   \
  m.impl("paged_attention", &clef::paged_attention);                       \
  m.impl("paged_attention_dispatch", &clef::paged_attention_dispatch);     \
  m.impl("dequantize_int8", &clef::dequantize_int8);                       \
  m.impl("int8_linear", &clef::int8_linear);                               \
  m.impl("add_rms_norm", &clef::add_rms_norm);                             \
  m.impl("silu_mul", &clef::silu_mul);                                     \
  m.impl("gated_rms_norm", &clef::gated_rms_norm);                         \
  m.impl("rms_norm_rope", &clef::rms_norm_rope);                           \
  m.impl("sigmoid_gate", &clef::sigmoid_gate);

CLEF_LIBRARY_IMPL(CLEF_NS, CPU, m) { CLEF_REGISTER_IMPLS(m) }

#ifdef CLEF_WITH_CUDA
CLEF_LIBRARY_IMPL(CLEF_NS, CUDA, m) { CLEF_REGISTER_IMPLS(m) }
#endif

// A plain extension module: importing it runs the registrations above. No pybind11 (saves build time).
#ifndef TORCH_EXTENSION_NAME
#define TORCH_EXTENSION_NAME _C
#endif
#define CLEF_CONCAT(a, b) a##b
#define CLEF_PYINIT(name) CLEF_CONCAT(PyInit_, name)
#define CLEF_STR2(x) #x
#define CLEF_STR(x) CLEF_STR2(x)

PyMODINIT_FUNC CLEF_PYINIT(TORCH_EXTENSION_NAME)(void) {
  static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, CLEF_STR(TORCH_EXTENSION_NAME), nullptr, -1, nullptr,
                                      nullptr, nullptr, nullptr, nullptr};
  PyObject* mod = PyModule_Create(&module);
  if (mod == nullptr) return nullptr;
  // What this build contains, for clef_cuda.build_info(): "cpu", "cuda" (with the archs) or "cuda-sim".
#ifdef CLEF_WITH_CUDA
  const char* variant = "cuda";
#elif defined(CLEF_CUDA_SIM)
  const char* variant = "cuda-sim";
#else
  const char* variant = "cpu";
#endif
  if (PyModule_AddStringConstant(mod, "VARIANT", variant) < 0 ||
      PyModule_AddStringConstant(mod, "CUDA_ARCHS", CLEF_STR(CLEF_CUDA_ARCH_TOKEN)) < 0 ||
      PyModule_AddStringConstant(mod, "CUDA_PTX", CLEF_STR(CLEF_CUDA_PTX_TOKEN)) < 0) {
    Py_DECREF(mod);
    return nullptr;
  }
  return mod;
}
