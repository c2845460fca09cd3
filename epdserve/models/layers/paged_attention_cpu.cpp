// Fused paged decode attention for the CPU (see paged_attention_cpu.py, which documents the
// kernel). Built at first use by paged_attention_cpu.py through torch.utils.cpp_extension.load_inline,
// which adds the Python binding of paged_decode_attention; so this file has no PYBIND11_MODULE.
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif
#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
#define EPD_AVX2 1
#endif

namespace {

// Keys per tile (a multiple of 16; 16 measured fastest): scores [heads, kTile] stay in L1.
constexpr int64_t kTile = 16;

// --- Any head_dim, any ISA: rows widened to float32, plain loops. ----------------------------

inline const float* float_row(const float* src, float*, int64_t) { return src; }

inline const float* float_row(const c10::BFloat16* src, float* buf, int64_t n) {
  for (int64_t i = 0; i < n; ++i) buf[i] = float(src[i]);
  return buf;
}

// scores[j] = q . k_j for the tile's keys, k_j at keys + offsets[j]; scratch holds 2 * dim floats.
template <typename T>
void score_keys_any(const T* q, const T* keys, const int64_t* offsets, int64_t n, int64_t dim,
                    float* scores, float* scratch) {
  const float* qf = float_row(q, scratch, dim);
  for (int64_t j = 0; j < n; ++j) {
    const float* k = float_row(keys + offsets[j], scratch + dim, dim);
    float sum = 0.f;
    for (int64_t i = 0; i < dim; ++i) sum += qf[i] * k[i];
    scores[j] = sum;
  }
}

// acc += sum_j probs[j] * v_j, v_j at values + offsets[j].
template <typename T>
void accumulate_values_any(float* acc, const T* values, const int64_t* offsets, int64_t n, int64_t dim,
                           const float* probs, float* scratch) {
  for (int64_t j = 0; j < n; ++j) {
    const float* v = float_row(values + offsets[j], scratch, dim);
    for (int64_t i = 0; i < dim; ++i) acc[i] += probs[j] * v[i];
  }
}

#ifdef __AVX512F__
// --- AVX-512, head_dim = 16 * C: a head's query or accumulator lives in C registers. ---------

inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }

inline __m512 load16(const c10::BFloat16* p) {
  __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}

// Lane sums of 16 vectors (partial + 16 * j, j < 16): out[j] = sum of vector j. Halves are
// added pairwise (256-bit, 128-bit, then element pairs); the last step leaves vector j's sum in
// lane 4 * (j % 4) + j / 4, undone by one permute.
inline void sum_lanes16(const float* partial, float* out) {
  __m512 v[16];
  for (int j = 0; j < 16; ++j) v[j] = _mm512_loadu_ps(partial + 16 * j);
  for (int j = 0; j < 8; ++j) {
    v[j] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * j], v[2 * j + 1], 0x44),
                         _mm512_shuffle_f32x4(v[2 * j], v[2 * j + 1], 0xEE));
  }
  for (int j = 0; j < 4; ++j) {
    v[j] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * j], v[2 * j + 1], 0x88),
                         _mm512_shuffle_f32x4(v[2 * j], v[2 * j + 1], 0xDD));
  }
  for (int j = 0; j < 2; ++j) {
    v[j] = _mm512_add_ps(_mm512_shuffle_ps(v[2 * j], v[2 * j + 1], 0x44),
                         _mm512_shuffle_ps(v[2 * j], v[2 * j + 1], 0xEE));
  }
  __m512 sums = _mm512_add_ps(_mm512_shuffle_ps(v[0], v[1], 0x88), _mm512_shuffle_ps(v[0], v[1], 0xDD));
  const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  _mm512_storeu_ps(out, _mm512_permutexvar_ps(order, sums));
}

