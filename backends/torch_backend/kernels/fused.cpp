#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <algorithm>
#include <cmath>
#include <cstring>
#include <tuple>
#include <type_traits>
#include <vector>

// The layer's ops by file: fused_norm_rope.h (RMSNorm, RoPE and the cache write), fused_attend.h (attention,
// with attend_q8.h), fused_swiglu.h (SwiGLU); here the whole layer walk in one call and the registration.
#include "fused_norm_rope.h"
#include "fused_attend.h"
#include "fused_swiglu.h"

// ---- the whole layer stack in one call ----
// A decode step is ~270 op calls (4 products, 2 norms, RoPE, attention and SwiGLU per layer); from Python
// each costs ~3.5 us of dispatch and glue, ~1.3 ms of a ~5.2 ms step on the 2-core EPYC (decode_parts.py).
// Here the same kernels are called with the same arguments in the same order (the products through the
// dispatcher, ~0.2 us each; the fused ops directly), so the result is bitwise the Python walk's
// (layers.through_layers). Per matrix, mode: bit 2 int8 rows (hetero_sd_quant8::qgemm8) else float32 rows
// (hetero_sd_quant::qgemm), bit 1 the AVX-512 layout, bit 0 Q4_1 (else Q8_0). Those extensions must be loaded
// (the Python side has built the matrices with them).
using Product8 = at::Tensor(at::Tensor, at::Tensor, bool, bool, int64_t, int64_t);
using Product32 = at::Tensor(at::Tensor, at::Tensor, bool, bool, int64_t);

static at::Tensor product(const at::Tensor& x, const at::Tensor& packed, int64_t mode, int64_t amx, int64_t n) {
  const bool q41 = mode & 1, avx512 = mode & 2;
  if (mode & 4) {
    static auto op = c10::Dispatcher::singleton().findSchemaOrThrow("hetero_sd_quant8::qgemm8", "").typed<Product8>();
    return op.call(x, packed, q41, avx512, amx, n);
  }
  static auto op = c10::Dispatcher::singleton().findSchemaOrThrow("hetero_sd_quant::qgemm", "").typed<Product32>();
  return op.call(x, packed, q41, avx512, n);
}

// h [1, T, H] through L layers: per layer mats[4i..4i+3] = q|k|v, o, gate|up, down; biases[i] (q|k|v bias, or
// an empty tensor); norms[2i], norms[2i+1] = the post-attention norm and the next layer's input norm (or the
// final norm); qk_norms[2i], [2i+1] (Qwen3-style; an empty list: none). Returns [the rows after the final norm,
// the residual stream after each layer in `capture` (ascending)], as layers.through_layers does.
std::vector<at::Tensor> layers(at::Tensor h, at::Tensor first_norm, at::TensorList mats, at::IntArrayRef modes,
                               at::IntArrayRef amx, at::IntArrayRef ns, at::TensorList biases, at::TensorList norms,
                               at::TensorList qk_norms, at::TensorList kc, at::TensorList vc, at::Tensor cos,
                               at::Tensor sin, int64_t start, int64_t nh, int64_t nkv, double eps, bool wide,
                               bool causal, bool tiled, at::IntArrayRef capture, c10::optional<at::Tensor> slots,
                               c10::optional<at::Tensor> pos) {
  const int64_t L = (int64_t)kc.size();
  const bool batched = slots.has_value();  // rows are one token each of their own slot (rope_slots, attend_slots)
  TORCH_CHECK(batched == pos.has_value() && (!batched || h.size(1) == 1), "layers: slots and positions together, one token per row");
  TORCH_CHECK(h.dim() == 3 && (batched || h.size(0) == 1) && (int64_t)mats.size() == 4 * L && (int64_t)modes.size() == 4 * L &&
                  (int64_t)amx.size() == 4 * L && (int64_t)ns.size() == 4 * L && (int64_t)biases.size() == L &&
                  (int64_t)norms.size() == 2 * L && (int64_t)vc.size() == L &&
                  (qk_norms.empty() || (int64_t)qk_norms.size() == 2 * L),
              "layers: one row block [1, T, H] and per layer 4 matrices, a bias slot, 2 norms (and 2 q/k norms)");
  const int64_t T = h.size(1);
  std::vector<at::Tensor> out{rms_norm(h, first_norm, eps)};
  size_t next_capture = 0;
  for (int64_t i = 0; i < L; ++i) {
    const int64_t m = 4 * i;
    at::Tensor qkv = product(out[0], mats[m], modes[m], amx[m], ns[m]);
    if (biases[i].numel() > 0) qkv = qkv + biases[i];
    c10::optional<at::Tensor> qn, kn;
    if (!qk_norms.empty()) { qn = qk_norms[2 * i]; kn = qk_norms[2 * i + 1]; }
    at::Tensor q = batched ? rope_slots(qkv, cos, sin, kc[i], vc[i], *slots, *pos, nh, nkv, qn, kn, eps, tiled)
                           : rope_qkv(qkv, cos, sin, kc[i], vc[i], start, nh, nkv, qn, kn, eps, tiled);
    at::Tensor o = batched ? attend_slots(q, kc[i], vc[i], *slots, *pos, wide, tiled) : attend(q, kc[i], vc[i], start, wide, causal, tiled);
    at::Tensor a = product(o.reshape({h.size(0), T, -1}), mats[m + 1], modes[m + 1], amx[m + 1], ns[m + 1]);
    std::tie(h, out[0]) = add_rms_norm(h, a, norms[2 * i], eps);
    at::Tensor s = silu_mul(product(out[0], mats[m + 2], modes[m + 2], amx[m + 2], ns[m + 2]));
    at::Tensor d = product(s, mats[m + 3], modes[m + 3], amx[m + 3], ns[m + 3]);
    std::tie(h, out[0]) = add_rms_norm(h, d, norms[2 * i + 1], eps);
    if (next_capture < capture.size() && capture[next_capture] == i) {
      out.push_back(h);
      ++next_capture;
    }
  }
  return out;
}

