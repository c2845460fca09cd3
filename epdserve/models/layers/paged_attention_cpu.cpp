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
// Tiles ahead whose keys and values are prefetched into L2 (2-6 measured alike).
constexpr int64_t kPrefetchTiles = 3;

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

// One sequence's pages as a decode task reads them: element offsets of the task's row slices
// (its KV heads' part of each token row) for a run of tokens, and their prefetch.
template <typename T>
struct PageWalk {
  const int64_t* table;  // the sequence's block table
  int64_t num_blocks, block_size, row_stride, block_stride, head_offset, slice_bytes;

  void offsets(int64_t start, int64_t n, int64_t* out) const {
    int64_t block_idx = start / block_size, in_block = start - block_idx * block_size;
    for (int64_t j = 0; j < n; ++j) {
      const int64_t block = table[block_idx];
      TORCH_CHECK(block >= 0 && block < num_blocks, "block id ", block, " out of range");
      out[j] = block * block_stride + in_block * row_stride + head_offset;
      if (++in_block == block_size) in_block = 0, ++block_idx;
    }
  }

  // Prefetching keeps many cache misses in flight across page boundaries (a sequence's pages
  // lie anywhere in the pool): locality 3 into L1 (the tile next), 2 into L2 (tiles further
  // ahead). With the L2 prefetch the online-softmax kernel ran 1.34-1.45x faster than with the
  // one-tile L1 prefetch alone over a pool-sized cache (batch 8-64, AMD EPYC without AMX;
  // benchmarks/decode_attention_revisions.py).
  void prefetch(const T* pages, const int64_t* offs, int64_t n, int locality) const {
    for (int64_t j = 0; j < n; ++j) {
      const char* p = reinterpret_cast<const char*>(pages + offs[j]);
      if (locality == 3) {
        for (int64_t b = 0; b < slice_bytes; b += 64) __builtin_prefetch(p + b, 0, 3);
      } else {
        for (int64_t b = 0; b < slice_bytes; b += 64) __builtin_prefetch(p + b, 0, 2);
      }
    }
  }
};

// A task covers this many KV heads of one sequence: all of them (each token row read as one
// contiguous stretch) when the batch alone gives every thread several tasks, else fewer.
inline int64_t kv_heads_per_task(int64_t batch, int64_t num_kv_heads) {
  const int64_t min_tasks = 4 * int64_t(at::get_num_threads());
  int64_t span = num_kv_heads;
  while (span > 1 && (num_kv_heads % span != 0 || batch * (num_kv_heads / span) < min_tasks)) --span;
  return span;
}

// What both decode kernels read of their inputs: sizes, strides and pointers. A task is one
// sequence's KV heads [kv_head0, kv_head0 + span) and query heads [head0, head0 + heads).
template <typename T>
struct DecodeInputs {
  int64_t batch, num_heads, dim, num_blocks, block_size, num_kv_heads, group;
  int64_t q_seq_stride, q_head_stride, max_blocks, table_stride;
  int64_t row_stride, block_stride;  // token rows num_kv_heads * dim apart, blocks block_size rows
  int64_t span, tasks_per_seq, heads, slice_bytes;
  const T* q_ptr;
  const T* k_pages;
  const T* v_pages;
  const int64_t* table_ptr;
  const int64_t* len_ptr;
  T* out_ptr;

  DecodeInputs(const at::Tensor& q, const at::Tensor& cache, const at::Tensor& tables, const at::Tensor& lens,
               at::Tensor& out)
      : batch(q.size(0)), num_heads(q.size(1)), dim(q.size(2)), num_blocks(cache.size(1)),
        block_size(cache.size(2)), num_kv_heads(cache.size(3)), group(num_heads / num_kv_heads),
        q_seq_stride(q.stride(0)), q_head_stride(q.stride(1)), max_blocks(tables.size(1)),
        table_stride(tables.stride(0)), row_stride(num_kv_heads * dim), block_stride(block_size * row_stride),
        span(kv_heads_per_task(batch, num_kv_heads)), tasks_per_seq(num_kv_heads / span), heads(span * group),
        slice_bytes(span * dim * int64_t(sizeof(T))), q_ptr(q.data_ptr<T>()), k_pages(cache.data_ptr<T>()),
        v_pages(k_pages + num_blocks * block_stride), table_ptr(tables.data_ptr<int64_t>()),
        len_ptr(lens.data_ptr<int64_t>()), out_ptr(out.data_ptr<T>()) {}

  PageWalk<T> walk(int64_t seq, int64_t kv_head0) const {
    return {table_ptr + seq * table_stride, num_blocks, block_size, row_stride, block_stride, kv_head0 * dim,
            slice_bytes};
  }
};