// As score_keys_any; partial holds kTile * 16 floats (per-key lane partial sums).
template <typename T, int C>
void score_keys(const T* q, const T* keys, const int64_t* offsets, int64_t n, float* scores, float* partial) {
#ifdef __AVX512BF16__
  if constexpr (std::is_same_v<T, c10::BFloat16> && C % 2 == 0) {
    // bf16 products are exact in float32; vdpbf16ps sums pairs of them into float32 lanes.
    __m512bh qv[C / 2];
    for (int c = 0; c < C / 2; ++c) qv[c] = (__m512bh)_mm512_loadu_si512(q + 32 * c);
    for (int64_t j = 0; j < n; ++j) {
      const T* k = keys + offsets[j];
      __m512 sum = _mm512_setzero_ps();
      for (int c = 0; c < C / 2; ++c) sum = _mm512_dpbf16_ps(sum, qv[c], (__m512bh)_mm512_loadu_si512(k + 32 * c));
      _mm512_storeu_ps(partial + 16 * j, sum);
    }
  } else
#endif
  {
    __m512 qv[C];
    for (int c = 0; c < C; ++c) qv[c] = load16(q + 16 * c);
    for (int64_t j = 0; j < n; ++j) {
      const T* k = keys + offsets[j];
      __m512 sum = _mm512_mul_ps(qv[0], load16(k));
      for (int c = 1; c < C; ++c) sum = _mm512_fmadd_ps(qv[c], load16(k + 16 * c), sum);
      _mm512_storeu_ps(partial + 16 * j, sum);
    }
  }
  for (int64_t j = 0; j < n; j += 16) sum_lanes16(partial + 16 * j, scores + j);
}

template <typename T, int C>
void accumulate_values(float* acc, const T* values, const int64_t* offsets, int64_t n, const float* probs) {
  __m512 a[C];
  for (int c = 0; c < C; ++c) a[c] = _mm512_loadu_ps(acc + 16 * c);
  for (int64_t j = 0; j < n; ++j) {
    const T* v = values + offsets[j];
    const __m512 p = _mm512_set1_ps(probs[j]);
    for (int c = 0; c < C; ++c) a[c] = _mm512_fmadd_ps(p, load16(v + 16 * c), a[c]);
  }
  for (int c = 0; c < C; ++c) _mm512_storeu_ps(acc + 16 * c, a[c]);
}
#endif

#ifdef EPD_AVX2
// --- AVX2 + FMA, head_dim = 8 * C: the same loops on 8-lane registers. ---------------------

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }

inline __m256 load8(const c10::BFloat16* p) {
  __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
}

// Lane sums of 8 vectors (partial + 8 * j, j < 8): out[j] = sum of vector j. Two rounds of
// hadd leave vector j's partial sums over lanes 0-3 and 4-7 in the low and high halves.
inline void sum_lanes8(const float* partial, float* out) {
  __m256 v[8];
  for (int j = 0; j < 8; ++j) v[j] = _mm256_loadu_ps(partial + 8 * j);
  const __m256 lo = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
  const __m256 hi = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
  _mm256_storeu_ps(out, _mm256_add_ps(_mm256_permute2f128_ps(lo, hi, 0x20), _mm256_permute2f128_ps(lo, hi, 0x31)));
}

// As score_keys_any; partial holds kTile * 8 floats (per-key lane partial sums).
template <typename T, int C>
void score_keys(const T* q, const T* keys, const int64_t* offsets, int64_t n, float* scores, float* partial) {
  __m256 qv[C];
  for (int c = 0; c < C; ++c) qv[c] = load8(q + 8 * c);
  for (int64_t j = 0; j < n; ++j) {
    const T* k = keys + offsets[j];
    __m256 sum = _mm256_mul_ps(qv[0], load8(k));
    for (int c = 1; c < C; ++c) sum = _mm256_fmadd_ps(qv[c], load8(k + 8 * c), sum);
    _mm256_storeu_ps(partial + 8 * j, sum);
  }
  for (int64_t j = 0; j < n; j += 8) sum_lanes8(partial + 8 * j, scores + j);
}

