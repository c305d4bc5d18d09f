/* A linear layer over a few rows in bf16 (products of bf16, sums in fp32), on a CPU with AVX512_BF16 (`vdpbf16ps`:
 * 32 bf16 products summed in pairs into 16 fp32 lanes an instruction), reading the weight once for all rows, in the
 * layout torch keeps it in.
 *
 * Why: a bf16 codec's conv stack runs a streamed chunk's few steps as matmuls whose weights (tens of MB) are read
 * from memory for a handful of rows. Several streams decoded together must each get the bits they get alone, so
 * torch's matmul (whose blocking, and so each sum's order, follows the number of rows) ran once a stream, reading
 * every weight once a stream. Here each output element is one dot product in an order fixed by K and the weight's
 * layout alone, so all streams' rows go through one call and the weight is read once.
 *
 * Layouts: out[r, n] = sum_k x[r, k] w(n, k) (+ bias[n]); x rows ldx bf16 apart, each contiguous; w(n, k) at
 * w + n * w_n_stride + k * w_k_stride, one of the two strides 1:
 *   - w_k_stride 1 (an nn.Linear's [N, K], a convolution's [C_out, C_in * k]): a tile of 4 weight rows x up to 6
 *     input rows; lane l of an accumulator sums the products of k = 32 i + 2 l and 32 i + 2 l + 1 over i in
 *     order (vdpbf16ps; the K tail's lanes read zeros), and its 16 lanes are then added by one fixed tree
 *     (`sum4`);
 *   - w_n_stride 1 (a transposed convolution's taps [C_out * k, C_in], a view of its [C_in, C_out, k] weight): 64
 *     columns at a time, their K x 64 weights interleaved in pairs of k into a per-thread panel once, then a tile
 *     of up to 6 input rows x 64 columns; lane n of an accumulator sums the products of k = 2 p and 2 p + 1 over p
 *     in order (an odd K's last pair is (x, 0) x (w, 0)).
 * Either way an element's sum depends only on x's row, the weight's column, K and the layout: not on the number of
 * rows, their tiling, the other rows or the threads (which split the columns, never K). So a row's output is bit
 * for bit the same alone as among any others.
 *
 * Numerics: inputs and weights are bf16 (as given), products exact, sums in fp32 (vdpbf16ps: both products of a
 * pair added to the lane, denormal inputs and outputs flushed to zero, round to nearest even); the bias (fp32) is
 * added to the sum, then the element is stored in fp32 or rounded to bf16 (to nearest, ties to even).
 */
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define BF16_ISA "avx512f,avx512bw,avx512vl,avx512dq,avx512bf16"
#define BF16_TARGET __attribute__((target(BF16_ISA)))
#define INLINE_BF16 static inline __attribute__((always_inline, target(BF16_ISA)))

#define UNROLL _Pragma("GCC unroll 16")
#define DOT_COLUMNS 4   /* weight rows of a tile (layout w_k_stride 1) */
#define DOT_ROWS 6      /* input rows of a tile (layout w_k_stride 1) */
#define PANEL 64        /* columns of a tile (layout w_n_stride 1): 4 registers */
#define PANEL_ROWS 6    /* input rows of a tile (layout w_n_stride 1) */

int omnimtp_bf16_rows_linear_supported(void) {
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
         __builtin_cpu_supports("avx512bf16");
}

/* fp32 → bf16 bits, to nearest, ties to even (what torch's conversion does; no NaN reaches here from finite
 * inputs, and a NaN stays a NaN). */
static inline uint16_t bf16_bits(float value) {
  uint32_t bits;
  memcpy(&bits, &value, sizeof bits);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits >> 16) | 0x40);
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return (uint16_t)(bits >> 16);
}

static inline void store(void* out, int64_t index, float value, int out_bf16) {
  if (out_bf16)
    ((uint16_t*)out)[index] = bf16_bits(value);
  else
    ((float*)out)[index] = value;
}

/* The sums of 4 accumulators' 16 lanes each, by one fixed tree: (lanes l and l + 8) first, then l and l + 4, then
 * pairs, then the last two. */