// C > 0: AVX-512 path for head_dim 16 * C (AVX2: 8 * C); C == 0: any head_dim.
template <typename T, int C>
void decode(const at::Tensor& q, const at::Tensor& cache, const at::Tensor& tables,
            const at::Tensor& lens, at::Tensor& out, double scale, int64_t window) {
  const DecodeInputs<T> in(q, cache, tables, lens, out);
  const int64_t dim = in.dim, group = in.group, heads = in.heads, span = in.span;
  const float fscale = float(scale);

  at::parallel_for(0, in.batch * in.tasks_per_seq, 1, [&](int64_t begin, int64_t end) {
    // Per thread: accumulators [heads, dim]; scores [heads, kTile]; running max and sum per
    // head; scratch for lane partial sums (kTile * 16) or widened rows (2 * dim).
    std::vector<float> work(heads * dim + heads * kTile + 2 * heads + kTile * 16 + 2 * dim);
    float* acc = work.data();
    float* scores = acc + heads * dim;
    float* run_max = scores + heads * kTile;
    float* run_sum = run_max + heads;
    float* scratch = run_sum + heads;
    int64_t tile_offsets[2 * kTile];  // row offsets of the current and the next tile's keys
    int64_t far_offsets[kTile];       // and of the tile being prefetched into L2

    for (int64_t task = begin; task < end; ++task) {
      const int64_t seq = task / in.tasks_per_seq, kv_head0 = (task % in.tasks_per_seq) * span;
      const int64_t head0 = kv_head0 * group;
      const int64_t context_len = in.len_ptr[seq];
      TORCH_CHECK(context_len >= 0 && context_len <= in.max_blocks * in.block_size,
                  "context length ", context_len, " outside the block table");
      const int64_t first = window > 0 ? std::max<int64_t>(0, context_len - window) : 0;
      std::fill(acc, acc + heads * dim, 0.f);
      std::fill(run_max, run_max + heads, -std::numeric_limits<float>::infinity());
      std::fill(run_sum, run_sum + heads, 0.f);

      const PageWalk<T> walk = in.walk(seq, kv_head0);
      // The next tile's keys and this tile's values into L1, keys and values kPrefetchTiles
      // tiles ahead into L2.
      auto fill_offsets = [&](int64_t start, int64_t n, int64_t* offsets) { walk.offsets(start, n, offsets); };
      auto prefetch = [&](const T* pages, const int64_t* offsets, int64_t n, int locality) {
        walk.prefetch(pages, offsets, n, locality);
      };
      auto prefetch_ahead = [&](int64_t start) {
        if (start >= context_len) return;
        const int64_t n = std::min(kTile, context_len - start);
        fill_offsets(start, n, far_offsets);
        prefetch(in.k_pages, far_offsets, n, 2);
        prefetch(in.v_pages, far_offsets, n, 2);
      };
      int64_t* offsets = tile_offsets;
      int64_t* next_offsets = tile_offsets + kTile;
      if (first < context_len) {
        fill_offsets(first, std::min(kTile, context_len - first), offsets);
        prefetch(in.k_pages, offsets, std::min(kTile, context_len - first), 3);
      }
      for (int64_t i = 1; i < kPrefetchTiles; ++i) prefetch_ahead(first + i * kTile);
      for (int64_t start = first; start < context_len; start += kTile) {
        const int64_t n = std::min(kTile, context_len - start);
        prefetch(in.v_pages, offsets, n, 3);
        prefetch_ahead(start + kPrefetchTiles * kTile);
        for (int64_t h = 0; h < heads; ++h) {
          const T* qh = in.q_ptr + seq * in.q_seq_stride + (head0 + h) * in.q_head_stride;
          const T* keys = in.k_pages + (h / group) * dim;
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
          prefetch(in.k_pages, next_offsets, std::min(kTile, context_len - next_start), 3);
        }
        for (int64_t h = 0; h < heads; ++h) {
          const T* values = in.v_pages + (h / group) * dim;
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
        T* dst = in.out_ptr + (seq * in.num_heads + head0 + h) * dim;
        for (int64_t i = 0; i < dim; ++i) dst[i] = T(acc[h * dim + i] * inv);
      }
    }
  });
}

#ifdef __AVX512BF16__
// --- bf16 decode in three passes over a task's context (AVX512-BF16, head_dim 16 * C). --------
//
// Scores of every key first (each key row loaded once for the GQA group's query heads), then one
// softmax per head over its whole row (no per-tile running max, rescale or reductions), then
// the values two keys at a time: per 32-dim chunk of keys j and j+1, unpacklo/hi_epi16 give two
// vectors of 16 (v_j[d], v_j+1[d]) pairs, and vdpbf16ps with the broadcast pair of their
// probabilities adds both terms to 16 float32 lanes in one instruction (the interleaved rows
// serve every query head of the KV head). Probabilities are rounded to bf16 for that product,
// as torch's CPU flash attention rounds them for bf16; sums stay float32. The accumulator's
// lanes hold the dims in the unpack's order (paired_lane_dim), undone when the row is written.
// Against the online-softmax kernel: 1.29x over a pool-sized cache at batch 64, 1.5x with the
// pages in L3 (benchmarks/decode_attention_revisions.py, AMD EPYC without AMX).
constexpr int64_t kMaxRowsGroup = 8;  // query heads per KV head with their query in registers

// The dim held by accumulator lane i: per 32-dim chunk the unpacklo vector (dims 0-3, 8-11,
// 16-19, 24-27 of the chunk) then the unpackhi vector (4-7, 12-15, ...).
inline int64_t paired_lane_dim(int64_t i) {
  const int64_t chunk = i / 32, half = (i % 32) / 16, lane = i % 16;
  return chunk * 32 + (lane / 4) * 8 + half * 4 + lane % 4;
}

// out[j] = bf16(s[j]) for j < n, rounding to nearest even as torch does.
inline void round_bf16_row(const float* s, int64_t n, c10::BFloat16* out) {
  for (int64_t j = 0; j < n; j += 16) {
    const __mmask16 m = first_lanes(n - j);
    _mm256_mask_storeu_epi16(out + j, m, (__m256i)_mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(m, s + j)));
  }
}

// pairs[(j / 2) * C + c]: keys j and j+1 interleaved, C vectors per pair (an odd last key is
// paired with itself; its partner's probability is 0).
template <int C>
void interleave_values(const c10::BFloat16* values, const int64_t* offsets, int64_t n, __m512i* pairs) {
  for (int64_t j = 0; j < n; j += 2) {
    const c10::BFloat16* a = values + offsets[j];
    const c10::BFloat16* b = j + 1 < n ? values + offsets[j + 1] : a;
    for (int c2 = 0; c2 < C / 2; ++c2) {
      const __m512i va = _mm512_loadu_si512(a + 32 * c2), vb = _mm512_loadu_si512(b + 32 * c2);
      pairs[(j / 2) * C + 2 * c2] = _mm512_unpacklo_epi16(va, vb);
      pairs[(j / 2) * C + 2 * c2 + 1] = _mm512_unpackhi_epi16(va, vb);
    }
  }
}

// body(start, n, offsets) for each tile of keys [first, context_len) of one of K or V, with the
// next tile prefetched into L1 and kPrefetchTiles ahead into L2.
template <typename Body>
void for_each_tile(const PageWalk<c10::BFloat16>& walk, const c10::BFloat16* pages, int64_t first,
                   int64_t context_len, Body&& body) {
  int64_t tile_offsets[2 * kTile], far_offsets[kTile];
  int64_t* offsets = tile_offsets;
  int64_t* next_offsets = tile_offsets + kTile;
  auto ahead = [&](int64_t start) {
    if (start >= context_len) return;
    const int64_t n = std::min(kTile, context_len - start);
    walk.offsets(start, n, far_offsets);
    walk.prefetch(pages, far_offsets, n, 2);
  };
  if (first < context_len) {
    const int64_t n = std::min(kTile, context_len - first);
    walk.offsets(first, n, offsets);
    walk.prefetch(pages, offsets, n, 3);
  }
  for (int64_t i = 1; i < kPrefetchTiles; ++i) ahead(first + i * kTile);
  for (int64_t start = first; start < context_len; start += kTile) {
    ahead(start + kPrefetchTiles * kTile);
    const int64_t next = start + kTile;
    if (next < context_len) {
      const int64_t n = std::min(kTile, context_len - next);
      walk.offsets(next, n, next_offsets);
      walk.prefetch(pages, next_offsets, n, 3);
    }
    body(start, std::min(kTile, context_len - start), offsets);
    std::swap(offsets, next_offsets);
  }
}

