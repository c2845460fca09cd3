"""Fused paged decode attention for the CPU: one query token per sequence, K/V read in place.

The kernel walks each sequence's block table and reads key and value rows straight out of
the pages (no gather into a contiguous buffer), with an online softmax per query head, so
every K and V row of the context is read once. Work is split over (sequence, KV head) pairs
with ``at::parallel_for``; the query heads of a GQA group share each K/V row.

The C++ source is compiled at first use with ``torch.utils.cpp_extension.load_inline`` for
the host CPU (``-march=native``) and cached by torch under its extensions directory; torch
holds a file lock while building, so concurrent first use by several processes builds once.
``is_available`` reports whether the build succeeded; callers fall back to the torch path
when it did not.
"""

from __future__ import annotations

import logging
from types import ModuleType

import torch

from epdserve import envs

log = logging.getLogger("epdserve.kernels")

_EXTENSION_NAME = "epdserve_paged_attention_cpu"

_CPP_SOURCE = r"""
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>
#ifdef __AVX512F__
#include <immintrin.h>
#endif

namespace {

// Keys scored per pass; the [group, kTile] score tile stays in L1.
constexpr int64_t kTile = 32;

// A row of n elements as float32: fp32 rows are used in place, bf16 rows are widened into buf.
inline const float* float_row(const float* src, float*, int64_t) { return src; }

inline const float* float_row(const c10::BFloat16* src, float* buf, int64_t n) {
  const uint16_t* bits = reinterpret_cast<const uint16_t*>(src);
  int64_t i = 0;
#ifdef __AVX512F__
  for (; i + 16 <= n; i += 16) {
    __m256i half = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bits + i));
    _mm512_storeu_ps(buf + i, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16)));
  }
#endif
  for (; i < n; ++i) {
    uint32_t word = uint32_t(bits[i]) << 16;
    std::memcpy(buf + i, &word, sizeof(float));
  }
  return buf;
}

inline float dot(const float* a, const float* b, int64_t n) {
  int64_t i = 0;
  float sum = 0.f;
#ifdef __AVX512F__
  __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();
  for (; i + 32 <= n; i += 32) {
    acc0 = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), acc0);
    acc1 = _mm512_fmadd_ps(_mm512_loadu_ps(a + i + 16), _mm512_loadu_ps(b + i + 16), acc1);
  }
  for (; i < n; i += 16) {
    __mmask16 m = n - i >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (n - i)) - 1);
    acc0 = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, a + i), _mm512_maskz_loadu_ps(m, b + i), acc0);
  }
  sum = _mm512_reduce_add_ps(_mm512_add_ps(acc0, acc1));
#endif
  for (; i < n; ++i) sum += a[i] * b[i];
  return sum;
}

// y += p * x (a plain loop the compiler vectorises).
inline void add_scaled(float* y, const float* x, float p, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] += x[i] * p;
}

#ifdef __AVX512F__
// exp(x) for x <= 0: 2^k * exp(r), k = round(x / ln2), |r| <= ln2 / 2, degree-7 Taylor (~1 ulp).
inline __m512 exp_nonpositive(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-104.f));  // exp(-104) is 0 in float32
  __m512 k = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)),
                                  _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(k, _mm512_set1_ps(0.693145752f), x);
  r = _mm512_fnmadd_ps(k, _mm512_set1_ps(1.42860677e-6f), r);
  __m512 p = _mm512_set1_ps(1.f / 5040);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 720));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, k);
}
#endif

// s[j] = exp(s[j] - max) for j < n (every s[j] <= max); returns the sum of the new s[j].
inline float exp_shifted(float* s, int64_t n, float max) {
  int64_t j = 0;
  float sum = 0.f;
#ifdef __AVX512F__
  __m512 acc = _mm512_setzero_ps();
  for (; j < n; j += 16) {
    __mmask16 m = n - j >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (n - j)) - 1);
    __m512 e = exp_nonpositive(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, s + j), _mm512_set1_ps(max)));
    _mm512_mask_storeu_ps(s + j, m, e);
    acc = _mm512_mask_add_ps(acc, m, acc, e);
  }
  sum = _mm512_reduce_add_ps(acc);
#endif
  for (; j < n; ++j) {
    s[j] = std::exp(s[j] - max);
    sum += s[j];
  }
  return sum;
}

template <typename T>
void decode(const at::Tensor& q, const at::Tensor& cache, const at::Tensor& tables,
            const at::Tensor& lens, at::Tensor& out, double scale, int64_t window) {
  const int64_t batch = q.size(0), num_heads = q.size(1), dim = q.size(2);
  const int64_t num_blocks = cache.size(1), block_size = cache.size(2), num_kv_heads = cache.size(3);
  const int64_t group = num_heads / num_kv_heads;
  const int64_t q_seq_stride = q.stride(0), q_head_stride = q.stride(1);
  const int64_t max_blocks = tables.size(1), table_stride = tables.stride(0);
  // Element offsets in the pages: token rows are num_kv_heads * dim apart, blocks block_size rows.
  const int64_t row_stride = num_kv_heads * dim, block_stride = block_size * row_stride;
  const T* q_ptr = q.data_ptr<T>();
  const T* k_pages = cache.data_ptr<T>();
  const T* v_pages = k_pages + num_blocks * block_stride;
  const int64_t* table_ptr = tables.data_ptr<int64_t>();
  const int64_t* len_ptr = lens.data_ptr<int64_t>();
  T* out_ptr = out.data_ptr<T>();
  const float fscale = float(scale);

  at::parallel_for(0, batch * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    // Per thread: scaled queries, accumulators [group, dim]; one widened row; score tile.
    std::vector<float> work(2 * group * dim + dim + group * kTile + 2 * group);
    float* qf = work.data();
    float* acc = qf + group * dim;
    float* row = acc + group * dim;
    float* scores = row + dim;
    float* run_max = scores + group * kTile;
    float* run_sum = run_max + group;
    int64_t offsets[kTile];  // element offset of each tile key's row within a page set

    for (int64_t task = begin; task < end; ++task) {
      const int64_t seq = task / num_kv_heads, kv_head = task % num_kv_heads;
      const int64_t context_len = len_ptr[seq];
      TORCH_CHECK(context_len >= 0 && context_len <= max_blocks * block_size,
                  "context length ", context_len, " outside the block table");
      const int64_t first = window > 0 ? std::max<int64_t>(0, context_len - window) : 0;
      const int64_t* table = table_ptr + seq * table_stride;
      for (int64_t g = 0; g < group; ++g) {
        const T* src = q_ptr + seq * q_seq_stride + (kv_head * group + g) * q_head_stride;
        const float* qrow = float_row(src, row, dim);
        for (int64_t i = 0; i < dim; ++i) qf[g * dim + i] = qrow[i] * fscale;
        run_max[g] = -std::numeric_limits<float>::infinity();
        run_sum[g] = 0.f;
      }
      std::fill(acc, acc + group * dim, 0.f);

      for (int64_t start = first; start < context_len; start += kTile) {
        const int64_t n = std::min(kTile, context_len - start);
        int64_t block_idx = start / block_size, in_block = start - block_idx * block_size;
        for (int64_t j = 0; j < n; ++j) {
          const int64_t block = table[block_idx];
          TORCH_CHECK(block >= 0 && block < num_blocks, "block id ", block, " out of range");
          offsets[j] = block * block_stride + in_block * row_stride + kv_head * dim;
          if (++in_block == block_size) in_block = 0, ++block_idx;
          const float* k = float_row(k_pages + offsets[j], row, dim);
          for (int64_t g = 0; g < group; ++g) scores[g * kTile + j] = dot(qf + g * dim, k, dim);
        }
        for (int64_t g = 0; g < group; ++g) {
          float* s = scores + g * kTile;
          const float new_max = std::max(run_max[g], *std::max_element(s, s + n));
          const float correction = std::exp(run_max[g] - new_max);  // 0 on the first tile
          run_sum[g] = run_sum[g] * correction + exp_shifted(s, n, new_max);
          run_max[g] = new_max;
          if (correction != 1.f) {
            for (int64_t i = 0; i < dim; ++i) acc[g * dim + i] *= correction;
          }
        }
        for (int64_t j = 0; j < n; ++j) {
          const float* v = float_row(v_pages + offsets[j], row, dim);
          for (int64_t g = 0; g < group; ++g) add_scaled(acc + g * dim, v, scores[g * kTile + j], dim);
        }
      }

      for (int64_t g = 0; g < group; ++g) {
        const float inv = run_sum[g] > 0.f ? 1.f / run_sum[g] : 0.f;
        T* dst = out_ptr + (seq * num_heads + kv_head * group + g) * dim;
        for (int64_t i = 0; i < dim; ++i) dst[i] = T(acc[g * dim + i] * inv);
      }
    }
  });
}

}  // namespace

at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& cache, const at::Tensor& block_tables,
                                  const at::Tensor& context_lens, double scale, int64_t sliding_window) {
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1, "q must be [B, H, D] with unit last stride");
  TORCH_CHECK(cache.dim() == 5 && cache.size(0) == 2 && cache.is_contiguous(),
              "cache must be contiguous [2, num_blocks, block_size, KVH, D]");
  TORCH_CHECK(q.scalar_type() == cache.scalar_type(), "q and cache dtypes differ");
  TORCH_CHECK(q.size(2) == cache.size(4) && q.size(1) % cache.size(3) == 0, "q does not match cache heads");
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.size(0) == q.size(0) && block_tables.stride(1) == 1 &&
              block_tables.scalar_type() == at::kLong, "block_tables must be int64 [B, max_blocks]");
  TORCH_CHECK(context_lens.dim() == 1 && context_lens.size(0) == q.size(0) && context_lens.is_contiguous() &&
              context_lens.scalar_type() == at::kLong, "context_lens must be contiguous int64 [B]");
  TORCH_CHECK(q.device().is_cpu() && cache.device().is_cpu(), "CPU tensors only");
  at::Tensor out = at::empty({q.size(0), q.size(1), q.size(2)}, q.options());
  if (q.scalar_type() == at::kFloat) {
    decode<float>(q, cache, block_tables, context_lens, out, scale, sliding_window);
  } else {
    TORCH_CHECK(q.scalar_type() == at::kBFloat16, "float32 or bfloat16 only");
    decode<c10::BFloat16>(q, cache, block_tables, context_lens, out, scale, sliding_window);
  }
  return out;
}
"""

