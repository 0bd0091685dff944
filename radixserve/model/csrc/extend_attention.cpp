// torch binding of extend_attention.h: torch.ops.radixserve.extend_attention (CPU, bfloat16).
// Where the compiler did not target AVX512-BF16 the op exists but refuses, and
// extend_attention_supported() says False: the caller keeps gather + SDPA.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstdint>
#include <limits>

#include "extend_attention.h"

namespace {

bool extend_attention_supported() {
#ifdef RADIXSERVE_EXTEND_BF16
  return true;
#else
  return false;
#endif
}

at::Tensor extend_attention_op(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& slots,
                               const at::Tensor& q_starts, const at::Tensor& ctx_starts, double scale, int64_t window,
                               double softcap, const c10::optional<at::Tensor>& k_scale,
                               const c10::optional<at::Tensor>& v_scale) {
  TORCH_CHECK(extend_attention_supported(), "extend_attention: built without AVX512-BF16");
  TORCH_CHECK(window >= 0 && softcap >= 0.0, "extend_attention: window and softcap must be >= 0 (0: none)");
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && k.sizes() == v.sizes(), "q [T,H,D], k/v [Hkv,N,D]");
  const bool int8 = k.scalar_type() == at::kChar;
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 && k.scalar_type() == v.scalar_type() &&
                  (k.scalar_type() == at::kBFloat16 || int8),
              "extend_attention: q bfloat16, k and v bfloat16 or int8");
  TORCH_CHECK(int8 == (k_scale.has_value() && v_scale.has_value()), "extend_attention: scales with an int8 pool only");
  for (const auto* t : {&k_scale, &v_scale})
    TORCH_CHECK(!int8 || ((*t)->scalar_type() == at::kBFloat16 && (*t)->is_contiguous() && (*t)->dim() == 2 &&
                          (*t)->size(0) == k.size(0) && (*t)->size(1) == k.size(1)),
                "extend_attention: scales bfloat16 [Hkv, N], contiguous");
  const int64_t dim = q.size(2), num_heads = q.size(1), num_kv_heads = k.size(0), num_slots = k.size(1);
  TORCH_CHECK(k.size(2) == dim && num_heads % num_kv_heads == 0, "head dims / groups disagree");
  TORCH_CHECK(dim % 16 == 0 && dim <= 512, "extend_attention: head dim must be a multiple of 16, at most 512");
  TORCH_CHECK(num_slots * dim / 2 < std::numeric_limits<int32_t>::max(), "pool too large for 32-bit gathers");
  TORCH_CHECK(k.is_contiguous() && v.is_contiguous(), "k, v: contiguous [Hkv, N, D]");
  for (const at::Tensor* t : {&slots, &q_starts, &ctx_starts})
    TORCH_CHECK(t->scalar_type() == at::kLong && t->is_contiguous() && t->device().is_cpu(), "int64 cpu indices");
  const int64_t batch = q_starts.numel() - 1;
  TORCH_CHECK(batch >= 0 && ctx_starts.numel() == batch + 1, "q_starts and ctx_starts disagree");
  const int64_t *qs = q_starts.data_ptr<int64_t>(), *cs = ctx_starts.data_ptr<int64_t>();
  TORCH_CHECK(qs[0] == 0 && cs[0] == 0 && qs[batch] == q.size(0) && cs[batch] == slots.numel(),
              "q_starts / ctx_starts do not cover q / slots");
  for (int64_t b = 0; b < batch; ++b)
    TORCH_CHECK(qs[b] <= qs[b + 1] && qs[b + 1] - qs[b] <= cs[b + 1] - cs[b], "request ", b,
                ": more new tokens than context");
  if (slots.numel() > 0) {
    const auto [lo, hi] = slots.aminmax();
    TORCH_CHECK(lo.item<int64_t>() >= 0 && hi.item<int64_t>() < num_slots, "slots outside the pool");
  }
  // The kernel reads q rows by token stride; heads and dims must be dense.
  const at::Tensor qd = (q.stride(2) == 1 && q.stride(1) == dim) ? q : q.contiguous();
  at::Tensor out = at::empty(q.sizes(), q.options().memory_format(at::MemoryFormat::Contiguous));
#ifdef RADIXSERVE_EXTEND_BF16
  auto bits = [](const at::Tensor& t) { return reinterpret_cast<const uint16_t*>(t.data_ptr<at::BFloat16>()); };
  // An int8 pool's codes travel as 16-bit pointers; pack_tile reads them as int8 where the scales are set.
  auto pool = [&](const at::Tensor& t) { return int8 ? reinterpret_cast<const uint16_t*>(t.data_ptr<int8_t>()) : bits(t); };
  const radixserve::extend::Shape s{num_heads,    num_kv_heads, dim,   num_slots,     num_heads / num_kv_heads,
                                    qd.stride(0), float(scale), window, float(softcap),
                                    int8 ? bits(*k_scale) : nullptr, int8 ? bits(*v_scale) : nullptr};
  radixserve::extend::extend_attention(bits(qd), pool(k), pool(v), slots.data_ptr<int64_t>(), qs, cs, batch, s,
                                       reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>()),
                                       [](int64_t n, auto fn) { at::parallel_for(0, n, 1, fn); });
#endif
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(radixserve, m) {
  m.def("extend_attention_supported() -> bool", &extend_attention_supported);
  m.def(
      "extend_attention(Tensor q, Tensor k, Tensor v, Tensor slots, Tensor q_starts, Tensor ctx_starts, "
      "float scale, int window=0, float softcap=0.0, Tensor? k_scale=None, Tensor? v_scale=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(radixserve, CPU, m) { m.impl("extend_attention", &extend_attention_op); }