template <int C>
void decode_rows(const at::Tensor& q, const at::Tensor& cache, const at::Tensor& tables,
                 const at::Tensor& lens, at::Tensor& out, double scale, int64_t window) {
  using T = c10::BFloat16;
  constexpr int64_t D = 16 * C;
  const DecodeInputs<T> in(q, cache, tables, lens, out);
  const int64_t group = in.group, heads = in.heads, span = in.span;
  TORCH_CHECK(group <= kMaxRowsGroup, "at most ", kMaxRowsGroup, " query heads per KV head");
  TORCH_CHECK(in.dim == D, "head_dim ", in.dim, " is not ", D);
  const float fscale = float(scale);
  int64_t longest = 0;
  for (int64_t b = 0; b < in.batch; ++b) longest = std::max(longest, in.len_ptr[b]);
  TORCH_CHECK(longest <= in.max_blocks * in.block_size, "context length ", longest, " outside the block table");
  const int64_t row_len = (longest + kTile - 1) / kTile * kTile;

  at::parallel_for(0, in.batch * in.tasks_per_seq, 1, [&](int64_t begin, int64_t end) {
    // Per thread: accumulators [heads, D]; score rows [heads, row_len]; lane partial sums of a
    // tile per query head of a group; probabilities [heads, row_len] in bf16.
    std::vector<float> work(heads * D + heads * row_len + kMaxRowsGroup * kTile * 16);
    float* acc = work.data();
    float* scores = acc + heads * D;
    float* partial = scores + heads * row_len;
    std::vector<T> probs(heads * row_len);
    std::vector<float> inv_sum(heads);
    __m512i value_pairs[kTile / 2 * C];
    for (int64_t task = begin; task < end; ++task) {
      const int64_t seq = task / in.tasks_per_seq, kv_head0 = (task % in.tasks_per_seq) * span;
      const int64_t head0 = kv_head0 * group;
      const int64_t context_len = in.len_ptr[seq];
      TORCH_CHECK(context_len >= 0, "negative context length ", context_len);
      const int64_t first = window > 0 ? std::max<int64_t>(0, context_len - window) : 0;
      const int64_t count = context_len - first;
      const PageWalk<T> walk = in.walk(seq, kv_head0);
      std::fill(acc, acc + heads * D, 0.f);

      // Pass 1: scores[h][key - first] = q_h . key (unscaled).
      for_each_tile(walk, in.k_pages, first, context_len, [&](int64_t start, int64_t n, const int64_t* offsets) {
        for (int64_t kv = 0; kv < span; ++kv) {
          __m512bh qv[kMaxRowsGroup][C / 2];
          for (int64_t g = 0; g < group; ++g) {
            const T* qh = in.q_ptr + seq * in.q_seq_stride + (head0 + kv * group + g) * in.q_head_stride;
            for (int c = 0; c < C / 2; ++c) qv[g][c] = (__m512bh)_mm512_loadu_si512(qh + 32 * c);
          }
          for (int64_t j = 0; j < n; ++j) {
            const T* k = in.k_pages + offsets[j] + kv * D;
            __m512bh kk[C / 2];
            for (int c = 0; c < C / 2; ++c) kk[c] = (__m512bh)_mm512_loadu_si512(k + 32 * c);
            for (int64_t g = 0; g < group; ++g) {
              __m512 sum = _mm512_setzero_ps();
              for (int c = 0; c < C / 2; ++c) sum = _mm512_dpbf16_ps(sum, qv[g][c], kk[c]);
              _mm512_storeu_ps(partial + (g * kTile + j) * 16, sum);
            }
          }
          for (int64_t g = 0; g < group; ++g) {
            // lanes past n hold an earlier tile's sums: scores past count are never read
            sum_lanes16(partial + g * kTile * 16, scores + (kv * group + g) * row_len + (start - first));
          }
        }
      });

      // Pass 2: a softmax per head over its row; probabilities rounded to bf16.
      for (int64_t h = 0; h < heads; ++h) {
        float* s = scores + h * row_len;
        const float sum = exp_shifted(s, count, scale_scores(s, count, fscale));
        inv_sum[h] = sum > 0.f ? 1.f / sum : 0.f;
        round_bf16_row(s, count, probs.data() + h * row_len);
      }

      // Pass 3: acc_h += p_j * v_j, two keys per instruction.
      for_each_tile(walk, in.v_pages, first, context_len, [&](int64_t start, int64_t n, const int64_t* offsets) {
        for (int64_t kv = 0; kv < span; ++kv) {
          interleave_values<C>(in.v_pages + kv * D, offsets, n, value_pairs);
          for (int64_t h = kv * group; h < (kv + 1) * group; ++h) {
            const T* p = probs.data() + h * row_len + (start - first);
            __m512 a[C];
            for (int c = 0; c < C; ++c) a[c] = _mm512_loadu_ps(acc + h * D + 16 * c);
            for (int64_t j = 0; j < n; j += 2) {
              // an odd last key: its partner's probability (the upper half) is 0
              const int32_t bits = j + 1 < n ? *reinterpret_cast<const int32_t*>(p + j)
                                             : int32_t(*reinterpret_cast<const uint16_t*>(p + j));
              const __m512bh pair = (__m512bh)_mm512_set1_epi32(bits);
              for (int c = 0; c < C; ++c) a[c] = _mm512_dpbf16_ps(a[c], pair, (__m512bh)value_pairs[(j / 2) * C + c]);
            }
            for (int c = 0; c < C; ++c) _mm512_storeu_ps(acc + h * D + 16 * c, a[c]);
          }
        }
      });

      for (int64_t h = 0; h < heads; ++h) {
        T* dst = in.out_ptr + (seq * in.num_heads + head0 + h) * D;
        for (int64_t i = 0; i < D; ++i) dst[paired_lane_dim(i)] = T(acc[h * D + i] * inv_sum[h]);
      }
    }
  });
}
#endif

template <typename T>
void dispatch(const at::Tensor& q, const at::Tensor& cache, const at::Tensor& tables, const at::Tensor& lens,
              at::Tensor& out, double scale, int64_t window) {
#ifdef __AVX512BF16__
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    if (q.size(1) / cache.size(3) <= kMaxRowsGroup) {
      switch (q.size(2)) {
        case 64: return decode_rows<4>(q, cache, tables, lens, out, scale, window);
        case 128: return decode_rows<8>(q, cache, tables, lens, out, scale, window);
        case 256: return decode_rows<16>(q, cache, tables, lens, out, scale, window);
      }
    }
  }
#endif
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

// out [B, H, D] (contiguous, q's dtype) = paged_decode_attention(q, ...), written in place.
void paged_decode_attention_into(const at::Tensor& q, const at::Tensor& cache, const at::Tensor& block_tables,
                                 const at::Tensor& context_lens, at::Tensor& out, double scale,
                                 int64_t sliding_window) {
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
  TORCH_CHECK(out.is_contiguous() && out.sizes() == q.sizes() && out.scalar_type() == q.scalar_type() &&
                  out.device().is_cpu(), "out must be contiguous, q's shape and dtype");
  if (q.scalar_type() == at::kFloat) {
    dispatch<float>(q, cache, block_tables, context_lens, out, scale, sliding_window);
  } else {
    TORCH_CHECK(q.scalar_type() == at::kBFloat16, "float32 or bfloat16 only");
    dispatch<c10::BFloat16>(q, cache, block_tables, context_lens, out, scale, sliding_window);
  }
}

at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& cache, const at::Tensor& block_tables,
                                  const at::Tensor& context_lens, double scale, int64_t sliding_window) {
  at::Tensor out = at::empty({q.size(0), q.size(1), q.size(2)}, q.options());
  paged_decode_attention_into(q, cache, block_tables, context_lens, out, scale, sliding_window);
  return out;
}

