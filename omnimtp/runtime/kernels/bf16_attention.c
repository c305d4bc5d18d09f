/* Attention of many query positions a row (a prompt's forward), grouped-query, with bf16 products and fp32 sums,
 * on a CPU with AVX512_BF16 (`vdpbf16ps`: 32 bf16 products summed in pairs into 16 fp32 lanes an instruction).
 *
 * Why: a prefill of several hundred positions spends much of its non-GEMM time in attention, and torch's CPU flash
 * attention runs in fp32 FMAs (about 120-140 GFLOP/s causal on 2 threads of a 2-core AMD EPYC; its bf16 path is no
 * faster), while the CPU's bf16 dot product does twice the work an instruction.
 *
 * How (FlashAttention's tiling, on a CPU): each (row, key head) has its keys and values converted to bf16 once, in
 * blocks of KEY_BLOCK positions, into the layouts the dot product reads whole registers of:
 *   keys:   [S / 16][D / 2][16 keys][2] (a register: 16 keys' pair p of inputs),
 *   values: [S / 2][D][2]              (a register: 16 columns of a pair of positions).
 * A work item is (row, key head, block of positions): its G query heads at each position, M = positions * G query
 * vectors sharing each key and value load. Per block of keys: scores [M, KEY_BLOCK] = Q K^T (register tiles of 4
 * queries x 64 keys), masked past each query's visible keys, an online softmax per query in fp32 (running maximum,
 * sum, and the output rescaled when the maximum grows), the probabilities rounded to bf16, then out [M, D] += P V
 * (register tiles of 4 queries x 64 columns, or x 16). The output is divided by the sum of the rounded
 * probabilities last.
 *
 * Masks: each query sees keys 0..n-1 (n its own count: a causal mask, a full one, or a causal one past a cache's
 * earlier positions). Key blocks past every query's count in a work item are skipped, and the values past it in
 * the last block read as zeros: a row's keys and values past all its counts (a shorter row's padding) are never
 * used, whatever they hold.
 *
 * Numerics: queries, keys, values and probabilities rounded to bf16 (`vcvtneps2bf16`: to nearest, ties to even,
 * subnormal inputs as zeros), every product exact and every sum in fp32; exp within 1 ulp of expf. A query's
 * output depends only on its own query vector, count and the keys and values it sees, not on the other queries or
 * rows: the key blocks start at key 0 whatever the work item, each score is one query's dot product, and a key past
 * the count gets probability exactly 0 (a block with no visible key leaves the query's maximum, sum and output as
 * they were). So a position's output is bit for bit the same alone (its visible keys only) as among the others of a
 * prompt, and in any batch.
 */
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define BF16_ISA "avx512f,avx512bw,avx512vl,avx512dq,avx512bf16"
#define BF16_TARGET __attribute__((target(BF16_ISA)))
#define INLINE_BF16 static inline __attribute__((always_inline, target(BF16_ISA)))

#define KEY_BLOCK 64     /* keys per block: 4 registers of scores a query */
#define QUERY_VECTORS 32 /* query vectors (positions x G) a work item, at most */
#define MAX_D 256
#define TILE 4           /* query vectors a register tile */

int omnimtp_bf16_attention_supported(void) {
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
         __builtin_cpu_supports("avx512bf16");
}

/* 16 fp32 → 16 bf16, to nearest, ties to even. */
INLINE_BF16 __m256i to_bf16(__m512 x) { return (__m256i)_mm512_cvtneps_pbh(x); }

/* exp(x) for x <= 0, 16 lanes (Cephes' expf: x = n ln 2 + r, |r| <= ln 2 / 2, a degree-6 polynomial in r, times
 * 2^n; within 1 ulp of expf over [-87, 0], exactly 1 at 0). Below -87 it gives exp(-87). */