template <typename T, int C>
void accumulate_values(float* acc, const T* values, const int64_t* offsets, int64_t n, const float* probs) {
  __m256 a[C];
  for (int c = 0; c < C; ++c) a[c] = _mm256_loadu_ps(acc + 8 * c);
  for (int64_t j = 0; j < n; ++j) {
    const T* v = values + offsets[j];
    const __m256 p = _mm256_set1_ps(probs[j]);
    for (int c = 0; c < C; ++c) a[c] = _mm256_fmadd_ps(p, load8(v + 8 * c), a[c]);
  }
  for (int c = 0; c < C; ++c) _mm256_storeu_ps(acc + 8 * c, a[c]);
}

// exp(x) for x <= 0 as in the AVX-512 path, 2^k built in the exponent bits: x is clamped at
// -87 so that 2^k stays a normal float (exp(-87) ~ 1.6e-38, nothing next to the row's 1).
inline __m256 exp_nonpositive8(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.f));
  const __m256 k = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(k, _mm256_set1_ps(0.693145752f), x);
  r = _mm256_fnmadd_ps(k, _mm256_set1_ps(1.42860677e-6f), r);
  __m256 p = _mm256_set1_ps(1.f / 5040);
  for (float coef : {1.f / 720, 1.f / 120, 1.f / 24, 1.f / 6, 0.5f, 1.f, 1.f}) {
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(coef));
  }
  const __m256i two_k = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(k), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(two_k));
}

inline float reduce_max8(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  return _mm_cvtss_f32(m);
}

inline float reduce_add8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
#endif

// --- Softmax over tiles, tasks, dispatch. ---------------------------------------------------

#ifdef __AVX512F__
// exp(x) for x <= 0: 2^k * exp(r), k = round(x / ln2), |r| <= ln2 / 2, degree-7 Taylor (~1 ulp).
inline __m512 exp_nonpositive(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-104.f));  // exp(-104) rounds to 0 in float32
  const __m512 k = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(k, _mm512_set1_ps(0.693145752f), x);  // ln2 split in two parts
  r = _mm512_fnmadd_ps(k, _mm512_set1_ps(1.42860677e-6f), r);
  __m512 p = _mm512_set1_ps(1.f / 5040);
  for (float coef : {1.f / 720, 1.f / 120, 1.f / 24, 1.f / 6, 0.5f, 1.f, 1.f}) {
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(coef));
  }
  return _mm512_scalef_ps(p, k);
}

inline __mmask16 first_lanes(int64_t n) { return n >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << n) - 1); }
#endif

// s[j] *= scale for j < n; returns the largest s[j].
inline float scale_scores(float* s, int64_t n, float scale) {
  float max = -std::numeric_limits<float>::infinity();
  int64_t j = 0;
#ifdef __AVX512F__
  __m512 vmax = _mm512_set1_ps(max);
  for (; j < n; j += 16) {
    const __mmask16 m = first_lanes(n - j);
    const __m512 x = _mm512_mul_ps(_mm512_maskz_loadu_ps(m, s + j), _mm512_set1_ps(scale));
    _mm512_mask_storeu_ps(s + j, m, x);
    vmax = _mm512_mask_max_ps(vmax, m, vmax, x);
  }
  max = _mm512_reduce_max_ps(vmax);
#elif defined(EPD_AVX2)
  __m256 vmax = _mm256_set1_ps(max);
  for (; j + 8 <= n; j += 8) {
    const __m256 x = _mm256_mul_ps(_mm256_loadu_ps(s + j), _mm256_set1_ps(scale));
    _mm256_storeu_ps(s + j, x);
    vmax = _mm256_max_ps(vmax, x);
  }
  max = reduce_max8(vmax);
#endif
  for (; j < n; ++j) max = std::max(max, s[j] *= scale);
  return max;
}