// --- Prefill attention: one sequence's query tokens over its keys, bf16 on AVX512-BF16. ------
//
// The product of q rows and keys, then of probabilities and values, as small matrix products on
// vdpbf16ps (pairs of bf16 products summed into float32 lanes), with the operands laid out so
// that every instruction's 32 bf16 are one 64-byte load: keys packed per tile of 16 as
// [dim pair][key][2], values per pair of keys as [dim][2]. A task takes 16 query rows of one
// head and every key they see: scores in float32 (scaled, masked to the row's causal and window
// range), a softmax over the whole row (no running rescale), probabilities rounded to bf16 for
// the value product, float32 sums, the row divided by its sum at the end: torch's CPU flash
// attention rounds the same way for bf16, so the output differs from it only by the order of
// float32 additions.
namespace {

#ifdef __AVX512BF16__
constexpr int64_t kPrefillRows = 16;  // query rows per task (16 score accumulators)
constexpr int64_t kPrefillKeys = 16;  // keys per score tile: one float32 vector per row

// out [n, H, D] = attention of q [n, H, D] (positions start_pos..) over k, v [S, KVH, D],
// S = start_pos + n; window W > 0: a row at position p sees keys p-W+1 .. p. D = 16 * C.
template <int C>
void prefill(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor& out,
             int64_t start_pos, float scale, int64_t window) {
  using bf16 = c10::BFloat16;
  constexpr int64_t D = 16 * C, kPairs = D / 2;
  const int64_t n = q.size(0), num_heads = q.size(1), num_keys = k.size(0), num_kv_heads = k.size(1);
  const int64_t group = num_heads / num_kv_heads;
  const int64_t tiles = (num_keys + kPrefillKeys - 1) / kPrefillKeys, padded = tiles * kPrefillKeys;
  const bf16* q_ptr = q.data_ptr<bf16>();
  const bf16* k_ptr = k.data_ptr<bf16>();
  const bf16* v_ptr = v.data_ptr<bf16>();
  bf16* out_ptr = out.data_ptr<bf16>();
  const int64_t q_token = q.stride(0), q_head = q.stride(1);
  const int64_t k_token = k.stride(0), k_head = k.stride(1), v_token = v.stride(0), v_head = v.stride(1);

  // Packed keys [KVH][tile][pair][key][2] and values [KVH][key pair][dim][2], keys past the
  // last zero (a zero probability times a zero value: padding adds nothing, never a NaN).
  at::Tensor packed = at::empty({2, num_kv_heads, padded * D}, q.options());
  bf16* keys_packed = packed.data_ptr<bf16>();
  bf16* values_packed = keys_packed + num_kv_heads * padded * D;
  at::parallel_for(0, num_kv_heads * tiles, 1, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t kv_head = task / tiles, tile = task % tiles;
      bf16* kd = keys_packed + (kv_head * padded + tile * kPrefillKeys) * D;
      bf16* vd = values_packed + (kv_head * padded + tile * kPrefillKeys) * D;
      for (int64_t j = 0; j < kPrefillKeys; ++j) {
        const int64_t key = tile * kPrefillKeys + j;
        const bf16* kr = key < num_keys ? k_ptr + key * k_token + kv_head * k_head : nullptr;
        const bf16* vr = key < num_keys ? v_ptr + key * v_token + kv_head * v_head : nullptr;
        for (int64_t p = 0; p < kPairs; ++p) {
          kd[(p * kPrefillKeys + j) * 2] = kr ? kr[2 * p] : bf16(0.f);
          kd[(p * kPrefillKeys + j) * 2 + 1] = kr ? kr[2 * p + 1] : bf16(0.f);
        }
        for (int64_t d = 0; d < D; ++d) vd[((j / 2) * D + d) * 2 + (j & 1)] = vr ? vr[d] : bf16(0.f);
      }
    }
  });

  const int64_t row_blocks = (n + kPrefillRows - 1) / kPrefillRows;
  at::parallel_for(0, num_heads * row_blocks, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(kPrefillRows * padded);
    std::vector<bf16> probs(kPrefillRows * padded);
    alignas(64) bf16 rows[kPrefillRows * D];  // the task's q rows, zeros past the last
    float row_sum[kPrefillRows];
    for (int64_t task = begin; task < end; ++task) {
      const int64_t head = task / row_blocks, row0 = (task % row_blocks) * kPrefillRows;
      const int64_t m = std::min(kPrefillRows, n - row0), kv_head = head / group;
      std::fill(rows + m * D, rows + kPrefillRows * D, bf16(0.f));
      for (int64_t i = 0; i < m; ++i) std::copy_n(q_ptr + (row0 + i) * q_token + head * q_head, D, rows + i * D);
      // Keys seen by any of the rows: [first_key, last_row_pos], in whole tiles.
      const int64_t last_pos = start_pos + row0 + m - 1;
      const int64_t first_key = window > 0 ? std::max<int64_t>(0, start_pos + row0 - window + 1) : 0;
      const int64_t k0 = first_key / kPrefillKeys * kPrefillKeys;
      const int64_t k1 = (last_pos / kPrefillKeys + 1) * kPrefillKeys;

      // scores[i][key] = q_i . key for 16 rows x 16 keys per tile.
      const bf16* head_keys = keys_packed + kv_head * padded * D;
      for (int64_t tile = k0; tile < k1; tile += kPrefillKeys) {
        __m512 acc[kPrefillRows];
        for (int i = 0; i < kPrefillRows; ++i) acc[i] = _mm512_setzero_ps();
        const bf16* kt = head_keys + tile * D;
        for (int64_t p = 0; p < kPairs; ++p) {
          const __m512bh kv = (__m512bh)_mm512_loadu_si512(kt + p * 2 * kPrefillKeys);
          for (int i = 0; i < kPrefillRows; ++i) {
            const int32_t pair = *reinterpret_cast<const int32_t*>(rows + i * D + 2 * p);
            acc[i] = _mm512_dpbf16_ps(acc[i], (__m512bh)_mm512_set1_epi32(pair), kv);
          }
        }
        for (int i = 0; i < kPrefillRows; ++i) _mm512_storeu_ps(scores.data() + i * padded + tile, acc[i]);
      }

      // Softmax per row over its own keys [lo, hi) (the decode kernels' scale_scores and
      // exp_shifted); probabilities elsewhere in [k0, k1) are 0.
      for (int64_t i = 0; i < kPrefillRows; ++i) {
        float* s = scores.data() + i * padded;
        bf16* pr = probs.data() + i * padded;
        if (i >= m) {
          std::fill(pr + k0, pr + k1, bf16(0.f));
          row_sum[i] = 1.f;
          continue;
        }
        const int64_t pos = start_pos + row0 + i;
        const int64_t lo = window > 0 ? std::max<int64_t>(0, pos - window + 1) : 0, hi = pos + 1;
        row_sum[i] = exp_shifted(s + lo, hi - lo, scale_scores(s + lo, hi - lo, scale));
        std::fill(pr + k0, pr + lo, bf16(0.f));
        round_bf16_row(s + lo, hi - lo, pr + lo);
        std::fill(pr + hi, pr + k1, bf16(0.f));
      }

      // out rows = probs @ values, R rows x C vectors of accumulators at a time.
      constexpr int R = C >= 16 ? 1 : 16 / C;
      const bf16* head_values = values_packed + kv_head * padded * D;
      for (int64_t i0 = 0; i0 < m; i0 += R) {
        __m512 acc[R][C];
        for (int r = 0; r < R; ++r)
          for (int c = 0; c < C; ++c) acc[r][c] = _mm512_setzero_ps();
        for (int64_t key = k0; key < k1; key += 2) {
          const bf16* vrow = head_values + key * D;
          __m512bh vv[C];
          for (int c = 0; c < C; ++c) vv[c] = (__m512bh)_mm512_loadu_si512(vrow + 32 * c);
          for (int r = 0; r < R; ++r) {
            const int32_t pair = *reinterpret_cast<const int32_t*>(probs.data() + (i0 + r) * padded + key);
            const __m512bh pv = (__m512bh)_mm512_set1_epi32(pair);
            for (int c = 0; c < C; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], pv, vv[c]);
          }
        }
        for (int r = 0; r < R && i0 + r < m; ++r) {
          const __m512 inv = _mm512_set1_ps(row_sum[i0 + r] > 0.f ? 1.f / row_sum[i0 + r] : 0.f);
          bf16* dst = out_ptr + ((row0 + i0 + r) * num_heads + head) * D;
          for (int c = 0; c < C; ++c) {
            const __m256bh rounded = _mm512_cvtneps_pbh(_mm512_mul_ps(acc[r][c], inv));
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + 16 * c), (__m256i)rounded);
          }
        }
      }
    }
  });
}
#endif

}  // namespace