INLINE_BF16 __m512 exp_nonpositive16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_fmadd_ps(x, _mm512_set1_ps(1.44269504088896341f), _mm512_set1_ps(0.5f)),
                                        _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fmadd_ps(n, _mm512_set1_ps(2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  return _mm512_scalef_ps(p, n); /* p * 2^n, exactly */
}

/* Keys start..start+15 of one head (rows `stride` floats apart; those at or past S are zeros) into the packed
 * group [D / 2][16][2]. */
BF16_TARGET static void pack_key_group(const float* k, int64_t stride, int64_t start, int64_t S, int64_t D,
                                       uint32_t* group) {
  uint32_t rows[16][MAX_D / 2];
  for (int i = 0; i < 16; ++i) {
    if (start + i >= S) {
      memset(rows[i], 0, sizeof(uint32_t) * (size_t)(D / 2));
      continue;
    }
    const float* row = k + (start + i) * stride;
    for (int64_t d = 0; d < D; d += 16)
      _mm256_storeu_si256((__m256i*)&rows[i][d / 2], to_bf16(_mm512_loadu_ps(row + d)));
  }
  for (int64_t p = 0; p < D / 2; ++p)
    for (int i = 0; i < 16; ++i) group[p * 16 + i] = rows[i][p];
}

/* Values at positions 2 * pair and 2 * pair + 1 of one head (zeros at or past S) into [D][2]. */
BF16_TARGET static void pack_value_pair(const float* v, int64_t stride, int64_t pair, int64_t S, int64_t D,
                                        uint16_t* out) {
  const __m512i interleave = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7,
                                              22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  const int64_t first = 2 * pair;
  for (int64_t d = 0; d < D; d += 16) {
    const __m256i a = first < S ? to_bf16(_mm512_loadu_ps(v + first * stride + d)) : _mm256_setzero_si256();
    const __m256i b = first + 1 < S ? to_bf16(_mm512_loadu_ps(v + (first + 1) * stride + d)) : _mm256_setzero_si256();
    const __m512i both = _mm512_inserti64x4(_mm512_castsi256_si512(a), b, 1);
    _mm512_storeu_si512(out + 2 * d, _mm512_permutexvar_epi16(interleave, both));
  }
}

/* scores [R][KEY_BLOCK] (R query vectors from q, D / 2 pairs each, qstride pairs apart) = their dot products with
 * the key block's 4 groups (`keys`: 4 packed groups, D / 2 * 16 pairs apart). */
#define QK_TILE(R)                                                                                                 \
  BF16_TARGET static void qk_tile_##R(const uint32_t* q, int64_t qstride, const uint32_t* keys, int64_t D,        \
                                      float* scores) {                                                            \
    __m512 acc[R][4];                                                                                               \
    for (int m = 0; m < R; ++m)                                                                                     \
      for (int j = 0; j < 4; ++j) acc[m][j] = _mm512_setzero_ps();                                                  \
    const int64_t group = D / 2 * 16;                                                                               \
    for (int64_t p = 0; p < D / 2; ++p) {                                                                           \
      __m512bh k[4];                                                                                                \
      for (int j = 0; j < 4; ++j) k[j] = (__m512bh)_mm512_loadu_si512(keys + j * group + p * 16);                  \
      for (int m = 0; m < R; ++m) {                                                                                 \
        const __m512bh a = (__m512bh)_mm512_set1_epi32((int)q[m * qstride + p]);                                    \
        for (int j = 0; j < 4; ++j) acc[m][j] = _mm512_dpbf16_ps(acc[m][j], a, k[j]);                               \
      }                                                                                                             \
    }                                                                                                               \
    for (int m = 0; m < R; ++m)                                                                                     \
      for (int j = 0; j < 4; ++j) _mm512_storeu_ps(scores + m * KEY_BLOCK + 16 * j, acc[m][j]);                     \
  }
QK_TILE(4)
QK_TILE(1)

/* out[R][16 * C columns from c0] += probs [R][KEY_BLOCK] (bf16 pairs, KEY_BLOCK / 2 a query) @ the value block
 * (`values`: KEY_BLOCK / 2 pairs of [D][2]). */