// s[j] = exp(s[j] - max) for j < n (every s[j] <= max); returns the sum of the new s[j].
inline float exp_shifted(float* s, int64_t n, float max) {
  float sum = 0.f;
  int64_t j = 0;
#ifdef __AVX512F__
  __m512 vsum = _mm512_setzero_ps();
  for (; j < n; j += 16) {
    const __mmask16 m = first_lanes(n - j);
    const __m512 e = exp_nonpositive(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, s + j), _mm512_set1_ps(max)));
    _mm512_mask_storeu_ps(s + j, m, e);
    vsum = _mm512_mask_add_ps(vsum, m, vsum, e);
  }
  sum = _mm512_reduce_add_ps(vsum);
#elif defined(EPD_AVX2)
  __m256 vsum = _mm256_setzero_ps();
  for (; j + 8 <= n; j += 8) {
    const __m256 e = exp_nonpositive8(_mm256_sub_ps(_mm256_loadu_ps(s + j), _mm256_set1_ps(max)));
    _mm256_storeu_ps(s + j, e);
    vsum = _mm256_add_ps(vsum, e);
  }
  sum = reduce_add8(vsum);
#endif
  for (; j < n; ++j) sum += s[j] = std::exp(s[j] - max);
  return sum;
}

// A task covers this many KV heads of one sequence: all of them (each token row read as one
// contiguous stretch) when the batch alone gives every thread several tasks, else fewer.
inline int64_t kv_heads_per_task(int64_t batch, int64_t num_kv_heads) {
  const int64_t min_tasks = 4 * int64_t(at::get_num_threads());
  int64_t span = num_kv_heads;
  while (span > 1 && (num_kv_heads % span != 0 || batch * (num_kv_heads / span) < min_tasks)) --span;
  return span;
}