bool has_prefill_attention() {
#ifdef __AVX512BF16__
  return true;
#else
  return false;
#endif
}

at::Tensor prefill_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, int64_t start_pos,
                             double scale, int64_t sliding_window) {
  TORCH_CHECK(has_prefill_attention(), "prefill attention needs a CPU with AVX512-BF16");
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3, "q, k and v must be [tokens, heads, D]");
  TORCH_CHECK(q.stride(2) == 1 && k.stride(2) == 1 && v.stride(2) == 1, "unit last stride required");
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 && k.scalar_type() == at::kBFloat16 &&
              v.scalar_type() == at::kBFloat16, "bfloat16 only");
  TORCH_CHECK(q.device().is_cpu() && k.device().is_cpu() && v.device().is_cpu(), "CPU tensors only");
  TORCH_CHECK(k.sizes() == v.sizes() && k.size(2) == q.size(2) && q.size(1) % k.size(1) == 0,
              "k and v must be [S, KVH, D] with KVH dividing q's heads");
  TORCH_CHECK(start_pos >= 0 && k.size(0) == start_pos + q.size(0), "k must hold start_pos + n tokens");
  at::Tensor out = at::empty({q.size(0), q.size(1), q.size(2)}, q.options());
  if (q.size(0) == 0) return out;
#ifdef __AVX512BF16__
  switch (q.size(2)) {
    case 64: prefill<4>(q, k, v, out, start_pos, float(scale), sliding_window); return out;
    case 128: prefill<8>(q, k, v, out, start_pos, float(scale), sliding_window); return out;
    case 256: prefill<16>(q, k, v, out, start_pos, float(scale), sliding_window); return out;
  }
#endif
  TORCH_CHECK(false, "head_dim 64, 128 or 256 only, got ", q.size(2));
}

// --- Elementwise kernels: RMSNorm (alone and after the residual add), gated SiLU, rotary. ----
//
// Each rounds where the torch ops it replaces round (to the tensor's dtype after every op), so
// its output is the same: r() below is a no-op in float32 and bf16's round-to-nearest-even
// otherwise (NaN aside). Rows are processed in vectors of kW floats (AVX-512: 16, AVX2: 8) with
// a scalar tail; work is split over threads only when a call has enough of it (a decode step's
// 64 rows of 576 run on the calling thread: waking a second one costs more than the rows).
namespace {

// Elements per thread below which a call runs on the calling thread alone.
constexpr int64_t kSerialElements = 1 << 15;

inline int64_t row_grain(int64_t dim) { return std::max<int64_t>(1, kSerialElements / std::max<int64_t>(dim, 1)); }

template <typename T>
inline float rnd(float x) {
  return std::is_same<T, float>::value ? x : static_cast<float>(static_cast<T>(x));
}

#if defined(__AVX512F__)
constexpr int64_t kW = 16;
using VF = __m512;
inline VF vload(const float* p) { return _mm512_loadu_ps(p); }
inline VF vload(const c10::BFloat16* p) { return load16(p); }
// bf16 round-to-nearest-even kept in float32: add 0x7FFF plus the lowest kept bit, clear the rest.
inline VF vround_bf16(VF x) {
  const __m512i bits = _mm512_castps_si512(x);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i sum = _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF)));
  return _mm512_castsi512_ps(_mm512_and_si512(sum, _mm512_set1_epi32(int(0xFFFF0000u))));
}
inline void vstore(float* p, VF x) { _mm512_storeu_ps(p, x); }
inline void vstore(c10::BFloat16* p, VF x) {
  const __m512i high = _mm512_srli_epi32(_mm512_castps_si512(vround_bf16(x)), 16);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(high));
}
inline VF vset(float x) { return _mm512_set1_ps(x); }
inline VF vadd(VF a, VF b) { return _mm512_add_ps(a, b); }
inline VF vsub(VF a, VF b) { return _mm512_sub_ps(a, b); }
inline VF vmul(VF a, VF b) { return _mm512_mul_ps(a, b); }
inline VF vdiv(VF a, VF b) { return _mm512_div_ps(a, b); }
inline VF vabs(VF a) { return _mm512_abs_ps(a); }
inline VF vexp_nonpositive(VF x) { return exp_nonpositive(x); }
inline VF vselect_nonnegative(VF x, VF if_nonneg, VF otherwise) {
  return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_GE_OQ), otherwise, if_nonneg);
}
inline float vsum(VF x) { return _mm512_reduce_add_ps(x); }
#define EPD_VEC 1
#elif defined(EPD_AVX2)
constexpr int64_t kW = 8;
using VF = __m256;
inline VF vload(const float* p) { return _mm256_loadu_ps(p); }
inline VF vload(const c10::BFloat16* p) { return load8(p); }
inline VF vround_bf16(VF x) {
  const __m256i bits = _mm256_castps_si256(x);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  const __m256i sum = _mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF)));
  return _mm256_castsi256_ps(_mm256_and_si256(sum, _mm256_set1_epi32(int(0xFFFF0000u))));
}
inline void vstore(float* p, VF x) { _mm256_storeu_ps(p, x); }
inline void vstore(c10::BFloat16* p, VF x) {
  const __m256i high = _mm256_srli_epi32(_mm256_castps_si256(vround_bf16(x)), 16);
  const __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(high), _mm256_extracti128_si256(high, 1));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), packed);
}
inline VF vset(float x) { return _mm256_set1_ps(x); }
inline VF vadd(VF a, VF b) { return _mm256_add_ps(a, b); }
inline VF vsub(VF a, VF b) { return _mm256_sub_ps(a, b); }
inline VF vmul(VF a, VF b) { return _mm256_mul_ps(a, b); }
inline VF vdiv(VF a, VF b) { return _mm256_div_ps(a, b); }
inline VF vabs(VF a) { return _mm256_andnot_ps(_mm256_set1_ps(-0.f), a); }
inline VF vexp_nonpositive(VF x) { return exp_nonpositive8(x); }
inline VF vselect_nonnegative(VF x, VF if_nonneg, VF otherwise) {
  return _mm256_blendv_ps(otherwise, if_nonneg, _mm256_cmp_ps(x, _mm256_setzero_ps(), _CMP_GE_OQ));
}
inline float vsum(VF x) { return reduce_add8(x); }
#define EPD_VEC 1
#endif

#ifdef EPD_VEC
template <typename T>
inline VF vrnd(VF x) {
  if constexpr (std::is_same<T, float>::value) return x; else return vround_bf16(x);
}
#endif

