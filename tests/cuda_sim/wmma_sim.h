// Test-only emulation of nvcuda::wmma (the 16x16x16 shape) for the CUDA simulator; included by cuda_sim.h.
//
// Every lane of a warp holds the whole tile: a fragment is 256 elements, each lane loads all of them
// itself, and mma_sync computes the whole 16 x 16 product in fp32 (f16/bf16 inputs widened exactly,
// products summed in k order). This is valid for any kernel that uses only the documented API, because
// that API leaves the element-to-lane mapping unspecified: a kernel may apply the same operation to every
// element of a fragment (num_elements, x[i]), or learn an element's row or column by loading a tile of
// indices, but must never assume which elements a lane holds. The real mapping (8 accumulator elements
// per lane on sm_70..sm_90, laid out differently per arch) is NOT emulated, and nothing may rely on it.
// To make reliance show, element (r, c) sits at x[element_slot(r, c)], a fixed scramble of row-major
// order: a kernel that reads x[i] as row i / 16 gets wrong rows here.
//
// What a GPU requires is checked: all 32 lanes take part in each load/store/mma (a warp barrier: a call
// from divergent code deadlocks and is reported), tile pointers are 32-byte aligned and ldm is a multiple
// of 16 bytes. store_matrix_sync is performed by lane 0 after the warp converges, so another lane reads
// the stored tile only after a __syncwarp, as on the hardware (where each lane stores its own elements).
#pragma once

#include <cstddef>
#include <stdexcept>
#include <string>
#include <type_traits>

namespace clef_sim {
// Where element (r, c) of a tile lives in a fragment's x[]: a bijection of 0..255 (157 is odd) that is
// not row-major, not column-major and not a transpose.
constexpr int element_slot(int r, int c) { return ((r * 16 + c) * 157 + 91) % 256; }
}  // namespace clef_sim

namespace nvcuda {
namespace wmma {

struct matrix_a;
struct matrix_b;
struct accumulator;
struct row_major;
struct col_major;
enum layout_t { mem_row_major, mem_col_major };

template <typename Use, int M, int N, int K, typename T, typename Layout = void>
class fragment {
  static_assert(M == 16 && N == 16 && K == 16, "the simulator emulates the 16x16x16 WMMA shape only");
  static_assert(std::is_same_v<Use, accumulator> ? std::is_same_v<Layout, void> : !std::is_same_v<Layout, void>,
                "matrix_a/matrix_b fragments name a layout; accumulators do not");
  static_assert(std::is_same_v<Use, accumulator> ? std::is_same_v<T, float> || std::is_same_v<T, __half>
                                                 : std::is_same_v<T, __half> || std::is_same_v<T, __nv_bfloat16>,
                "f16/bf16 inputs, f16/fp32 accumulators");

 public:
  static constexpr int num_elements = 16 * 16;  // the whole tile, in every lane (see above)
  T x[num_elements];                             // element (r, c) at x[clef_sim::element_slot(r, c)]
};

}  // namespace wmma
}  // namespace nvcuda

namespace clef_sim {

template <typename T>
inline void check_tile_pointer(const T* ptr, unsigned ldm, const char* what) {
  if (reinterpret_cast<uintptr_t>(ptr) % 32 != 0)
    throw std::runtime_error(std::string("simulated CUDA: ") + what + " needs a 256-bit aligned tile pointer");
  if ((ldm * sizeof(T)) % 16 != 0 || ldm < 16)
    throw std::runtime_error(std::string("simulated CUDA: ") + what + " needs ldm >= 16 and a multiple of 16 bytes, got " +
                             std::to_string(ldm) + " elements");
}

// Element (r, c) of a tile at ptr with leading dimension ldm.
inline size_t tile_index(int r, int c, unsigned ldm, bool row_major) {
  return row_major ? static_cast<size_t>(r) * ldm + c : static_cast<size_t>(c) * ldm + r;
}

}  // namespace clef_sim