static bool has_attend() { return HAS_ATTEND; }

TORCH_LIBRARY(hetero_sd_fused, m) {  // torch.ops.hetero_sd_fused.*: the dispatcher releases the GIL around a call
  m.def("attend(Tensor q, Tensor kc, Tensor vc, int start, bool wide, bool causal=True, bool tiled=False) -> Tensor");
  m.def("has_attend() -> bool", &has_attend);
  m.def("rms_norm(Tensor x, Tensor w, float eps) -> Tensor");
  m.def("add_rms_norm(Tensor h, Tensor d, Tensor w, float eps) -> (Tensor, Tensor)");
  m.def("rope_qkv(Tensor qkv, Tensor cos, Tensor sin, Tensor(a!) kc, Tensor(b!) vc, int start, int nh, int nkv, "
        "Tensor? q_norm=None, Tensor? k_norm=None, float eps=0.0, bool tiled=False) -> Tensor");
  m.def("silu_mul(Tensor gu) -> Tensor");
  m.def("layers(Tensor h, Tensor first_norm, Tensor[] mats, int[] modes, int[] amx, int[] ns, Tensor[] biases, "
        "Tensor[] norms, Tensor[] qk_norms, Tensor(a!)[] kc, Tensor(b!)[] vc, Tensor cos, Tensor sin, int start, "
        "int nh, int nkv, float eps, bool wide, bool causal, bool tiled, int[] capture, Tensor? slots=None, "
        "Tensor? pos=None) -> Tensor[]");
  m.def("rope_slots(Tensor qkv, Tensor cos, Tensor sin, Tensor(a!) kc, Tensor(b!) vc, Tensor slots, Tensor pos, int nh, "
        "int nkv, Tensor? q_norm=None, Tensor? k_norm=None, float eps=0.0, bool tiled=False) -> Tensor");
  m.def("attend_slots(Tensor q, Tensor kc, Tensor vc, Tensor slots, Tensor pos, bool wide, bool tiled=False) -> Tensor");
}
TORCH_LIBRARY_IMPL(hetero_sd_fused, CPU, m) {
  m.impl("attend", &attend);
  m.impl("rms_norm", &rms_norm);
  m.impl("add_rms_norm", &add_rms_norm);
  m.impl("rope_qkv", &rope_qkv);
  m.impl("silu_mul", &silu_mul);
  m.impl("layers", &layers);
  m.impl("rope_slots", &rope_slots);
  m.impl("attend_slots", &attend_slots);
}