// sum of squares of a row, in float32.
template <typename T>
inline float sum_squares(const T* x, int64_t dim) {
  int64_t i = 0;
  float sum = 0.f;
#ifdef EPD_VEC
  VF acc = vset(0.f);
  for (; i + kW <= dim; i += kW) {
    const VF v = vload(x + i);
    acc = vadd(acc, vmul(v, v));
  }
  sum = vsum(acc);
#endif
  for (; i < dim; ++i) {
    const float v = static_cast<float>(x[i]);
    sum += v * v;
  }
  return sum;
}

// y = r(w * r(x * inv)) over a row (Hugging Face's LlamaRMSNorm rounding).
template <typename T>
inline void scale_row(const T* x, const T* w, T* y, int64_t dim, float inv) {
  int64_t i = 0;
#ifdef EPD_VEC
  const VF vinv = vset(inv);
  for (; i + kW <= dim; i += kW) vstore(y + i, vmul(vload(w + i), vrnd<T>(vmul(vload(x + i), vinv))));
#endif
  for (; i < dim; ++i) y[i] = static_cast<T>(static_cast<float>(w[i]) * rnd<T>(static_cast<float>(x[i]) * inv));
}

inline float inv_rms(float sum, int64_t dim, float eps) {
  return 1.f / std::sqrt(sum / static_cast<float>(dim) + eps);
}

template <typename T>
void rms_norm_rows(const T* x, const T* w, T* out, int64_t rows, int64_t dim, float eps) {
  at::parallel_for(0, rows, row_grain(dim), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* xr = x + r * dim;
      scale_row(xr, w, out + r * dim, dim, inv_rms(sum_squares(xr, dim), dim, eps));
    }
  });
}

// residual = r(x + residual); x = rms_norm(residual), both in place.
template <typename T>
void add_rms_norm_rows(T* x, T* residual, const T* w, int64_t rows, int64_t dim, float eps) {
  at::parallel_for(0, rows, row_grain(dim), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      T* xr = x + r * dim;
      T* hr = residual + r * dim;
      int64_t i = 0;
#ifdef EPD_VEC
      for (; i + kW <= dim; i += kW) vstore(hr + i, vadd(vload(xr + i), vload(hr + i)));
#endif
      for (; i < dim; ++i) hr[i] = static_cast<T>(static_cast<float>(xr[i]) + static_cast<float>(hr[i]));
      scale_row(hr, w, xr, dim, inv_rms(sum_squares(hr, dim), dim, eps));
    }
  });
}

// out = r(r(silu(gate)) * up) for rows [gate | up] of width 2 * inner.
template <typename T>
void silu_and_mul_rows(const T* in, T* out, int64_t rows, int64_t inner) {
  at::parallel_for(0, rows, row_grain(2 * inner), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* gate = in + r * 2 * inner;
      const T* up = gate + inner;
      T* y = out + r * inner;
      int64_t i = 0;
#ifdef EPD_VEC
      const VF one = vset(1.f);
      for (; i + kW <= inner; i += kW) {
        const VF g = vload(gate + i);
        const VF e = vexp_nonpositive(vsub(vset(0.f), vabs(g)));  // exp(-|g|)
        // sigmoid(g) = 1 / (1 + exp(-g)) for g >= 0, exp(g) / (1 + exp(g)) below.
        const VF sig = vdiv(vselect_nonnegative(g, one, e), vadd(one, e));
        vstore(y + i, vmul(vrnd<T>(vmul(g, sig)), vload(up + i)));
      }
#endif
      for (; i < inner; ++i) {
        const float g = static_cast<float>(gate[i]);
        y[i] = static_cast<T>(rnd<T>(g / (1.f + std::exp(-g))) * static_cast<float>(up[i]));
      }
    }
  });
}

// Rotary embedding in place on x [T, heads, D] (last dim contiguous): the halves x1, x2 of each
// head become r(r(x1 c) - r(x2 s)) and r(r(x2 c) + r(x1 s)), with cos_sin [T, D] = [cos | sin].
template <typename T>
void rotary_rows(T* x, const T* cos_sin, int64_t tokens, int64_t heads, int64_t dim, int64_t token_stride,
                 int64_t head_stride) {
  const int64_t half = dim / 2;
  at::parallel_for(0, tokens, row_grain(heads * dim), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const T* c = cos_sin + t * dim;
      const T* s = c + half;
      for (int64_t h = 0; h < heads; ++h) {
        T* x1 = x + t * token_stride + h * head_stride;
        T* x2 = x1 + half;
        int64_t i = 0;
#ifdef EPD_VEC
        for (; i + kW <= half; i += kW) {
          const VF a = vload(x1 + i), b = vload(x2 + i), vc = vload(c + i), vs = vload(s + i);
          vstore(x1 + i, vsub(vrnd<T>(vmul(a, vc)), vrnd<T>(vmul(b, vs))));
          vstore(x2 + i, vadd(vrnd<T>(vmul(b, vc)), vrnd<T>(vmul(a, vs))));
        }
#endif
        for (; i < half; ++i) {
          const float a = static_cast<float>(x1[i]), b = static_cast<float>(x2[i]);
          const float ci = static_cast<float>(c[i]), si = static_cast<float>(s[i]);
          x1[i] = static_cast<T>(rnd<T>(a * ci) - rnd<T>(b * si));
          x2[i] = static_cast<T>(rnd<T>(b * ci) + rnd<T>(a * si));
        }
      }
    }
  });
}

void check_cpu(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be a CPU tensor");
  TORCH_CHECK(t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16, name, ": float32 or bfloat16 only");
}

}  // namespace

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_cpu(x, "x");
  TORCH_CHECK(x.is_contiguous() && weight.is_contiguous(), "contiguous tensors only");
  TORCH_CHECK(x.scalar_type() == weight.scalar_type(), "x and weight dtypes differ");
  const int64_t dim = weight.numel();
  TORCH_CHECK(dim > 0 && x.size(-1) == dim, "weight does not match x's last dimension");
  at::Tensor out = at::empty_like(x);
  const int64_t rows = x.numel() / dim;
  if (x.scalar_type() == at::kFloat) {
    rms_norm_rows<float>(x.data_ptr<float>(), weight.data_ptr<float>(), out.data_ptr<float>(), rows, dim,
                         static_cast<float>(eps));
  } else {
    rms_norm_rows<c10::BFloat16>(x.data_ptr<c10::BFloat16>(), weight.data_ptr<c10::BFloat16>(),
                                 out.data_ptr<c10::BFloat16>(), rows, dim, static_cast<float>(eps));
  }
  return out;
}

void add_rms_norm_(const at::Tensor& x, const at::Tensor& residual, const at::Tensor& weight, double eps) {
  check_cpu(x, "x");
  TORCH_CHECK(x.is_contiguous() && residual.is_contiguous() && weight.is_contiguous(), "contiguous tensors only");
  TORCH_CHECK(x.scalar_type() == residual.scalar_type() && x.scalar_type() == weight.scalar_type(), "dtypes differ");
  TORCH_CHECK(x.sizes() == residual.sizes(), "x and residual shapes differ");
  const int64_t dim = weight.numel();
  TORCH_CHECK(dim > 0 && x.size(-1) == dim, "weight does not match x's last dimension");
  const int64_t rows = x.numel() / dim;
  if (x.scalar_type() == at::kFloat) {
    add_rms_norm_rows<float>(x.data_ptr<float>(), residual.data_ptr<float>(), weight.data_ptr<float>(), rows, dim,
                             static_cast<float>(eps));
  } else {
    add_rms_norm_rows<c10::BFloat16>(x.data_ptr<c10::BFloat16>(), residual.data_ptr<c10::BFloat16>(),
                                     weight.data_ptr<c10::BFloat16>(), rows, dim, static_cast<float>(eps));
  }
}