INLINE_BF16 void sum4(const __m512* acc, float* sums) {
  const __m512 ab = _mm512_add_ps(_mm512_shuffle_f32x4(acc[0], acc[1], 0x44), _mm512_shuffle_f32x4(acc[0], acc[1], 0xee));
  const __m512 cd = _mm512_add_ps(_mm512_shuffle_f32x4(acc[2], acc[3], 0x44), _mm512_shuffle_f32x4(acc[2], acc[3], 0xee));
  /* 128-bit lane q: the 4 partial sums of accumulator q */
  const __m512 abcd = _mm512_add_ps(_mm512_shuffle_f32x4(ab, cd, 0x88), _mm512_shuffle_f32x4(ab, cd, 0xdd));
  const __m512 pairs = _mm512_add_ps(abcd, _mm512_shuffle_ps(abcd, abcd, _MM_SHUFFLE(2, 3, 0, 1)));
  const __m512 whole = _mm512_add_ps(pairs, _mm512_shuffle_ps(pairs, pairs, _MM_SHUFFLE(1, 0, 3, 2)));
  float lanes[16];
  _mm512_storeu_ps(lanes, whole);
  for (int q = 0; q < 4; ++q) sums[q] = lanes[4 * q];
}

/* Layout w_k_stride 1: columns n0..n0+3 (a column past N reads column N - 1 and is not stored) of R rows from r0. */
#define DOT_TILE(R)                                                                                                \
  BF16_TARGET static void dot_tile_##R(const uint16_t* x, int64_t ldx, int64_t r0, const uint16_t* w,            \
                                       int64_t ldw, int64_t n0, int64_t N, int64_t K, const float* bias,          \
                                       void* out, int64_t ldo, int out_bf16) {                                    \
    __m512 acc[R][DOT_COLUMNS];                                                                                     \
    const uint16_t* wr[DOT_COLUMNS];                                                                                \
    UNROLL for (int j = 0; j < DOT_COLUMNS; ++j) wr[j] = w + (n0 + j < N ? n0 + j : N - 1) * ldw;                         \
    UNROLL for (int i = 0; i < R; ++i)                                                                                     \
      UNROLL for (int j = 0; j < DOT_COLUMNS; ++j) acc[i][j] = _mm512_setzero_ps();                                        \
    const int64_t whole = K - K % 32;                                                                               \
    for (int64_t k = 0; k < whole; k += 32) {                                                                       \
      __m512bh wv[DOT_COLUMNS];                                                                                     \
      UNROLL for (int j = 0; j < DOT_COLUMNS; ++j) {                                                                \
        wv[j] = (__m512bh)_mm512_loadu_si512(wr[j] + k);                                                            \
        _mm_prefetch((const char*)(wr[j] + k + DOT_COLUMNS * ldw), _MM_HINT_T0); /* the next tile's */            \
      }                                                                                                             \
      UNROLL for (int i = 0; i < R; ++i) {                                                                          \
        const __m512bh xv = (__m512bh)_mm512_loadu_si512(x + (r0 + i) * ldx + k);                                  \
        UNROLL for (int j = 0; j < DOT_COLUMNS; ++j) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], xv, wv[j]);           \
      }                                                                                                             \
    }                                                                                                               \
    if (whole < K) { /* the same lanes, the rest of them zeros */                                                   \
      const __mmask32 mask = (__mmask32)((1u << (K - whole)) - 1u);                                                 \
      __m512bh wv[DOT_COLUMNS];                                                                                     \
      UNROLL for (int j = 0; j < DOT_COLUMNS; ++j) wv[j] = (__m512bh)_mm512_maskz_loadu_epi16(mask, wr[j] + whole); \
      UNROLL for (int i = 0; i < R; ++i) {                                                                          \
        const __m512bh xv = (__m512bh)_mm512_maskz_loadu_epi16(mask, x + (r0 + i) * ldx + whole);                 \
        UNROLL for (int j = 0; j < DOT_COLUMNS; ++j) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], xv, wv[j]);           \
      }                                                                                                             \
    }                                                                                                               \
    float sums[R][DOT_COLUMNS]; /* (the accumulators stay in registers only while every index is a constant) */  \
    UNROLL for (int i = 0; i < R; ++i) sum4(acc[i], sums[i]);                                                     \
    UNROLL for (int i = 0; i < R; ++i)                                                                                     \
      for (int j = 0; j < DOT_COLUMNS && n0 + j < N; ++j)                                                           \
        store(out, (r0 + i) * ldo + n0 + j, bias ? sums[i][j] + bias[n0 + j] : sums[i][j], out_bf16);             \
  }
