// torch binding of paged_attention.h: torch.ops.radixserve.paged_attention (CPU).
// q and out travel in q's dtype where it is bfloat16 (the kernel widens q and rounds its output rows itself: no
// conversion around the call), else as float32; the pool keeps its own dtype. An 8-bit pool
// (int8 k, v) comes with its scales (bfloat16 [Hkv, N]: k_scale, v_scale).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <vector>

#include "paged_attention.h"

namespace {

// Shared-prefix groups (CSR): members[starts[g] .. starts[g+1]] are request indices, lens[g] the
// prefix length. Checked here so bad indices fail clearly instead of reading out of bounds; that
// the members' first lens[g] slots agree is the caller's promise (PagedIndex.build compares them).
radixserve::SharedGroups checked_groups(const at::Tensor& members, const at::Tensor& starts, const at::Tensor& lens,
                                        const int64_t* qs, const int64_t* cs, int64_t batch) {
  const int64_t count = lens.numel();
  TORCH_CHECK(starts.numel() == count + 1 || (count == 0 && starts.numel() <= 1), "group_starts: one more than groups");
  const int64_t *m = members.data_ptr<int64_t>(), *st = starts.data_ptr<int64_t>(), *ln = lens.data_ptr<int64_t>();
  TORCH_CHECK(count == 0 || (st[0] == 0 && st[count] == members.numel()), "group_starts do not cover group_members");
  std::vector<bool> grouped(batch, false);  // a request's suffix starts after one prefix only
  for (int64_t g = 0; g < count; ++g) {
    TORCH_CHECK(st[g] <= st[g + 1] && ln[g] >= 0, "group ", g, ": bad starts or length");
    for (int64_t i = st[g]; i < st[g + 1]; ++i) {
      TORCH_CHECK(m[i] >= 0 && m[i] < batch && !grouped[m[i]], "group member ", m[i], ": not a request or twice");
      grouped[m[i]] = true;
      const int64_t extend_len = qs[m[i] + 1] - qs[m[i]], ctx_len = cs[m[i] + 1] - cs[m[i]];
      TORCH_CHECK(ln[g] <= ctx_len - extend_len + 1, "shared prefix of group ", g, " exceeds a member's cached part");
    }
  }
  return {m, st, ln, count};
}

// An 8-bit pool's scales as bfloat16 bits, checked against its codes [Hkv, N, D]; nullptr for a float pool.
const uint16_t* checked_scales(const at::Tensor& codes, const c10::optional<at::Tensor>& scale, const char* name) {
  if (codes.scalar_type() != at::kChar) {
    TORCH_CHECK(!scale.has_value(), name, ": only an int8 pool has scales");
    return nullptr;
  }
  TORCH_CHECK(scale.has_value(), name, ": an int8 pool needs its scales");
  const at::Tensor& t = *scale;
  TORCH_CHECK(t.scalar_type() == at::kBFloat16 && t.is_contiguous() && t.dim() == 2 && t.size(0) == codes.size(0) &&
                  t.size(1) == codes.size(1),
              name, ": bfloat16 [Hkv, N], contiguous");
  return reinterpret_cast<const uint16_t*>(t.data_ptr<c10::BFloat16>());
}

// A bfloat16 pool's storage as the kernel's bf16 (the same bits).
const radixserve::bf16* as_bf16(const at::Tensor& t) {
  return reinterpret_cast<const radixserve::bf16*>(t.data_ptr<c10::BFloat16>());
}
radixserve::bf16* as_bf16_mut(at::Tensor& t) { return reinterpret_cast<radixserve::bf16*>(t.data_ptr<c10::BFloat16>()); }

at::Tensor paged_attention_op(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& slots,
                              const at::Tensor& q_starts, const at::Tensor& ctx_starts, const at::Tensor& group_members,
                              const at::Tensor& group_starts, const at::Tensor& group_lens, int64_t num_splits,
                              double scale, int64_t window, double softcap, const c10::optional<at::Tensor>& k_scale,
                              const c10::optional<at::Tensor>& v_scale) {
  TORCH_CHECK(window >= 0 && softcap >= 0.0, "paged_attention: window and softcap must be >= 0 (0: none)");
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && k.sizes() == v.sizes(), "q [T,H,D], k/v [Hkv,N,D]");
  TORCH_CHECK(q.size(2) == k.size(2) && q.size(1) % k.size(0) == 0, "head dims / groups disagree");
  TORCH_CHECK(q.size(2) <= 256, "paged_attention: head dim must be at most 256");
  TORCH_CHECK(k.is_contiguous() && v.is_contiguous() && k.scalar_type() == v.scalar_type(), "k, v: one layout");
  for (const at::Tensor* t : {&slots, &q_starts, &ctx_starts, &group_members, &group_starts, &group_lens})
    TORCH_CHECK(t->scalar_type() == at::kLong && t->is_contiguous() && t->device().is_cpu(), "int64 cpu indices");
  const int64_t batch = q_starts.numel() - 1;
  TORCH_CHECK(batch >= 0 && ctx_starts.numel() == batch + 1, "q_starts and ctx_starts disagree");
  const int64_t* qs = q_starts.data_ptr<int64_t>();
  const int64_t* cs = ctx_starts.data_ptr<int64_t>();
  TORCH_CHECK(qs[batch] == q.size(0) && cs[batch] == slots.numel(), "q_starts / ctx_starts do not cover q / slots");
  const radixserve::SharedGroups groups = checked_groups(group_members, group_starts, group_lens, qs, cs, batch);
  const radixserve::Shape s{q.size(1),     k.size(0),    q.size(2),
                            k.size(1),     q.size(1) / k.size(0), float(scale),
                            window,        float(softcap),        checked_scales(k, k_scale, "k_scale"),
                            checked_scales(v, v_scale, "v_scale")};
  // A bfloat16 q is read and its output written in bfloat16 by the kernel; any other dtype goes through float32.
  const at::ScalarType io = q.scalar_type() == at::kBFloat16 ? at::kBFloat16 : at::kFloat;
  const at::Tensor qc = q.to(io).contiguous();
  at::Tensor out = at::empty(q.sizes(), q.options().dtype(io));
  const auto run = [&](const auto* kp, const auto* vp) {
    auto parallel = [](int64_t n, auto fn) { at::parallel_for(0, n, 1, fn); };
    const int64_t* sl = slots.data_ptr<int64_t>();
    if (io == at::kBFloat16)
      radixserve::paged_attention(as_bf16(qc), kp, vp, sl, qs, cs, batch, num_splits, groups, s, as_bf16_mut(out),
                                  parallel);
    else
      radixserve::paged_attention(qc.data_ptr<float>(), kp, vp, sl, qs, cs, batch, num_splits, groups, s,
                                  out.data_ptr<float>(), parallel);
  };
  if (k.scalar_type() == at::kFloat) {
    run(k.data_ptr<float>(), v.data_ptr<float>());
  } else if (k.scalar_type() == at::kBFloat16) {
    static_assert(sizeof(c10::BFloat16) == sizeof(radixserve::bf16), "bfloat16 is 16 bits");
    run(as_bf16(k), as_bf16(v));
  } else if (k.scalar_type() == at::kHalf) {
    run(k.data_ptr<c10::Half>(), v.data_ptr<c10::Half>());
  } else if (k.scalar_type() == at::kChar) {
    run(reinterpret_cast<const radixserve::i8*>(k.data_ptr<int8_t>()),
        reinterpret_cast<const radixserve::i8*>(v.data_ptr<int8_t>()));
  } else {
    TORCH_CHECK(false, "paged_attention: pool dtype must be float32, bfloat16, float16 or int8");
  }
  return out.scalar_type() == q.scalar_type() ? out : out.to(q.scalar_type());
}

}  // namespace

TORCH_LIBRARY(radixserve, m) {
  m.def(
      "paged_attention(Tensor q, Tensor k, Tensor v, Tensor slots, Tensor q_starts, Tensor ctx_starts, "
      "Tensor group_members, Tensor group_starts, Tensor group_lens, int num_splits, float scale, int window=0, "
      "float softcap=0.0, Tensor? k_scale=None, Tensor? v_scale=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(radixserve, CPU, m) { m.impl("paged_attention", &paged_attention_op); }