at::Tensor silu_and_mul(const at::Tensor& gate_up) {
  check_cpu(gate_up, "gate_up");
  TORCH_CHECK(gate_up.is_contiguous() && gate_up.dim() >= 1 && gate_up.size(-1) % 2 == 0,
              "a contiguous [.., 2 * inner] tensor");
  const int64_t inner = gate_up.size(-1) / 2;
  std::vector<int64_t> shape(gate_up.sizes().begin(), gate_up.sizes().end());
  shape.back() = inner;
  at::Tensor out = at::empty(shape, gate_up.options());
  const int64_t rows = inner ? gate_up.numel() / (2 * inner) : 0;
  if (gate_up.scalar_type() == at::kFloat) {
    silu_and_mul_rows<float>(gate_up.data_ptr<float>(), out.data_ptr<float>(), rows, inner);
  } else {
    silu_and_mul_rows<c10::BFloat16>(gate_up.data_ptr<c10::BFloat16>(), out.data_ptr<c10::BFloat16>(), rows, inner);
  }
  return out;
}

void rotary_(const at::Tensor& x, const at::Tensor& cos_sin) {
  check_cpu(x, "x");
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1, "x must be [tokens, heads, head_dim] with contiguous heads");
  TORCH_CHECK(cos_sin.is_contiguous() && cos_sin.scalar_type() == x.scalar_type(), "cos_sin: contiguous, x's dtype");
  const int64_t tokens = x.size(0), heads = x.size(1), dim = x.size(2);
  TORCH_CHECK(dim % 2 == 0 && cos_sin.dim() == 2 && cos_sin.size(0) == tokens && cos_sin.size(1) == dim,
              "cos_sin must be [tokens, head_dim], head_dim even");
  if (x.scalar_type() == at::kFloat) {
    rotary_rows<float>(x.data_ptr<float>(), cos_sin.data_ptr<float>(), tokens, heads, dim, x.stride(0), x.stride(1));
  } else {
    rotary_rows<c10::BFloat16>(x.data_ptr<c10::BFloat16>(), cos_sin.data_ptr<c10::BFloat16>(), tokens, heads, dim,
                               x.stride(0), x.stride(1));
  }
}

// Greedy sampling: the index of each row's first maximum (as torch's max(dim).indices; a NaN
// counts as the maximum, the first one wins). Rows are split over threads when there are enough.
namespace {

template <typename T>
int64_t first_nan(const T* x, int64_t n) {
  for (int64_t j = 0; j < n; ++j) {
    if (std::isnan(static_cast<float>(x[j]))) return j;
  }
  return -1;
}

// One pass: per lane the largest value and where it was first seen (a strictly larger value
// replaces it), then the largest lane value and the lowest index holding it.
template <typename T>
int64_t argmax_row(const T* x, int64_t n) {
  float best = -std::numeric_limits<float>::infinity();
  int64_t best_index = 0;
  int64_t i = 0;
#ifdef __AVX512F__
  if (n >= 16 && n < (int64_t(1) << 31)) {
    __m512 vbest = vload(x);
    __m512i vindex = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    __m512i lane_index = vindex;
    __mmask16 nan_lanes = _mm512_cmp_ps_mask(vbest, vbest, _CMP_UNORD_Q);
    for (i = 16; i + 16 <= n; i += 16) {
      lane_index = _mm512_add_epi32(lane_index, _mm512_set1_epi32(16));
      const __m512 v = vload(x + i);
      nan_lanes |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
      const __mmask16 larger = _mm512_cmp_ps_mask(v, vbest, _CMP_GT_OQ);
      vbest = _mm512_mask_blend_ps(larger, vbest, v);
      vindex = _mm512_mask_blend_epi32(larger, vindex, lane_index);
    }
    if (nan_lanes) return first_nan(x, n);
    best = _mm512_reduce_max_ps(vbest);
    const __mmask16 at_best = _mm512_cmp_ps_mask(vbest, _mm512_set1_ps(best), _CMP_EQ_OQ);
    best_index = _mm512_mask_reduce_min_epi32(at_best, vindex);
  }
#endif
  for (; i < n; ++i) {
    const float v = static_cast<float>(x[i]);
    if (std::isnan(v)) return first_nan(x, n);
    if (v > best || (i == 0)) {
      best = v;
      best_index = i;
    }
  }
  return best_index;
}

}  // namespace

at::Tensor argmax_rows(const at::Tensor& logits) {
  check_cpu(logits, "logits");
  TORCH_CHECK(logits.dim() == 2 && logits.stride(1) == 1 && logits.size(1) > 0,
              "logits must be [rows, n > 0] with contiguous rows");
  const int64_t rows = logits.size(0), n = logits.size(1), stride = logits.stride(0);
  at::Tensor out = at::empty({rows}, logits.options().dtype(at::kLong));
  int64_t* dst = out.data_ptr<int64_t>();
  at::parallel_for(0, rows, row_grain(n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      dst[r] = logits.scalar_type() == at::kFloat ? argmax_row(logits.data_ptr<float>() + r * stride, n)
                                                  : argmax_row(logits.data_ptr<c10::BFloat16>() + r * stride, n);
    }
  });
  return out;
}

namespace {

// On the raw bits (U: uint32_t for float, uint16_t for bfloat16), so that no conversion runs
// per element.
template <typename U>
void mask_row(U* row, const int32_t* words, int64_t n, U neg_inf) {
  for (int64_t w = 0; w * 32 < n; ++w) {
    const uint32_t bits = static_cast<uint32_t>(words[w]);
    if (bits == 0xFFFFFFFFu) continue;  // every token of this word allowed
    const int64_t base = w * 32, count = std::min<int64_t>(32, n - base);
    for (int64_t b = 0; b < count; ++b) {
      if (!((bits >> b) & 1u)) row[base + b] = neg_inf;
    }
  }
}

}  // namespace