#define PV_TILE(R, C)                                                                                              \
  BF16_TARGET static void pv_tile_##R##_##C(const uint32_t* probs, const uint16_t* values, int64_t D, int64_t c0, \
                                            float* out) {                                                         \
    __m512 acc[R][C];                                                                                               \
    for (int m = 0; m < R; ++m)                                                                                     \
      for (int j = 0; j < C; ++j) acc[m][j] = _mm512_loadu_ps(out + m * D + c0 + 16 * j);                          \
    for (int64_t kp = 0; kp < KEY_BLOCK / 2; ++kp) {                                                                \
      __m512bh v[C];                                                                                                \
      for (int j = 0; j < C; ++j) v[j] = (__m512bh)_mm512_loadu_si512(values + kp * 2 * D + 2 * (c0 + 16 * j));    \
      for (int m = 0; m < R; ++m) {                                                                                 \
        const __m512bh a = (__m512bh)_mm512_set1_epi32((int)probs[m * (KEY_BLOCK / 2) + kp]);                       \
        for (int j = 0; j < C; ++j) acc[m][j] = _mm512_dpbf16_ps(acc[m][j], a, v[j]);                               \
      }                                                                                                             \
    }                                                                                                               \
    for (int m = 0; m < R; ++m)                                                                                     \
      for (int j = 0; j < C; ++j) _mm512_storeu_ps(out + m * D + c0 + 16 * j, acc[m][j]);                           \
  }
PV_TILE(4, 4)
PV_TILE(1, 4)
PV_TILE(4, 1)
PV_TILE(1, 1)

/* One query's scores of a key block (s: KEY_BLOCK fp32 dot products, the first `visible` >= 1 of them seen) into
 * its online softmax: its running maximum `top`, the lanes of its sum of probabilities `sum` and its output row
 * `acc` (D floats) rescaled by exp(old - new maximum) when the maximum grows; the block's probabilities exp(score *
 * scale - maximum), 0 past `visible`, rounded to bf16 into `probs` (KEY_BLOCK / 2 pairs) and summed as rounded. */
INLINE_BF16 void softmax_block(const float* s, int64_t visible, float scale, float* top, __m512* sum,
                               uint32_t* probs, float* acc, int64_t D) {
  const __m512 minus_inf = _mm512_set1_ps(-INFINITY);
  __m512 x[4];
  __mmask16 seen[4];
  for (int j = 0; j < 4; ++j) {
    seen[j] = (__mmask16)(visible >= 16 * (j + 1) ? 0xFFFF : visible <= 16 * j ? 0 : (1u << (visible - 16 * j)) - 1u);
    x[j] = _mm512_mask_mul_ps(minus_inf, seen[j], _mm512_loadu_ps(s + 16 * j), _mm512_set1_ps(scale));
  }
  const __m512 block_top = _mm512_max_ps(_mm512_max_ps(x[0], x[1]), _mm512_max_ps(x[2], x[3]));
  const float new_top = fmaxf(*top, _mm512_reduce_max_ps(block_top));
  if (new_top != *top) { /* the maximum grew (always at a query's first block): rescale what it summed so far */
    const __m512 factor = exp_nonpositive16(_mm512_set1_ps(*top - new_top));
    *sum = _mm512_mul_ps(*sum, factor);
    for (int64_t d = 0; d < D; d += 16) _mm512_storeu_ps(acc + d, _mm512_mul_ps(_mm512_loadu_ps(acc + d), factor));
    *top = new_top;
  }
  const __m512 shift = _mm512_set1_ps(new_top);
  for (int j = 0; j < 4; ++j) {
    const __m256i rounded = to_bf16(_mm512_maskz_mov_ps(seen[j], exp_nonpositive16(_mm512_sub_ps(x[j], shift))));
    _mm256_storeu_si256((__m256i*)(probs + 8 * j), rounded);
    *sum = _mm512_add_ps(*sum, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(rounded), 16)));
  }
}

/* One work item: M query vectors (qb: bf16 pairs [M][D / 2]; counts: each one's visible keys) over the packed keys
 * and values of their head → out rows (fp32 [M][D], written through `rows`: query vector m's output address). */