namespace nvcuda {
namespace wmma {

template <typename Use, typename T, typename Layout>
inline void fill_fragment(fragment<Use, 16, 16, 16, T, Layout>& f, const T& value) {
  for (auto& e : f.x) e = value;
}

// Accumulators are filled from a float even when their element type is __half, as on a GPU.
template <typename Use, typename Layout>
inline void fill_fragment(fragment<Use, 16, 16, 16, __half, Layout>& f, float value) {
  for (auto& e : f.x) e = __half(value);
}

template <typename Use, typename T, typename Layout>
inline void load_matrix_sync(fragment<Use, 16, 16, 16, T, Layout>& f, const T* ptr, unsigned ldm) {
  static_assert(!std::is_same_v<Use, accumulator>, "accumulators are loaded with a layout_t");
  clef_sim::warp_converge("wmma::load_matrix_sync");
  clef_sim::check_tile_pointer(ptr, ldm, "wmma::load_matrix_sync");
  const bool row = std::is_same_v<Layout, row_major>;
  for (int r = 0; r < 16; ++r)
    for (int c = 0; c < 16; ++c) f.x[clef_sim::element_slot(r, c)] = ptr[clef_sim::tile_index(r, c, ldm, row)];
}

template <typename T>
inline void load_matrix_sync(fragment<accumulator, 16, 16, 16, T>& f, const T* ptr, unsigned ldm, layout_t layout) {
  clef_sim::warp_converge("wmma::load_matrix_sync");
  clef_sim::check_tile_pointer(ptr, ldm, "wmma::load_matrix_sync");
  for (int r = 0; r < 16; ++r)
    for (int c = 0; c < 16; ++c)
      f.x[clef_sim::element_slot(r, c)] = ptr[clef_sim::tile_index(r, c, ldm, layout == mem_row_major)];
}

template <typename T>
inline void store_matrix_sync(T* ptr, const fragment<accumulator, 16, 16, 16, T>& f, unsigned ldm, layout_t layout) {
  clef_sim::warp_converge("wmma::store_matrix_sync");
  clef_sim::check_tile_pointer(ptr, ldm, "wmma::store_matrix_sync");
  if (clef_sim::lane_id() != 0) return;  // one writer; the others see it after a __syncwarp
  for (int r = 0; r < 16; ++r)
    for (int c = 0; c < 16; ++c)
      ptr[clef_sim::tile_index(r, c, ldm, layout == mem_row_major)] = f.x[clef_sim::element_slot(r, c)];
}

// d = a b + c, in fp32 (d may be c).
template <typename TD, typename TI, typename LayoutA, typename LayoutB, typename TC>
inline void mma_sync(fragment<accumulator, 16, 16, 16, TD>& d, const fragment<matrix_a, 16, 16, 16, TI, LayoutA>& a,
                     const fragment<matrix_b, 16, 16, 16, TI, LayoutB>& b, const fragment<accumulator, 16, 16, 16, TC>& c) {
  clef_sim::warp_converge("wmma::mma_sync");
  float fa[256], fb[256], fd[256];  // row-major
  for (int r = 0; r < 16; ++r)
    for (int col = 0; col < 16; ++col) {
      const int slot = clef_sim::element_slot(r, col);
      fa[r * 16 + col] = static_cast<float>(a.x[slot]);
      fb[r * 16 + col] = static_cast<float>(b.x[slot]);
      fd[r * 16 + col] = static_cast<float>(c.x[slot]);
    }
  for (int r = 0; r < 16; ++r)
    for (int k = 0; k < 16; ++k) {
      const float ark = fa[r * 16 + k];
      for (int col = 0; col < 16; ++col) fd[r * 16 + col] += ark * fb[k * 16 + col];
    }
  for (int r = 0; r < 16; ++r)
    for (int col = 0; col < 16; ++col) d.x[clef_sim::element_slot(r, col)] = TD(fd[r * 16 + col]);
}

}  // namespace wmma
}  // namespace nvcuda