// C > 0: AVX-512 path for head_dim 16 * C (AVX2: 8 * C); C == 0: any head_dim.
template <typename T, int C>
void decode(const at::Tensor& q, const at::Tensor& cache, const at::Tensor& tables,
            const at::Tensor& lens, at::Tensor& out, double scale, int64_t window) {
  const int64_t batch = q.size(0), num_heads = q.size(1), dim = q.size(2);
  const int64_t num_blocks = cache.size(1), block_size = cache.size(2), num_kv_heads = cache.size(3);
  const int64_t group = num_heads / num_kv_heads;
  const int64_t q_seq_stride = q.stride(0), q_head_stride = q.stride(1);
  const int64_t max_blocks = tables.size(1), table_stride = tables.stride(0);
  // Element offsets in the pages: token rows are num_kv_heads * dim apart, blocks block_size rows.
  const int64_t row_stride = num_kv_heads * dim, block_stride = block_size * row_stride;
  // A task: one sequence, KV heads [kv_head0, kv_head0 + span), query heads [head0, head0 + heads).
  const int64_t span = kv_heads_per_task(batch, num_kv_heads), tasks_per_seq = num_kv_heads / span;
  const int64_t heads = span * group, slice_bytes = span * dim * int64_t(sizeof(T));
  const T* q_ptr = q.data_ptr<T>();
  const T* k_pages = cache.data_ptr<T>();
  const T* v_pages = k_pages + num_blocks * block_stride;
  const int64_t* table_ptr = tables.data_ptr<int64_t>();
  const int64_t* len_ptr = lens.data_ptr<int64_t>();
  T* out_ptr = out.data_ptr<T>();
  const float fscale = float(scale);

  at::parallel_for(0, batch * tasks_per_seq, 1, [&](int64_t begin, int64_t end) {
    // Per thread: accumulators [heads, dim]; scores [heads, kTile]; running max and sum per
    // head; scratch for lane partial sums (kTile * 16) or widened rows (2 * dim).
    std::vector<float> work(heads * dim + heads * kTile + 2 * heads + kTile * 16 + 2 * dim);
    float* acc = work.data();
    float* scores = acc + heads * dim;
    float* run_max = scores + heads * kTile;
    float* run_sum = run_max + heads;
    float* scratch = run_sum + heads;
    int64_t tile_offsets[2 * kTile];  // row offsets of the current and the next tile's keys

    for (int64_t task = begin; task < end; ++task) {
      const int64_t seq = task / tasks_per_seq, kv_head0 = (task % tasks_per_seq) * span;
      const int64_t head0 = kv_head0 * group;
      const int64_t context_len = len_ptr[seq];
      TORCH_CHECK(context_len >= 0 && context_len <= max_blocks * block_size,
                  "context length ", context_len, " outside the block table");
      const int64_t first = window > 0 ? std::max<int64_t>(0, context_len - window) : 0;
      const int64_t* table = table_ptr + seq * table_stride;
      std::fill(acc, acc + heads * dim, 0.f);
      std::fill(run_max, run_max + heads, -std::numeric_limits<float>::infinity());
      std::fill(run_sum, run_sum + heads, 0.f);

      // Element offsets of a tile's row slices (KV heads kv_head0..) in the K or V pages.
      auto fill_offsets = [&](int64_t start, int64_t n, int64_t* offsets) {
        int64_t block_idx = start / block_size, in_block = start - block_idx * block_size;
        for (int64_t j = 0; j < n; ++j) {
          const int64_t block = table[block_idx];
          TORCH_CHECK(block >= 0 && block < num_blocks, "block id ", block, " out of range");
          offsets[j] = block * block_stride + in_block * row_stride + kv_head0 * dim;
          if (++in_block == block_size) in_block = 0, ++block_idx;
        }
      };
      // Prefetching a tile ahead keeps many cache misses in flight across page boundaries.
      auto prefetch = [&](const T* pages, const int64_t* offsets, int64_t n) {
        for (int64_t j = 0; j < n; ++j) {
          const char* p = reinterpret_cast<const char*>(pages + offsets[j]);
          for (int64_t b = 0; b < slice_bytes; b += 64) __builtin_prefetch(p + b, 0, 3);
        }
      };
      int64_t* offsets = tile_offsets;
      int64_t* next_offsets = tile_offsets + kTile;
      if (first < context_len) {
        fill_offsets(first, std::min(kTile, context_len - first), offsets);
        prefetch(k_pages, offsets, std::min(kTile, context_len - first));
      }
      for (int64_t start = first; start < context_len; start += kTile) {
        const int64_t n = std::min(kTile, context_len - start);
        prefetch(v_pages, offsets, n);
        for (int64_t h = 0; h < heads; ++h) {
          const T* qh = q_ptr + seq * q_seq_stride + (head0 + h) * q_head_stride;
          const T* keys = k_pages + (h / group) * dim;
          if constexpr (C > 0) {
            score_keys<T, C>(qh, keys, offsets, n, scores + h * kTile, scratch);
          } else {
            score_keys_any<T>(qh, keys, offsets, n, dim, scores + h * kTile, scratch);
          }
        }
        for (int64_t h = 0; h < heads; ++h) {
          float* s = scores + h * kTile;
          const float new_max = std::max(run_max[h], scale_scores(s, n, fscale));
          const float correction = std::exp(run_max[h] - new_max);  // 0 on the first tile
          run_sum[h] = run_sum[h] * correction + exp_shifted(s, n, new_max);
          run_max[h] = new_max;
          if (correction != 1.f) {
            for (int64_t i = 0; i < dim; ++i) acc[h * dim + i] *= correction;
          }
        }
        const int64_t next_start = start + kTile;
        if (next_start < context_len) {
          fill_offsets(next_start, std::min(kTile, context_len - next_start), next_offsets);
          prefetch(k_pages, next_offsets, std::min(kTile, context_len - next_start));
        }
        for (int64_t h = 0; h < heads; ++h) {
          const T* values = v_pages + (h / group) * dim;
          if constexpr (C > 0) {
            accumulate_values<T, C>(acc + h * dim, values, offsets, n, scores + h * kTile);
          } else {
            accumulate_values_any<T>(acc + h * dim, values, offsets, n, dim, scores + h * kTile, scratch);
          }
        }
        std::swap(offsets, next_offsets);
      }

      for (int64_t h = 0; h < heads; ++h) {
        const float inv = run_sum[h] > 0.f ? 1.f / run_sum[h] : 0.f;
        T* dst = out_ptr + (seq * num_heads + head0 + h) * dim;
        for (int64_t i = 0; i < dim; ++i) dst[i] = T(acc[h * dim + i] * inv);
      }
    }
  });
}