BF16_TARGET static void attend_block(const uint32_t* qb, const int64_t* counts, int64_t M, const uint32_t* keys,
                                     const uint16_t* values, int64_t D, float scale, float* const* rows) {
  float scores[QUERY_VECTORS * KEY_BLOCK], acc[QUERY_VECTORS * MAX_D];
  uint32_t probs[QUERY_VECTORS * KEY_BLOCK / 2];
  uint16_t tail[KEY_BLOCK * MAX_D];
  float top[QUERY_VECTORS];
  __m512 sum[QUERY_VECTORS];
  int64_t most = 0;
  for (int64_t m = 0; m < M; ++m) {
    top[m] = -INFINITY;
    sum[m] = _mm512_setzero_ps();
    most = counts[m] > most ? counts[m] : most;
  }
  memset(acc, 0, sizeof(float) * (size_t)(M * D));
  const int64_t key_group = D / 2 * 16;
  for (int64_t start = 0; start < most; start += KEY_BLOCK) {
    const uint32_t* block_keys = keys + start / 16 * key_group;
    int64_t m = 0;
    for (; m + TILE <= M; m += TILE) qk_tile_4(qb + m * (D / 2), D / 2, block_keys, D, scores + m * KEY_BLOCK);
    for (; m < M; ++m) qk_tile_1(qb + m * (D / 2), D / 2, block_keys, D, scores + m * KEY_BLOCK);
    for (m = 0; m < M; ++m) {
      const int64_t visible = counts[m] - start; /* keys of this block the query sees: the first `visible` */
      if (visible <= 0) {
        memset(probs + m * (KEY_BLOCK / 2), 0, sizeof(uint32_t) * (KEY_BLOCK / 2));
        continue;
      }
      softmax_block(scores + m * KEY_BLOCK, visible, scale, top + m, sum + m, probs + m * (KEY_BLOCK / 2),
                    acc + m * D, D);
    }
    const uint16_t* block_values = values + start * D;
    if (start + KEY_BLOCK > most) { /* the last block: positions past every count here read as zeros */
      const int64_t kept = most - start, pairs = (kept + 1) / 2; /* positions, pairs holding them */
      memcpy(tail, block_values, sizeof(uint16_t) * (size_t)(pairs * 2 * D));
      memset(tail + pairs * 2 * D, 0, sizeof(uint16_t) * (size_t)((KEY_BLOCK / 2 - pairs) * 2 * D));
      for (int64_t d = 0; kept % 2 && d < D; ++d) tail[(pairs - 1) * 2 * D + 2 * d + 1] = 0;
      block_values = tail;
    }
    int64_t c0 = 0;
    for (; c0 + 64 <= D; c0 += 64) {
      for (m = 0; m + TILE <= M; m += TILE) pv_tile_4_4(probs + m * (KEY_BLOCK / 2), block_values, D, c0, acc + m * D);
      for (; m < M; ++m) pv_tile_1_4(probs + m * (KEY_BLOCK / 2), block_values, D, c0, acc + m * D);
    }
    for (; c0 < D; c0 += 16) {
      for (m = 0; m + TILE <= M; m += TILE) pv_tile_4_1(probs + m * (KEY_BLOCK / 2), block_values, D, c0, acc + m * D);
      for (; m < M; ++m) pv_tile_1_1(probs + m * (KEY_BLOCK / 2), block_values, D, c0, acc + m * D);
    }
  }
  for (int64_t m = 0; m < M; ++m) {
    const __m512 inverse = _mm512_set1_ps(1.0f / _mm512_reduce_add_ps(sum[m]));
    for (int64_t d = 0; d < D; d += 16)
      _mm512_storeu_ps(rows[m] + d, _mm512_mul_ps(_mm512_loadu_ps(acc + m * D + d), inverse));
  }
}

/* Grouped-query attention of T query positions a row, fp32 in and out: query head j reads key head j / G
 * (G = Nq / Nkv). q: position t of row r at q + r * q_batch_stride + t * q_pos_stride, its Nq heads D apart;
 * keys: row r's head h's position s at k + r * k_batch_stride + h * k_head_stride + s * k_row_stride (values
 * likewise; strides in floats, each row of D contiguous); counts [R or 1][T] (count_row_stride 0 shares one row):
 * the query at (r, t) sees keys 0..counts-1, 1 <= counts <= S; out [R, T, Nq, D] contiguous. Returns 0, -1 when
 * out of memory, -2 for D not a multiple of 16 in 16..256, G above QUERY_VECTORS or a count out of range, -3
 * without AVX512_BF16. */