DOT_TILE(1)
DOT_TILE(2)
DOT_TILE(3)
DOT_TILE(4)
DOT_TILE(5)
DOT_TILE(6)

/* Layout w_n_stride 1: columns n0..n0+63 (those past N zeros) of the K x N weight (rows ldw apart) into the panel
 * [ceil(K / 2)][64] of bf16 pairs (k = 2 p, 2 p + 1). */
BF16_TARGET static void pack_panel(const uint16_t* w, int64_t ldw, int64_t n0, int64_t N, int64_t K,
                                   uint32_t* panel) {
  int16_t first_index[32], second_index[32]; /* pairs (a[i], b[i]) of columns 0-15, then 16-31 */
  UNROLL for (int i = 0; i < 16; ++i) {
    first_index[2 * i] = (int16_t)i;
    first_index[2 * i + 1] = (int16_t)(32 + i);
    second_index[2 * i] = (int16_t)(16 + i);
    second_index[2 * i + 1] = (int16_t)(48 + i);
  }
  const __m512i first = _mm512_loadu_si512(first_index), second = _mm512_loadu_si512(second_index);
  for (int64_t p = 0; p < (K + 1) / 2; ++p) {
    const uint16_t* even = w + 2 * p * ldw;
    const uint16_t* odd = even + ldw;
    for (int half = 0; half < 2; ++half) {
      const int64_t c = n0 + 32 * half;
      const int64_t left = N - c;
      const __mmask32 mask = left >= 32 ? (__mmask32)0xffffffffu : left <= 0 ? 0 : (__mmask32)((1u << left) - 1u);
      const __m512i a = _mm512_maskz_loadu_epi16(mask, even + c);
      const __m512i b = 2 * p + 1 < K ? _mm512_maskz_loadu_epi16(mask, odd + c) : _mm512_setzero_si512();
      _mm512_storeu_si512(panel + p * PANEL + 32 * half, _mm512_permutex2var_epi16(a, first, b));
      _mm512_storeu_si512(panel + p * PANEL + 32 * half + 16, _mm512_permutex2var_epi16(a, second, b));
    }
  }
}

/* Input row r's pair p of x (an odd K's last pair (x, 0)) as 32 bits. */
static inline uint32_t x_pair(const uint16_t* row, int64_t p, int64_t K) {
  uint32_t pair = row[2 * p];
  if (2 * p + 1 < K) pair |= (uint32_t)row[2 * p + 1] << 16;
  return pair;
}

#define PANEL_TILE(R)                                                                                              \
  BF16_TARGET static void panel_tile_##R(const uint16_t* x, int64_t ldx, int64_t r0, const uint32_t* panel,      \
                                         int64_t n0, int64_t N, int64_t K, const float* bias, void* out,         \
                                         int64_t ldo, int out_bf16) {                                             \
    __m512 acc[R][4];                                                                                               \
    UNROLL for (int i = 0; i < R; ++i)                                                                                     \
      UNROLL for (int j = 0; j < 4; ++j) acc[i][j] = _mm512_setzero_ps();                                                  \
    const int64_t pairs = (K + 1) / 2;                                                                              \
    for (int64_t p = 0; p < pairs; ++p) {                                                                           \
      __m512bh wv[4];                                                                                               \
      UNROLL for (int j = 0; j < 4; ++j) wv[j] = (__m512bh)_mm512_loadu_si512(panel + p * PANEL + 16 * j);              \
      UNROLL for (int i = 0; i < R; ++i) {                                                                                 \
        const __m512bh xv = (__m512bh)_mm512_set1_epi32((int)x_pair(x + (r0 + i) * ldx, p, K));                  \
        UNROLL for (int j = 0; j < 4; ++j) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], xv, wv[j]);                            \
      }                                                                                                             \
    }                                                                                                               \
    UNROLL for (int i = 0; i < R; ++i)                                                                                     \
      UNROLL for (int j = 0; j < 4; ++j) {                                                                                 \
        float sums[16];                                                                                             \
        _mm512_storeu_ps(sums, acc[i][j]);                                                                          \
        for (int l = 0; l < 16; ++l) {                                                                              \
          const int64_t n = n0 + 16 * j + l;                                                                        \
          if (n >= N) break;                                                                                        \
          store(out, (r0 + i) * ldo + n, bias ? sums[l] + bias[n] : sums[l], out_bf16);                            \
        }                                                                                                           \
      }                                                                                                             \
  }