template <typename T>
void dispatch(const at::Tensor& q, const at::Tensor& cache, const at::Tensor& tables, const at::Tensor& lens,
              at::Tensor& out, double scale, int64_t window) {
#ifdef __AVX512F__
  switch (q.size(2)) {
    case 64: return decode<T, 4>(q, cache, tables, lens, out, scale, window);
    case 128: return decode<T, 8>(q, cache, tables, lens, out, scale, window);
    case 256: return decode<T, 16>(q, cache, tables, lens, out, scale, window);
  }
#elif defined(EPD_AVX2)
  switch (q.size(2)) {
    case 64: return decode<T, 8>(q, cache, tables, lens, out, scale, window);
    case 128: return decode<T, 16>(q, cache, tables, lens, out, scale, window);
    case 256: return decode<T, 32>(q, cache, tables, lens, out, scale, window);
  }
#endif
  decode<T, 0>(q, cache, tables, lens, out, scale, window);
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
    dispatch<float>(q, cache, block_tables, context_lens, out, scale, sliding_window);
  } else {
    TORCH_CHECK(q.scalar_type() == at::kBFloat16, "float32 or bfloat16 only");
    dispatch<c10::BFloat16>(q, cache, block_tables, context_lens, out, scale, sliding_window);
  }
  return out;
}

// RMSNorm over the last dimension, one pass per row for the sum of squares (float32) and one
// for the output, as Hugging Face's LlamaRMSNorm rounds it: y = w * dtype(x * rsqrt(mean(x^2) + eps)).
// torch's CPU rms_norm runs ~8 ops per call (casts, pow, mean, rsqrt, muls): at decode's one row
// per sequence those dominate a 576-wide norm.
namespace {

template <typename T>
void rms_norm_rows(const T* x, const T* w, T* out, int64_t rows, int64_t dim, float eps) {
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* xr = x + r * dim;
      T* yr = out + r * dim;
      float sum = 0.f;
#pragma omp simd reduction(+ : sum)
      for (int64_t i = 0; i < dim; ++i) {
        const float v = static_cast<float>(xr[i]);
        sum += v * v;
      }
      const float inv = 1.f / std::sqrt(sum / static_cast<float>(dim) + eps);
#pragma omp simd
      for (int64_t i = 0; i < dim; ++i) {
        const float normed = static_cast<float>(static_cast<T>(static_cast<float>(xr[i]) * inv));
        yr[i] = static_cast<T>(static_cast<float>(w[i]) * normed);
      }
    }
  });
}

}  // namespace

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.is_contiguous() && weight.is_contiguous() && x.device().is_cpu() && weight.device().is_cpu(),
              "contiguous CPU tensors only");
  TORCH_CHECK(x.scalar_type() == weight.scalar_type(), "x and weight dtypes differ");
  const int64_t dim = weight.numel();
  TORCH_CHECK(dim > 0 && x.size(-1) == dim, "weight does not match x's last dimension");
  at::Tensor out = at::empty_like(x);
  const int64_t rows = x.numel() / dim;
  if (x.scalar_type() == at::kFloat) {
    rms_norm_rows<float>(x.data_ptr<float>(), weight.data_ptr<float>(), out.data_ptr<float>(), rows, dim,
                         static_cast<float>(eps));
  } else {
    TORCH_CHECK(x.scalar_type() == at::kBFloat16, "float32 or bfloat16 only");
    rms_norm_rows<c10::BFloat16>(x.data_ptr<c10::BFloat16>(), weight.data_ptr<c10::BFloat16>(),
                                 out.data_ptr<c10::BFloat16>(), rows, dim, static_cast<float>(eps));
  }
  return out;
}