_module: ModuleType | None = None
_build_failed = False

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16)


def _load() -> ModuleType | None:
    """Builds (or loads torch's cached build of) the extension once per process."""
    global _module, _build_failed
    if _module is None and not _build_failed:
        try:
            from torch.utils.cpp_extension import load_inline

            _module = load_inline(
                name=_EXTENSION_NAME,
                cpp_sources=[_CPP_SOURCE],
                functions=["paged_decode_attention"],
                # -fopenmp: at::parallel_for is header code that runs serially without it; the
                # extension then shares torch's bundled OpenMP runtime (same soname).
                extra_cflags=["-O3", "-march=native", "-fopenmp"],
                extra_ldflags=["-fopenmp"],
            )
        except Exception as exc:  # no compiler, no ninja, a failed build: use the torch path
            _build_failed = True
            log.warning("CPU paged attention kernel unavailable, using the torch path: %s", exc)
    return _module


def is_available() -> bool:
    """The kernel is built (building it on the first call) and not disabled by the env."""
    if envs.is_cpu_kernels_disabled():
        return False
    return _load() is not None


def paged_decode_attention(
    q: torch.Tensor,
    cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    sliding_window: int = 0,
) -> torch.Tensor:
    """Attention of one query token per sequence over its pages.

    q [B, H, D]; cache [2, num_blocks, block_size, KVH, D] (K pages then V pages), same dtype
    as q (float32 or bfloat16); block_tables [B, max_blocks] int64; context_lens [B] int64
    (the query is the last of a sequence's context_len tokens). ``sliding_window`` W > 0: the
    query at position p = context_len - 1 sees keys p-W+1 .. p; 0 means no window.
    Returns [B, H, D] in q's dtype. Requires ``is_available()``.
    """
    module = _load()
    assert module is not None, "paged_decode_attention called without is_available()"
    return module.paged_decode_attention(q, cache, block_tables, context_lens, float(scale), int(sliding_window))