BF16_TARGET int omnimtp_bf16_attention(const float* q, const float* k, const float* v, const int64_t* counts,
                                       float* out, int64_t R, int64_t T, int64_t Nq, int64_t Nkv, int64_t S,
                                       int64_t D, int64_t q_batch_stride, int64_t q_pos_stride,
                                       int64_t k_batch_stride, int64_t k_head_stride, int64_t k_row_stride,
                                       int64_t v_batch_stride, int64_t v_head_stride, int64_t v_row_stride,
                                       int64_t count_row_stride, float scale, int num_threads) {
  if (!omnimtp_bf16_attention_supported()) return -3;
  if (D % 16 || D < 16 || D > MAX_D || Nkv < 1 || Nq % Nkv || Nq / Nkv > QUERY_VECTORS || S < 1) return -2;
  for (int64_t r = 0; r < R; ++r)
    for (int64_t t = 0; t < T; ++t) {
      const int64_t n = counts[r * count_row_stride + t];
      if (n < 1 || n > S) return -2;
    }
  const int64_t G = Nq / Nkv, positions = QUERY_VECTORS / G, blocks = (S + KEY_BLOCK - 1) / KEY_BLOCK;
  const int64_t padded = blocks * KEY_BLOCK, heads = R * Nkv;
  const int64_t per_head = padded * D; /* bf16 elements of one head's keys (and of its values) */
  uint16_t* packed = (uint16_t*)malloc(sizeof(uint16_t) * (size_t)(2 * heads * per_head));
  if (packed == NULL) return -1;
  const int64_t position_blocks = (T + positions - 1) / positions, items = heads * position_blocks;
  const int64_t groups = padded / 16;
  const int threads = num_threads > 1 ? num_threads : 1;
#pragma omp parallel num_threads(threads) if (threads > 1)
  {
#pragma omp for schedule(static)
    for (int64_t i = 0; i < heads * groups; ++i) { /* keys and values, 16 positions at a time */
      const int64_t head = i / groups, g = i % groups, r = head / Nkv, h = head % Nkv;
      pack_key_group(k + r * k_batch_stride + h * k_head_stride, k_row_stride, 16 * g, S, D,
                     (uint32_t*)(packed + head * per_head) + g * (D / 2) * 16);
      for (int64_t p = 8 * g; p < 8 * g + 8; ++p)
        pack_value_pair(v + r * v_batch_stride + h * v_head_stride, v_row_stride, p, S, D,
                        packed + (heads + head) * per_head + p * 2 * D);
    }
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < items; ++i) { /* head by head (its keys and values stay in cache), last blocks first */
      const int64_t head = i / position_blocks, block = position_blocks - 1 - i % position_blocks;
      const int64_t r = head / Nkv, h = head % Nkv;
      const int64_t t0 = block * positions, t1 = t0 + positions < T ? t0 + positions : T, M = (t1 - t0) * G;
      uint32_t qb[QUERY_VECTORS * MAX_D / 2];
      int64_t n[QUERY_VECTORS];
      float* rows[QUERY_VECTORS];
      for (int64_t t = t0; t < t1; ++t)
        for (int64_t g = 0; g < G; ++g) {
          const int64_t m = (t - t0) * G + g;
          const float* src = q + r * q_batch_stride + t * q_pos_stride + (h * G + g) * D;
          for (int64_t d = 0; d < D; d += 16)
            _mm256_storeu_si256((__m256i*)(qb + m * (D / 2) + d / 2), to_bf16(_mm512_loadu_ps(src + d)));
          n[m] = counts[r * count_row_stride + t];
          rows[m] = out + ((r * T + t) * Nq + h * G + g) * D;
        }
      attend_block(qb, n, M, (const uint32_t*)(packed + head * per_head), packed + (heads + head) * per_head, D,
                   scale, rows);
    }
  }
  free(packed);
  return 0;
}