// logits[rows[i], t] = -inf where bit t of bitmask[i] is 0 (token t not allowed next);
// bitmask [R, ceil(V / 32)] int32, bit b of word w is token 32 w + b.
void apply_token_bitmask_(at::Tensor& logits, const at::Tensor& bitmask, const at::Tensor& rows) {
  check_cpu(logits, "logits");
  TORCH_CHECK(logits.dim() == 2 && logits.stride(1) == 1, "logits must be [N, V] with contiguous rows");
  TORCH_CHECK(bitmask.dim() == 2 && bitmask.is_contiguous() && bitmask.scalar_type() == at::kInt,
              "bitmask must be a contiguous [R, words] int32 tensor");
  TORCH_CHECK(rows.dim() == 1 && rows.scalar_type() == at::kLong && rows.size(0) == bitmask.size(0),
              "rows must be int64 [R]");
  const int64_t n = logits.size(1), stride = logits.stride(0), words = bitmask.size(1);
  TORCH_CHECK(words * 32 >= n, "bitmask has fewer bits than the logits have columns");
  const int64_t* row_ids = rows.data_ptr<int64_t>();
  for (int64_t i = 0; i < rows.size(0); ++i) {
    TORCH_CHECK(row_ids[i] >= 0 && row_ids[i] < logits.size(0), "row index out of range");
  }
  at::parallel_for(0, rows.size(0), row_grain(n), [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int32_t* w = bitmask.data_ptr<int32_t>() + i * words;
      if (logits.scalar_type() == at::kFloat) {
        mask_row(reinterpret_cast<uint32_t*>(logits.data_ptr<float>()) + row_ids[i] * stride, w, n,
                 static_cast<uint32_t>(0xFF800000u));
      } else {
        mask_row(reinterpret_cast<uint16_t*>(logits.data_ptr<c10::BFloat16>()) + row_ids[i] * stride, w, n,
                 static_cast<uint16_t>(0xFF80u));
      }
    }
  });
}

// --- A decode step's decoder layers in one call (Llama family). ---------------------------------
//
// The same operations, in the same order and on the same kernels, as LlamaDecoderLayer.forward
// over a batch of single-token sequences, without a Python call per operator: the per-layer
// Python and module dispatch of 30 layers cost a batch-1 step more time than its attention.
// LlamaModel._fused_decode (llama.py) decides when it applies; the checks here guard the memory
// the kernels touch.
namespace {

constexpr int64_t kParamsPerLayer = 11;  // see decode_layers

at::Tensor fused_linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias, bool packed) {
  std::optional<at::Tensor> b;
  if (bias.numel()) b = bias;
  if (!packed) return at::linear(x, weight, b);
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("mkldnn::_linear_pointwise", "")
                       .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
                                         c10::string_view, c10::List<std::optional<at::Scalar>>,
                                         std::optional<c10::string_view>)>();
  return op.call(x, weight, b, "none", c10::List<std::optional<at::Scalar>>(), c10::string_view(""));
}

}  // namespace

// hidden [B, hidden] (the step's token embeddings, used as scratch) -> the final norm's output
// [B, hidden]. Per layer, kParamsPerLayer tensors in ``params`` (an empty tensor: absent):
// input norm, qkv weight, qkv bias, qk-norm weight [H + KVH, D], o weight, o bias,
// post-attention norm, gate_up weight, gate_up bias, down weight, down bias. Weights are oneDNN
// packed where ``packed``, plain otherwise; every matmul runs on ``linear_rows`` rows (the batch padded).
// caches[l] [2, blocks, block_size, KVH, D]; slot_mappings / block_tables per KV group;
// layer_to_group and sliding_windows (0: none) per layer; context_lens [B] int64.
at::Tensor decode_layers(at::Tensor hidden, const at::Tensor& cos_sin, const std::vector<at::Tensor>& params,
                         const std::vector<at::Tensor>& caches, const std::vector<at::Tensor>& slot_mappings,
                         const std::vector<at::Tensor>& block_tables, const std::vector<int64_t>& layer_to_group,
                         const std::vector<int64_t>& sliding_windows, const at::Tensor& context_lens,
                         const at::Tensor& final_norm, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                         double scale, double eps, bool packed, int64_t linear_rows) {
  check_cpu(hidden, "hidden");
  const int64_t num_layers = static_cast<int64_t>(caches.size());
  TORCH_CHECK(num_layers > 0 && static_cast<int64_t>(params.size()) == num_layers * kParamsPerLayer &&
                  static_cast<int64_t>(layer_to_group.size()) == num_layers &&
                  static_cast<int64_t>(sliding_windows.size()) == num_layers,
              "per-layer arguments do not match the layer count");
  TORCH_CHECK(hidden.dim() == 2 && hidden.is_contiguous(), "hidden must be contiguous [B, hidden]");
  const int64_t batch = hidden.size(0), rows = linear_rows;
  TORCH_CHECK(rows >= batch, "linear_rows below the batch");
  const int64_t qk_width = (num_heads + num_kv_heads) * head_dim;
  // Every activation has the matmuls' row count from the start (rows past the batch: zeros, and
  // whatever finite values the layers make of them; no row's output depends on another's), so
  // no matmul pads its input; attention writes the batch's rows of a buffer zeroed once.
  if (rows != batch) hidden = at::constant_pad_nd(hidden, {0, 0, 0, rows - batch});
  at::Tensor attn = at::zeros({rows, num_heads, head_dim}, hidden.options());
  at::Tensor attn_rows = attn.narrow(0, 0, batch);
  at::Tensor residual;
  for (int64_t layer = 0; layer < num_layers; ++layer) {
    const at::Tensor* p = params.data() + layer * kParamsPerLayer;
    if (layer == 0) {
      residual = hidden;
      hidden = rms_norm(hidden, p[0], eps);
    } else {
      add_rms_norm_(hidden, residual, p[0], eps);
    }
    const at::Tensor qkv = fused_linear(hidden, p[1], p[2], packed);
    TORCH_CHECK(qkv.size(1) == qk_width + num_kv_heads * head_dim, "qkv width does not match the heads");
    at::Tensor qk = qkv.narrow(0, 0, batch).narrow(1, 0, qk_width).view({batch, num_heads + num_kv_heads, head_dim});
    const at::Tensor v =
        qkv.narrow(0, 0, batch).narrow(1, qk_width, num_kv_heads * head_dim).view({batch, num_kv_heads, head_dim});
    if (p[3].numel()) qk = at::rms_norm(qk, {head_dim}, std::nullopt, eps).mul_(p[3]);
    rotary_(qk, cos_sin);
    const at::Tensor& cache = caches[layer];
    TORCH_CHECK(cache.dim() == 5 && cache.size(0) == 2 && cache.scalar_type() == hidden.scalar_type(),
                "cache must be [2, blocks, block_size, KVH, D] in the model's dtype");
    const int64_t group = layer_to_group[layer];
    TORCH_CHECK(group >= 0 && group < static_cast<int64_t>(slot_mappings.size()) &&
                    group < static_cast<int64_t>(block_tables.size()),
                "layer_to_group names a missing group");
    const at::Tensor& slots = slot_mappings[group];
    cache.select(0, 0).view({-1, num_kv_heads, head_dim}).index_copy_(0, slots, qk.narrow(1, num_heads, num_kv_heads));
    cache.select(0, 1).view({-1, num_kv_heads, head_dim}).index_copy_(0, slots, v);
    paged_decode_attention_into(qk.narrow(1, 0, num_heads), cache, block_tables[group], context_lens, attn_rows,
                                scale, sliding_windows[layer]);
    at::Tensor out = fused_linear(attn.view({rows, num_heads * head_dim}), p[4], p[5], packed);
    add_rms_norm_(out, residual, p[6], eps);
    const at::Tensor gate_up = fused_linear(out, p[7], p[8], packed);
    hidden = fused_linear(silu_and_mul(gate_up), p[9], p[10], packed);
  }
  add_rms_norm_(hidden, residual, final_norm, eps);
  return rows == batch ? hidden : hidden.narrow(0, 0, batch);
}