PANEL_TILE(1)
PANEL_TILE(2)
PANEL_TILE(3)
PANEL_TILE(4)
PANEL_TILE(5)
PANEL_TILE(6)

/* out [M, N] (rows ldo elements apart; fp32, or bf16 where out_bf16) = x [M, K] (bf16, rows ldx apart) times the
 * bf16 weight w(n, k) at w + n * w_n_stride + k * w_k_stride (+ bias [N] fp32, or none where NULL), see above.
 * Returns 0, -1 when out of memory, -2 for a layout with neither stride 1 or a size below 1, -3 without
 * AVX512_BF16. */
BF16_TARGET int omnimtp_bf16_rows_linear(const uint16_t* x, int64_t M, int64_t K, int64_t ldx, const uint16_t* w,
                                         int64_t N, int64_t w_n_stride, int64_t w_k_stride, const float* bias,
                                         void* out, int64_t ldo, int out_bf16, int num_threads) {
  if (!omnimtp_bf16_rows_linear_supported()) return -3;
  if (M < 1 || N < 1 || K < 1) return -2;
  const int threads = num_threads > 1 ? num_threads : 1;
  if (w_k_stride == 1) {
    const int64_t tiles = (N + DOT_COLUMNS - 1) / DOT_COLUMNS;
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1 && tiles > 1)
    for (int64_t t = 0; t < tiles; ++t) {
      const int64_t n0 = t * DOT_COLUMNS;
      int64_t r = 0;
      for (; r + DOT_ROWS <= M; r += DOT_ROWS)
        dot_tile_6(x, ldx, r, w, w_n_stride, n0, N, K, bias, out, ldo, out_bf16);
      switch (M - r) {
        case 5: dot_tile_5(x, ldx, r, w, w_n_stride, n0, N, K, bias, out, ldo, out_bf16); break;
        case 4: dot_tile_4(x, ldx, r, w, w_n_stride, n0, N, K, bias, out, ldo, out_bf16); break;
        case 3: dot_tile_3(x, ldx, r, w, w_n_stride, n0, N, K, bias, out, ldo, out_bf16); break;
        case 2: dot_tile_2(x, ldx, r, w, w_n_stride, n0, N, K, bias, out, ldo, out_bf16); break;
        case 1: dot_tile_1(x, ldx, r, w, w_n_stride, n0, N, K, bias, out, ldo, out_bf16); break;
        default: break;
      }
    }
    return 0;
  }
  if (w_n_stride != 1) return -2;
  const int64_t tiles = (N + PANEL - 1) / PANEL;
  int failed = 0;
#pragma omp parallel num_threads(threads) if (threads > 1 && tiles > 1)
  {
    uint32_t* panel = (uint32_t*)aligned_alloc(64, sizeof(uint32_t) * (size_t)(((K + 1) / 2) * PANEL));
    if (panel == NULL) {
#pragma omp atomic write
      failed = 1;
    }
#pragma omp for schedule(static) nowait /* each thread frees its own panel */
    for (int64_t t = 0; t < tiles; ++t) {
      if (panel == NULL) continue;
      const int64_t n0 = t * PANEL;
      pack_panel(w, w_k_stride, n0, N, K, panel);
      int64_t r = 0;
      for (; r + PANEL_ROWS <= M; r += PANEL_ROWS)
        panel_tile_6(x, ldx, r, panel, n0, N, K, bias, out, ldo, out_bf16);
      switch (M - r) {
        case 5: panel_tile_5(x, ldx, r, panel, n0, N, K, bias, out, ldo, out_bf16); break;
        case 4: panel_tile_4(x, ldx, r, panel, n0, N, K, bias, out, ldo, out_bf16); break;
        case 3: panel_tile_3(x, ldx, r, panel, n0, N, K, bias, out, ldo, out_bf16); break;
        case 2: panel_tile_2(x, ldx, r, panel, n0, N, K, bias, out, ldo, out_bf16); break;
        case 1: panel_tile_1(x, ldx, r, panel, n0, N, K, bias, out, ldo, out_bf16); break;
        default: break;
      }
    }
    free(panel);
  }
  return failed ? -1 : 0;
}
