/* fp32 y[M, N] = x[M, K] @ W[N, K]^T for a few rows M, on a CPU with AVX-512F (or AVX2 + FMA: the same
 * scheme on 8-lane registers, built with -mavx2 where AVX-512F is absent).
 *
 * Why: at a batch of a few rows a linear layer is bound by reading its weights from memory, and a
 * general SGEMM (MKL's, packed or not) streams them well below one core's read bandwidth once it does
 * several rows of FMAs per weight: the FMAs fill the out-of-order window and fewer cache-line reads
 * are in flight. Here the weights are packed as [ceil(N/16)][K][16] (panels of 16 output columns,
 * each a sequential stream, zero padded); the kernel walks S panels at once, so S streams in
 * different pages are in flight (the hardware prefetcher follows each), and prefetches each stream
 * a little ahead. Per input k it loads one 64-byte row of each panel and broadcasts x[m, k] for every
 * row m (outer-product form: no horizontal sums). Measured at Qwen3-Omni code-predictor dims on one
 * core: about 1.5-2x MKL's packed SGEMM at 4-16 rows, and as fast as MKL's matrix-vector kernel.
 *
 * Numerics: each output is summed with fused multiply-adds in k order; it equals F.linear up to fp32
 * rounding, not bit for bit. Rows are independent: row m's output does not depend on the other rows
 * or on M.
 */
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define PANEL 16         /* output columns per panel: one AVX-512 register */
#define MAX_STREAMS 8
#define PREFETCH 256     /* floats ahead in each panel's stream (1 KiB: 16 panel rows) */

#ifdef __AVX512F__
/* S panels at once for M rows: S separate sequential streams (the L2 streamer tracks each; one
 * stream alone leaves the memory system under-used), M * S accumulators. xt is x transposed, [K][M];
 * w points at the first of the S panels; masks[s]: the valid columns of panel s. */
#define GROUP_FN(M, S)                                                                                 \
  static void group_##M##_##S(const float* xt, const float* w, float* y, int64_t K, int64_t N,         \
                              int64_t col, const lane_mask* masks) {                                  \
    __m512 acc[S][M];                                                                                 \
    for (int s = 0; s < S; ++s)                                                                       \
      for (int m = 0; m < M; ++m) acc[s][m] = _mm512_setzero_ps();                                    \
    for (int64_t k = 0; k < K; ++k, xt += M) {                                                       \
      __m512 v[S];                                                                                    \
      for (int s = 0; s < S; ++s) {                                                                   \
        const float* ws = w + s * K * PANEL + k * PANEL;                                              \
        _mm_prefetch((const char*)(ws + PREFETCH), _MM_HINT_T0);                                      \
        v[s] = _mm512_loadu_ps(ws);                                                                   \
      }                                                                                               \
      for (int m = 0; m < M; ++m) {                                                                   \
        const __m512 b = _mm512_set1_ps(xt[m]);                                                      \
        for (int s = 0; s < S; ++s) acc[s][m] = _mm512_fmadd_ps(v[s], b, acc[s][m]);                  \
      }                                                                                               \
    }                                                                                                 \
    for (int s = 0; s < S; ++s)                                                                       \
      for (int m = 0; m < M; ++m) _mm512_mask_storeu_ps(y + m * N + col + s * PANEL, masks[s], acc[s][m]); \
  }

/* Streams per group for M rows (measured on a Xeon with AVX-512: 4-8 streams saturate one core's
 * reads; M * S accumulators, a few spilled to L1 at most). Only these S and smaller (the last group
 * of a matrix) are compiled. */
static const int kStreams[17] = {0, 8, 8, 8, 6, 5, 4, 4, 4, 2, 2, 2, 2, 2, 2, 2, 2};
typedef __mmask16 lane_mask;
static lane_mask first_n(int64_t n) { /* mask of the first n (clamped to 0..16) lanes */
  return n <= 0 ? 0 : n >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << n) - 1u);
}

#else /* AVX2 + FMA: each 16-column panel row is two 8-lane registers, so the packing is the same */

static inline void store_panel(float* y, __m256 lo, __m256 hi, int width) {
  if (width >= PANEL) {
    _mm256_storeu_ps(y, lo);
    _mm256_storeu_ps(y + 8, hi);
    return;
  }
  float tmp[PANEL];
  _mm256_storeu_ps(tmp, lo);
  _mm256_storeu_ps(tmp + 8, hi);
  for (int j = 0; j < width; ++j) y[j] = tmp[j];
}

#define GROUP_FN(M, S)                                                                                 \
  static void group_##M##_##S(const float* xt, const float* w, float* y, int64_t K, int64_t N,         \
                              int64_t col, const int* widths) {                                       \
    __m256 lo[S][M], hi[S][M];                                                                        \
    for (int s = 0; s < S; ++s)                                                                       \
      for (int m = 0; m < M; ++m) lo[s][m] = hi[s][m] = _mm256_setzero_ps();                          \
    for (int64_t k = 0; k < K; ++k, xt += M) {                                                       \
      __m256 vl[S], vh[S];                                                                            \
      for (int s = 0; s < S; ++s) {                                                                   \
        const float* ws = w + s * K * PANEL + k * PANEL;                                              \
        _mm_prefetch((const char*)(ws + PREFETCH), _MM_HINT_T0);                                      \
        vl[s] = _mm256_loadu_ps(ws);                                                                  \
        vh[s] = _mm256_loadu_ps(ws + 8);                                                              \
      }                                                                                               \
      for (int m = 0; m < M; ++m) {                                                                   \
        const __m256 b = _mm256_broadcast_ss(xt + m);                                                 \
        for (int s = 0; s < S; ++s) {                                                                 \
          lo[s][m] = _mm256_fmadd_ps(vl[s], b, lo[s][m]);                                             \
          hi[s][m] = _mm256_fmadd_ps(vh[s], b, hi[s][m]);                                             \
        }                                                                                             \
      }                                                                                               \
    }                                                                                                 \
    for (int s = 0; s < S; ++s)                                                                       \
      for (int m = 0; m < M; ++m) store_panel(y + m * N + col + s * PANEL, lo[s][m], hi[s][m], widths[s]); \
  }

/* 16 ymm registers: M * S * 2 accumulators and 2 * S loads fit for these S (measured on a 2-core AMD
 * EPYC with AVX2: 4 rows on one stream run as fast as one row on torch.mv). */
static const int kStreams[17] = {0, 4, 2, 2, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1};
typedef int lane_mask;
static lane_mask first_n(int64_t n) { return n <= 0 ? 0 : n >= PANEL ? PANEL : (int)n; } /* valid columns */
#endif
#define UP_TO_2(M) GROUP_FN(M, 1) GROUP_FN(M, 2)
#define UP_TO_4(M) UP_TO_2(M) GROUP_FN(M, 3) GROUP_FN(M, 4)
#define UP_TO_5(M) UP_TO_4(M) GROUP_FN(M, 5)
#define UP_TO_6(M) UP_TO_5(M) GROUP_FN(M, 6)
#define UP_TO_8(M) UP_TO_6(M) GROUP_FN(M, 7) GROUP_FN(M, 8)
UP_TO_8(1) UP_TO_8(2) UP_TO_8(3) UP_TO_6(4) UP_TO_5(5) UP_TO_4(6) UP_TO_4(7) UP_TO_4(8)
UP_TO_2(9) UP_TO_2(10) UP_TO_2(11) UP_TO_2(12) UP_TO_2(13) UP_TO_2(14) UP_TO_2(15) UP_TO_2(16)

typedef void (*group_fn)(const float*, const float*, float*, int64_t, int64_t, int64_t, const lane_mask*);
#define FNS_2(M) 0, group_##M##_1, group_##M##_2
#define FNS_4(M) FNS_2(M), group_##M##_3, group_##M##_4
#define FNS_5(M) FNS_4(M), group_##M##_5
#define FNS_6(M) FNS_5(M), group_##M##_6
#define FNS_8(M) FNS_6(M), group_##M##_7, group_##M##_8
static const group_fn kGroupFns[17][MAX_STREAMS + 1] = {
    {0},        {FNS_8(1)},  {FNS_8(2)},  {FNS_8(3)},  {FNS_6(4)},  {FNS_5(5)},  {FNS_4(6)},  {FNS_4(7)},  {FNS_4(8)},
    {FNS_2(9)}, {FNS_2(10)}, {FNS_2(11)}, {FNS_2(12)}, {FNS_2(13)}, {FNS_2(14)}, {FNS_2(15)}, {FNS_2(16)},
};

/* A pass runs its rows in tiles of at most `tile_rows` (sizes as even as possible): for each group of
 * panels every tile in turn, so the weights stream from memory once per pass and the later tiles re-read
 * the group's panels from cache. A tile is a compile-time row count (its accumulators live in registers);
 * xt holds each tile's rows transposed, [K][rows of the tile], one tile after the other. */
typedef struct {
  int64_t first_row, rows;
} tile;

static void run_group(const float* xt, const float* packed, float* y, const tile* tiles, int64_t num_tiles,
                      int64_t K, int64_t N, int64_t panels, int64_t streams, int64_t g) {
  const int64_t first = g * streams;
  const int64_t count = panels - first < streams ? panels - first : streams;
  lane_mask masks[MAX_STREAMS];
  for (int64_t s = 0; s < count; ++s) masks[s] = first_n(N - (first + s) * PANEL);
  for (int64_t t = 0; t < num_tiles; ++t)
    kGroupFns[tiles[t].rows][count](xt + tiles[t].first_row * K, packed + first * K * PANEL,
                                    y + tiles[t].first_row * N, K, N, first * PANEL, masks);
}

/* x [M, K] row-major, packed as described above, y [M, N] row-major; any M >= 0. Passes of up to
 * `pass_rows` rows (each streams the weights from memory once), each in tiles of up to `tile_rows`
 * (1..16) rows. Every row sums in k order on its own, so the tiling changes no value. Splits the groups
 * of panels over `num_threads` OpenMP threads. Returns 0, -1 when out of memory, -2 for bad tile sizes. */
int omnimtp_small_batch_linear(const float* x, const float* packed, float* y, int64_t M, int64_t K, int64_t N,
                               int num_threads, int64_t tile_rows, int64_t pass_rows) {
  if (tile_rows < 1 || tile_rows > 16 || pass_rows < tile_rows) return -2;
  const int64_t panels = (N + PANEL - 1) / PANEL;
  const int64_t max_rows = M < pass_rows ? M : pass_rows;
  float* xt = malloc(sizeof(float) * (size_t)(K * max_rows + 1));
  tile* tiles = malloc(sizeof(tile) * (size_t)((max_rows + tile_rows - 1) / tile_rows + 1));
  if (xt == NULL || tiles == NULL) {
    free(xt);
    free(tiles);
    return -1;
  }
  for (int64_t m0 = 0; m0 < M; m0 += pass_rows) {
    const int64_t rows = M - m0 < pass_rows ? M - m0 : pass_rows;
    const int64_t num_tiles = (rows + tile_rows - 1) / tile_rows;
    for (int64_t t = 0, first_row = 0; t < num_tiles; ++t) { /* the first rows % num_tiles tiles get one more */
      tiles[t].first_row = first_row;
      tiles[t].rows = rows / num_tiles + (t < rows % num_tiles);
      first_row += tiles[t].rows;
    }
    for (int64_t t = 0; t < num_tiles; ++t) {
      const int64_t r0 = tiles[t].first_row, rt = tiles[t].rows;
      float* xtile = xt + r0 * K;
      for (int64_t m = 0; m < rt; ++m)
        for (int64_t k = 0; k < K; ++k) xtile[k * rt + m] = x[(m0 + r0 + m) * K + k];
    }
    const int64_t streams = kStreams[tiles[0].rows]; /* the largest tile's: compiled for every smaller one */
    const int64_t groups = (panels + streams - 1) / streams;
    float* ym = y + m0 * N;
    if (num_threads <= 1 || groups == 1) { /* no OpenMP region: it costs about a microsecond */
      for (int64_t g = 0; g < groups; ++g) run_group(xt, packed, ym, tiles, num_tiles, K, N, panels, streams, g);
    } else {
#pragma omp parallel for schedule(static) num_threads(num_threads)
      for (int64_t g = 0; g < groups; ++g) run_group(xt, packed, ym, tiles, num_tiles, K, N, panels, streams, g);
    }
  }
  free(xt);
  free(tiles);
  return 0;
}

/* Weight-only quantized y[M, N] = x[M, K] @ dequant(W)[N, K]^T, activations and sums in fp32. Same panels of
 * 16 output columns as above, stored input by input:
 *   int8: [panels][K][16] int8 with one scale per column: W[n, k] = scale[n] * q[n, k]; the scale is
 *         applied once per output (sum_k x q, then times the scale).
 *   int4: [panels][ceil(K/8)][16] 32-bit words, word (w, c) holding column c's q + 8 (q in -8..7) for inputs
 *         8w..8w+7, input 8w + j in bits 4j..4j+3, so a shift and a mask give 16 columns' weights with no
 *         shuffle; one scale per column and group of `group` inputs: W[n, k] = scale[k / group][n] * q[n, k];
 *         each group's partial sum is scaled into the output.
 * int4 without shifts: nibble j of a word is masked in place (bits 4j..4j+3, so q * 16^j; nibble 7 is first
 * moved to bits 24..27, q * 16^6) and converted to float exactly, and is multiplied by x[m, k] * 16^-e
 * (e = min(j, 6); `xs`, x scaled once per call; exact for |x| > 2^-102): the product is q * x[m, k], bit
 * for bit. The + 8 of the stored nibbles comes off once per group: sum_k x q - 8 sum_k x (`xsum`, the
 * group's inputs summed in k order). Two and-convert-FMA per input instead of shift, mask, subtract,
 * convert and FMA: the int4 kernel is bound by those operations, not by memory.
 * A panel is a few KiB, so pairs of rows (QROWS) re-read it from cache: the weights stream from memory once
 * per call. Each column sums in the same order in both builds (two accumulators for alternate inputs, added
 * at the end (int8), or four for inputs k0 + 4i + p, added per group (int4), then scaled), so they give the
 * same values, and rows are independent, as above. The AVX-512 build runs QSTREAMS panels at once, the AVX2
 * build one (16 ymm registers hold no more accumulators). */
#define QROWS 2
#define QSETS 2 /* int8: accumulator sets for alternate inputs (hiding the FMA latency); an odd K's last input
                 * goes to set 0. The sets are named by constants, so they stay in registers (one row on AVX2
                 * 1.9x as fast as when the loop indexed them at run time and they lived on the stack) */
#define QSETS4 4 /* int4: accumulator sets for inputs k0 + 4i + p, p = 0..3, summed in that order per group */

/* The inputs k0..k0+group-1 of an int4 group: LOAD (statements) loads the word(s) holding input k, then a word
 * of 8 inputs at a time where a whole word lies in the group (the eight written out, input k0 + 4i + p into set p =
 * j % QSETS4: a loop over them, which GCC -O3 did not unroll, kept its sets on the stack and tested j at run time:
 * 1.13x as long on AVX2, one row in cache),
 * else one input (a group that starts or ends inside a word); INT4_INPUT is the build's step for one input.
 * Every accumulator set is named by a constant (the switch), so the compiler keeps the sets in registers: a set
 * indexed at run time made it keep them on the stack, and each FMA chain waited on a store and a load. Four
 * sets: one row on AVX2 1.2x as fast as with two (two rows, whose 16 partial sums then spill, 0.93x). */
#define INT4_GROUP_INPUTS(R, S, ...)                                                                   \
  for (int64_t k = k0; k < k0 + group;) {                                                             \
    __VA_ARGS__                                                                                       \
    if ((k & 7) == 0 && k + 8 <= k0 + group && ((k - k0) & (QSETS4 - 1)) == 0) {                      \
      INT4_INPUT(R, S, k + 0, 0, 0); INT4_INPUT(R, S, k + 1, 1, 1);                                   \
      INT4_INPUT(R, S, k + 2, 2, 2); INT4_INPUT(R, S, k + 3, 3, 3);                                   \
      INT4_INPUT(R, S, k + 4, 0, 4); INT4_INPUT(R, S, k + 5, 1, 5);                                   \
      INT4_INPUT(R, S, k + 6, 2, 6); INT4_INPUT(R, S, k + 7, 3, 7);                                   \
      k += 8;                                                                                         \
    } else {                                                                                          \
      const int j = (int)(k & 7);                                                                     \
      switch ((k - k0) & (QSETS4 - 1)) {                                                              \
        case 0: INT4_INPUT(R, S, k, 0, j); break;                                                     \
        case 1: INT4_INPUT(R, S, k, 1, j); break;                                                     \
        case 2: INT4_INPUT(R, S, k, 2, j); break;                                                     \
        default: INT4_INPUT(R, S, k, 3, j); break;                                                    \
      }                                                                                               \
      k += 1;                                                                                         \
    }                                                                                                 \
  }

#define INT4_NIBBLE_MASK(j) (0xF << (4 * ((j) < 6 ? (j) : 6))) /* where nibble j is read: bits 4e..4e+3 */

#ifdef __AVX512F__
#define QSTREAMS 4

static inline __m512 int8_row(const int8_t* w) { /* 16 int8 weights → 16 floats */
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)w)));
}

static inline __m512 int4_lanes(__m512i words, int j) { /* nibble j of 16 words (q + 8) times 16^min(j, 6) */
  const __m512i w = j == 7 ? _mm512_srli_epi32(words, 4) : words;
  return _mm512_cvtepi32_ps(_mm512_and_si512(w, _mm512_set1_epi32(INT4_NIBBLE_MASK(j))));
}

/* Input kj of every stream into accumulator set p (a constant: the sets stay in registers). */
#define INT8_INPUT(R, S, kj, p)                                                                        \
  do {                                                                                                \
    __m512 v[S];                                                                                      \
    for (int s = 0; s < S; ++s) v[s] = int8_row(w + (s * K + (kj)) * PANEL);                          \
    for (int m = 0; m < R; ++m) {                                                                     \
      const __m512 b = _mm512_set1_ps(x[m * K + (kj)]);                                               \
      for (int s = 0; s < S; ++s) acc[p][s][m] = _mm512_fmadd_ps(v[s], b, acc[p][s][m]);             \
    }                                                                                                 \
  } while (0)

/* R rows (a compile-time count: the accumulators stay in registers) over S consecutive panels (S streams in
 * flight). w, scale, col: the first panel's. */
#define INT8_FN(R, S)                                                                                  \
  static void int8_##R##_##S(const float* x, const int8_t* w, const float* scale, float* y, int64_t K, \
                             int64_t N, int64_t col) {                                                \
    __m512 acc[QSETS][S][R];                                                                          \
    for (int p = 0; p < QSETS; ++p)                                                                   \
      for (int s = 0; s < S; ++s)                                                                     \
        for (int m = 0; m < R; ++m) acc[p][s][m] = _mm512_setzero_ps();                               \
    int64_t k = 0;                                                                                    \
    for (; k + QSETS <= K; k += QSETS) {                                                              \
      for (int s = 0; s < S; ++s) _mm_prefetch((const char*)(w + (s * K + k) * PANEL + 1024), _MM_HINT_T0); \
      for (int p = 0; p < QSETS; ++p) INT8_INPUT(R, S, k + p, p);                                     \
    }                                                                                                 \
    if (k < K) INT8_INPUT(R, S, k, 0); /* an odd K's last input */                                    \
    for (int s = 0; s < S; ++s) {                                                                     \
      const __m512 sc = _mm512_loadu_ps(scale + s * PANEL);                                           \
      const lane_mask mask = first_n(N - col - s * PANEL);                                            \
      for (int m = 0; m < R; ++m) {                                                                   \
        __m512 sum = acc[0][s][m];                                                                    \
        for (int p = 1; p < QSETS; ++p) sum = _mm512_add_ps(sum, acc[p][s][m]);                       \
        _mm512_mask_storeu_ps(y + m * N + col + s * PANEL, mask, _mm512_mul_ps(sum, sc));             \
      }                                                                                               \
    }                                                                                                 \
  }

/* Input kj (nibble j of its word) of every stream's word into accumulator set p: (q + 8) * x[m, kj]. */
#define INT4_INPUT(R, S, kj, p, j)                                                                     \
  do {                                                                                                \
    __m512 v[S];                                                                                      \
    for (int s = 0; s < S; ++s) v[s] = int4_lanes(word[s], j);                                        \
    for (int m = 0; m < R; ++m) {                                                                     \
      const __m512 b = _mm512_set1_ps(xs[m * K + (kj)]);                                              \
      for (int s = 0; s < S; ++s) part[p][s][m] = _mm512_fmadd_ps(v[s], b, part[p][s][m]);            \
    }                                                                                                 \
  } while (0)

/* A group's inputs a word of 8 at a time (the nibble indices constants after unrolling, one load per word and stream)
 * where a whole word lies in it, one input at a time elsewhere (a group that does not start or end on a word). */
#define INT4_FN(R, S)                                                                                  \
  static void int4_##R##_##S(const float* xs, const float* xsum, const int32_t* w, const float* scales, \
                             float* y, int64_t K, int64_t N, int64_t col, int64_t group) {            \
    const int64_t groups = K / group, words = (K + 7) / 8;                                            \
    __m512 acc[S][R];                                                                                 \
    for (int s = 0; s < S; ++s)                                                                       \
      for (int m = 0; m < R; ++m) acc[s][m] = _mm512_setzero_ps();                                    \
    for (int64_t k0 = 0; k0 < K; k0 += group) {                                                       \
      __m512 part[QSETS4][S][R];                                                                      \
      for (int p = 0; p < QSETS4; ++p)                                                                \
        for (int s = 0; s < S; ++s)                                                                   \
          for (int m = 0; m < R; ++m) part[p][s][m] = _mm512_setzero_ps();                            \
      INT4_GROUP_INPUTS(R, S, __m512i word[S];                                                        \
                        for (int s = 0; s < S; ++s) {                                                 \
                          const int32_t* ws = w + (s * words + k / 8) * PANEL;                        \
                          _mm_prefetch((const char*)(ws + 8 * PANEL), _MM_HINT_T0);                   \
                          word[s] = _mm512_loadu_si512((const void*)ws);                              \
                        });                                                                           \
      for (int s = 0; s < S; ++s) {                                                                   \
        const __m512 sc = _mm512_loadu_ps(scales + (s * groups + k0 / group) * PANEL);                \
        for (int m = 0; m < R; ++m) {                                                                 \
          __m512 sum = part[0][s][m];                                                                 \
          for (int p = 1; p < QSETS4; ++p) sum = _mm512_add_ps(sum, part[p][s][m]);                   \
          sum = _mm512_sub_ps(sum, _mm512_set1_ps(8.0f * xsum[m * groups + k0 / group]));             \
          acc[s][m] = _mm512_fmadd_ps(sum, sc, acc[s][m]);                                            \
        }                                                                                             \
      }                                                                                               \
    }                                                                                                 \
    for (int s = 0; s < S; ++s) {                                                                     \
      const lane_mask mask = first_n(N - col - s * PANEL);                                            \
      for (int m = 0; m < R; ++m) _mm512_mask_storeu_ps(y + m * N + col + s * PANEL, mask, acc[s][m]); \
    }                                                                                                 \
  }

INT8_FN(1, 1) INT8_FN(2, 1) INT8_FN(1, 4) INT8_FN(2, 4)
INT4_FN(1, 1) INT4_FN(2, 1) INT4_FN(1, 4) INT4_FN(2, 2) /* two rows over 4 streams would spill (49 zmm) */

#else /* AVX2: each panel row is two 8-lane registers, one panel at a time */
#define QSTREAMS 1

/* 8 int8 weights → 8 floats: the sign extension reads its 8 bytes from memory (one instruction; a 16-byte load
 * and its two halves took a shift and two shuffles more) */
static inline __m256 int8_lanes(const int8_t* w) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)w)));
}

/* Both halves of a panel row (v_lo, v_hi) times input kj of each of R rows of xv, into accumulators lo[m], hi[m]
 * (one set's: lo and hi are that set's arrays of R). */
#define ROWS_FMA(R, xv, kj, v_lo, v_hi, lo, hi)                                                        \
  for (int m = 0; m < R; ++m) {                                                                       \
    const __m256 b = _mm256_broadcast_ss((xv) + m * K + (kj));                                        \
    lo[m] = _mm256_fmadd_ps(v_lo, b, lo[m]);                                                          \
    hi[m] = _mm256_fmadd_ps(v_hi, b, hi[m]);                                                          \
  }

/* Input kj into accumulator set p (a constant: the sets stay in registers). */
#define INT8_INPUT(R, S, kj, p)                                                                        \
  do {                                                                                                \
    const __m256 v_lo = int8_lanes(w + (kj) * PANEL), v_hi = int8_lanes(w + (kj) * PANEL + 8);        \
    ROWS_FMA(R, x, kj, v_lo, v_hi, lo[p], hi[p]);                                                     \
  } while (0)

/* R rows over one panel (S = 1), the same sums as the AVX-512 build on two 8-lane halves. */
#define INT8_FN(R, S)                                                                                  \
  static void int8_##R##_##S(const float* x, const int8_t* w, const float* scale, float* y, int64_t K, \
                             int64_t N, int64_t col) {                                                \
    __m256 lo[QSETS][R], hi[QSETS][R];                                                                \
    for (int p = 0; p < QSETS; ++p)                                                                   \
      for (int m = 0; m < R; ++m) lo[p][m] = hi[p][m] = _mm256_setzero_ps();                          \
    int64_t k = 0;                                                                                    \
    for (; k + QSETS <= K; k += QSETS) {                                                              \
      _mm_prefetch((const char*)(w + k * PANEL + 1024), _MM_HINT_T0);                                 \
      for (int p = 0; p < QSETS; ++p) INT8_INPUT(R, S, k + p, p);                                     \
    }                                                                                                 \
    if (k < K) INT8_INPUT(R, S, k, 0); /* an odd K's last input */                                    \
    const __m256 s_lo = _mm256_loadu_ps(scale), s_hi = _mm256_loadu_ps(scale + 8);                    \
    for (int m = 0; m < R; ++m) {                                                                     \
      __m256 l = lo[0][m], h = hi[0][m];                                                              \
      for (int p = 1; p < QSETS; ++p) l = _mm256_add_ps(l, lo[p][m]), h = _mm256_add_ps(h, hi[p][m]); \
      store_panel(y + m * N + col, _mm256_mul_ps(l, s_lo), _mm256_mul_ps(h, s_hi), first_n(N - col)); \
    }                                                                                                 \
  }

static inline __m256 int4_lanes(__m256i words, int j) { /* nibble j of 8 words (q + 8) times 16^min(j, 6) */
  const __m256i w = j == 7 ? _mm256_srli_epi32(words, 4) : words;
  return _mm256_cvtepi32_ps(_mm256_and_si256(w, _mm256_set1_epi32(INT4_NIBBLE_MASK(j))));
}

#define INT4_INPUT(R, S, kj, p, j)                                                                     \
  do {                                                                                                \
    const __m256 v_lo = int4_lanes(word_lo, j), v_hi = int4_lanes(word_hi, j);                        \
    ROWS_FMA(R, xs, kj, v_lo, v_hi, p_lo[p], p_hi[p]);                                                \
  } while (0)

#define INT4_FN(R, S)                                                                                  \
  static void int4_##R##_##S(const float* xs, const float* xsum, const int32_t* w, const float* scales, \
                             float* y, int64_t K, int64_t N, int64_t col, int64_t group) {            \
    const int64_t groups = K / group;                                                                 \
    __m256 lo[R], hi[R];                                                                              \
    for (int m = 0; m < R; ++m) lo[m] = hi[m] = _mm256_setzero_ps();                                  \
    for (int64_t k0 = 0; k0 < K; k0 += group) {                                                       \
      __m256 p_lo[QSETS4][R], p_hi[QSETS4][R];                                                        \
      for (int p = 0; p < QSETS4; ++p)                                                                \
        for (int m = 0; m < R; ++m) p_lo[p][m] = p_hi[p][m] = _mm256_setzero_ps();                    \
      INT4_GROUP_INPUTS(R, S, const int32_t* ws = w + (k / 8) * PANEL;                                \
                        _mm_prefetch((const char*)(ws + 8 * PANEL), _MM_HINT_T0);                     \
                        const __m256i word_lo = _mm256_loadu_si256((const __m256i*)ws);               \
                        const __m256i word_hi = _mm256_loadu_si256((const __m256i*)(ws + 8)););       \
      const float* s = scales + (k0 / group) * PANEL;                                                 \
      const __m256 s_lo = _mm256_loadu_ps(s), s_hi = _mm256_loadu_ps(s + 8);                          \
      for (int m = 0; m < R; ++m) {                                                                   \
        __m256 l = p_lo[0][m], h = p_hi[0][m];                                                        \
        for (int p = 1; p < QSETS4; ++p) l = _mm256_add_ps(l, p_lo[p][m]), h = _mm256_add_ps(h, p_hi[p][m]); \
        const __m256 bias = _mm256_set1_ps(8.0f * xsum[m * groups + k0 / group]);                    \
        l = _mm256_sub_ps(l, bias), h = _mm256_sub_ps(h, bias);                                       \
        lo[m] = _mm256_fmadd_ps(l, s_lo, lo[m]);                                                      \
        hi[m] = _mm256_fmadd_ps(h, s_hi, hi[m]);                                                      \
      }                                                                                               \
    }                                                                                                 \
    for (int m = 0; m < R; ++m) store_panel(y + m * N + col, lo[m], hi[m], first_n(N - col));         \
  }

INT8_FN(1, 1) INT8_FN(2, 1)
INT4_FN(1, 1) INT4_FN(2, 1)

/* int4 for several rows. INT4_FN keeps a row's four sets of both halves in registers at once (8 accumulators a
 * row: two rows spill) and converts every nibble again for each pair of rows. Here the rows go in tiles of up to
 * QTILE_ROWS and the sets one after the other: for set p, one accumulator per row and half runs over the
 * set's inputs k0 + p, k0 + p + 4, ... (nibbles p and p + 4 of each word: constants, converted once per tile and
 * shared by its rows), and the finished set is added to the row's group sum in memory, in set order. At 4 rows
 * that is 8 independent FMA chains, enough to hide the FMA latency, with the conversions and loads beside them
 * (tiles of 5 or 6 rows spilled accumulators and ran no faster: 1-thread AMD EPYC). The FMAs and additions are
 * INT4_FN's, in its order, so every row gets the same bits as alone. Groups of whole words only (group % 8 == 0):
 * others take INT4_FN. */
#define QTILE_ROWS 4
#define QMANY_ROWS 3 /* from this many rows a call takes this path */

/* Each row's accumulators are variables of their own (a<row>_lo, a<row>_hi): arrays of them, even indexed by
 * constants after unrolling, made GCC store every accumulator to the stack after each FMA. */
#define TILE_ROWS_3(F) F(0) F(1) F(2)
#define TILE_ROWS_4(F) TILE_ROWS_3(F) F(3)
#define TILE_ROW_ZERO(m) a##m##_lo = a##m##_hi = _mm256_setzero_ps();
#define TILE_ROW_FMA(m)                                                                                \
  {                                                                                                   \
    const __m256 x = _mm256_broadcast_ss(xs + m * K + k);                                             \
    a##m##_lo = _mm256_fmadd_ps(v_lo, x, a##m##_lo);                                                  \
    a##m##_hi = _mm256_fmadd_ps(v_hi, x, a##m##_hi);                                                  \
  }
#define TILE_ROW_FIRST_SET(m)                                                                          \
  _mm256_storeu_ps(sums + m * PANEL, a##m##_lo);                                                      \
  _mm256_storeu_ps(sums + m * PANEL + 8, a##m##_hi);
#define TILE_ROW_NEXT_SET(m)                                                                           \
  _mm256_storeu_ps(sums + m * PANEL, _mm256_add_ps(_mm256_loadu_ps(sums + m * PANEL), a##m##_lo));    \
  _mm256_storeu_ps(sums + m * PANEL + 8, _mm256_add_ps(_mm256_loadu_ps(sums + m * PANEL + 8), a##m##_hi));

/* Input k (nibble j of word i) of the tile's rows. */
#define INT4_TILE_INPUT(R, j)                                                                          \
  {                                                                                                   \
    const int64_t k = k0 + 8 * i + (j);                                                               \
    const __m256 v_lo = int4_lanes(_mm256_loadu_si256((const __m256i*)ws), j);                        \
    const __m256 v_hi = int4_lanes(_mm256_loadu_si256((const __m256i*)(ws + 8)), j);                  \
    TILE_ROWS_##R(TILE_ROW_FMA)                                                                       \
  }

/* Set p (a constant) of the group at k0: inputs k0 + p + 4i in order, then into the group sums. */
#define INT4_TILE_SET(R, p, ADD)                                                                       \
  TILE_ROWS_##R(TILE_ROW_ZERO)                                                                        \
  for (int64_t i = 0; i < group / 8; ++i) {                                                           \
    const int32_t* ws = w + (k0 / 8 + i) * PANEL;                                                     \
    INT4_TILE_INPUT(R, p)                                                                             \
    INT4_TILE_INPUT(R, (p) + 4)                                                                       \
  }                                                                                                   \
  TILE_ROWS_##R(ADD)

#define TILE_ROW_DECLARE(m) __m256 a##m##_lo, a##m##_hi;
/* R rows (xs, stride K) over the group at k0 of a panel (words w): the group's sums [R][16], as INT4_FN forms
 * them before the bias and the scales. */
#define INT4_TILE_FN(R)                                                                                \
  static void int4_tile_##R(const float* xs, const int32_t* w, float* sums, int64_t K, int64_t k0,     \
                            int64_t group) {                                                          \
    TILE_ROWS_##R(TILE_ROW_DECLARE)                                                                   \
    INT4_TILE_SET(R, 0, TILE_ROW_FIRST_SET)                                                           \
    INT4_TILE_SET(R, 1, TILE_ROW_NEXT_SET)                                                            \
    INT4_TILE_SET(R, 2, TILE_ROW_NEXT_SET)                                                            \
    INT4_TILE_SET(R, 3, TILE_ROW_NEXT_SET)                                                            \
  }

INT4_TILE_FN(3) INT4_TILE_FN(4)

/* One panel (words w, scales, output columns col..) for all M rows (tiles of 4, at most one of 3). work: M * PANEL
 * floats for the rows' outputs, then QTILE_ROWS * PANEL for a tile's group sums. */
static void int4_panel_rows(const float* xs, const float* xsum, const int32_t* w, const float* scales, float* y,
                            int64_t M, int64_t K, int64_t N, int64_t col, int64_t group, float* work) {
  const int64_t groups = K / group;
  float *acc = work, *sums = work + M * PANEL;
  for (int64_t i = 0; i < M * PANEL; ++i) acc[i] = 0.0f;
  for (int64_t k0 = 0; k0 < K; k0 += group) {
    const __m256 s_lo = _mm256_loadu_ps(scales + (k0 / group) * PANEL);
    const __m256 s_hi = _mm256_loadu_ps(scales + (k0 / group) * PANEL + 8);
    for (int64_t m0 = 0; m0 < M; m0 += QTILE_ROWS) {
      const int64_t r = M - m0 < QTILE_ROWS ? M - m0 : QTILE_ROWS;
      if (r == 4) int4_tile_4(xs + m0 * K, w, sums, K, k0, group);
      else int4_tile_3(xs + m0 * K, w, sums, K, k0, group);
      for (int64_t m = 0; m < r; ++m) { /* INT4_FN's end of a group: less 8 * xsum, times the scales */
        const __m256 bias = _mm256_set1_ps(8.0f * xsum[(m0 + m) * groups + k0 / group]);
        float* a = acc + (m0 + m) * PANEL;
        const __m256 l = _mm256_sub_ps(_mm256_loadu_ps(sums + m * PANEL), bias);
        const __m256 h = _mm256_sub_ps(_mm256_loadu_ps(sums + m * PANEL + 8), bias);
        _mm256_storeu_ps(a, _mm256_fmadd_ps(l, s_lo, _mm256_loadu_ps(a)));
        _mm256_storeu_ps(a + 8, _mm256_fmadd_ps(h, s_hi, _mm256_loadu_ps(a + 8)));
      }
    }
  }
  for (int64_t m = 0; m < M; ++m)
    store_panel(y + m * N + col, _mm256_loadu_ps(acc + m * PANEL), _mm256_loadu_ps(acc + m * PANEL + 8),
                first_n(N - col));
}

/* int8 for several rows, the same way: tiles of up to QTILE_ROWS rows, set p (inputs p, p + 2, ...: INT8_FN's
 * two sets, an odd K's last input in set 0) for all of them, then set 1 added to it, times the scales. */
#define INT8_TILE_SET(R, p, ADD)                                                                       \
  TILE_ROWS_##R(TILE_ROW_ZERO)                                                                        \
  for (int64_t k = (p); k < K; k += QSETS) {                                                          \
    const __m256 v_lo = int8_lanes(w + k * PANEL), v_hi = int8_lanes(w + k * PANEL + 8);              \
    TILE_ROWS_##R(TILE_ROW_FMA)                                                                       \
  }                                                                                                   \
  TILE_ROWS_##R(ADD)

#define INT8_TILE_FN(R)                                                                                \
  static void int8_tile_##R(const float* xs, const int8_t* w, float* sums, int64_t K) {               \
    TILE_ROWS_##R(TILE_ROW_DECLARE)                                                                   \
    INT8_TILE_SET(R, 0, TILE_ROW_FIRST_SET)                                                           \
    INT8_TILE_SET(R, 1, TILE_ROW_NEXT_SET)                                                            \
  }

INT8_TILE_FN(3) INT8_TILE_FN(4)

/* One panel (int8 w, scales, output columns col..) for all M rows (M a sum of tiles of 4 and at most one of 3);
 * sums: QTILE_ROWS * PANEL floats. */
static void int8_panel_rows(const float* x, const int8_t* w, const float* scales, float* y, int64_t M, int64_t K,
                            int64_t N, int64_t col, float* sums) {
  const __m256 s_lo = _mm256_loadu_ps(scales), s_hi = _mm256_loadu_ps(scales + 8);
  for (int64_t m0 = 0; m0 < M; m0 += QTILE_ROWS) {
    const int64_t r = M - m0 < QTILE_ROWS ? M - m0 : QTILE_ROWS;
    if (r == 4) int8_tile_4(x + m0 * K, w, sums, K);
    else int8_tile_3(x + m0 * K, w, sums, K);
    for (int64_t m = 0; m < r; ++m)
      store_panel(y + (m0 + m) * N + col, _mm256_mul_ps(_mm256_loadu_ps(sums + m * PANEL), s_lo),
                  _mm256_mul_ps(_mm256_loadu_ps(sums + m * PANEL + 8), s_hi), first_n(N - col));
  }
}
#endif

/* Panels first..first+count-1 (count is QSTREAMS, or 1 at the end of a matrix) for every row, in row pairs. */
static void quantized_panels(const float* x, const float* xsum, const void* packed, const float* scales, float* y,
                             int64_t M, int64_t K, int64_t N, int bits, int64_t group, int64_t first, int64_t count,
                             float* work) {
  const int64_t col = first * PANEL;
#ifndef __AVX512F__
  if (M >= QMANY_ROWS && (bits == 8 || group % 8 == 0)) {
    /* tiles of 4 rows and one of 3; one or two rows left over take the pairs below (a tile of 1 or 2 rows has
     * too few FMA chains: int4, 5 rows as 3 + 2 took 1.45x as long as 4 + 1) */
    const int64_t tail = M % QTILE_ROWS <= 2 ? M % QTILE_ROWS : 0;
    if (bits == 8) {
      int8_panel_rows(x, (const int8_t*)packed + first * K * PANEL, scales + first * PANEL, y, M - tail, K, N, col,
                      work);
    } else {
      const int64_t words = (K + 7) / 8;
      int4_panel_rows(x, xsum, (const int32_t*)packed + first * words * PANEL, scales + first * (K / group) * PANEL,
                      y, M - tail, K, N, col, group, work);
      xsum += (M - tail) * (K / group);
    }
    x += (M - tail) * K;
    y += (M - tail) * N;
    M = tail;
  }
#endif
  for (int64_t m0 = 0; m0 < M; m0 += QROWS) {
    const int64_t r = M - m0 < QROWS ? M - m0 : QROWS;
    const float* xm = x + m0 * K;
    const float* xg = bits == 4 ? xsum + m0 * (K / group) : NULL;
    float* ym = y + m0 * N;
    if (bits == 8) {
      const int8_t* w = (const int8_t*)packed + first * K * PANEL;
      const float* s = scales + first * PANEL;
#if QSTREAMS > 1
      if (count == QSTREAMS) {
        if (r == 1) int8_1_4(xm, w, s, ym, K, N, col);
        else int8_2_4(xm, w, s, ym, K, N, col);
        continue;
      }
#endif
      for (int64_t c = 0; c < count; ++c) {
        if (r == 1) int8_1_1(xm, w + c * K * PANEL, s + c * PANEL, ym, K, N, col + c * PANEL);
        else int8_2_1(xm, w + c * K * PANEL, s + c * PANEL, ym, K, N, col + c * PANEL);
      }
    } else {
      const int64_t words = (K + 7) / 8;
      const int32_t* w = (const int32_t*)packed + first * words * PANEL;
      const float* s = scales + first * (K / group) * PANEL;
#if QSTREAMS > 1
      if (count == QSTREAMS) {
        if (r == 1) {
          int4_1_4(xm, xg, w, s, ym, K, N, col, group);
        } else {
          int4_2_2(xm, xg, w, s, ym, K, N, col, group);
          int4_2_2(xm, xg, w + 2 * words * PANEL, s + 2 * (K / group) * PANEL, ym, K, N, col + 2 * PANEL, group);
        }
        continue;
      }
#endif
      for (int64_t c = 0; c < count; ++c) {
        const int32_t* wc = w + c * words * PANEL;
        const float* sc = s + c * (K / group) * PANEL;
        if (r == 1) int4_1_1(xm, xg, wc, sc, ym, K, N, col + c * PANEL, group);
        else int4_2_1(xm, xg, wc, sc, ym, K, N, col + c * PANEL, group);
      }
    }
  }
}

/* Weight-only int4's input, prepared once per call: xs = x[m, k] * 16^-min(k % 8, 6) and xsum = each group's inputs
 * summed in k order ([M, K / group]). Returns 0, or -1 when out of memory (nothing allocated). */
static int int4_prepare(const float* x, int64_t M, int64_t K, int64_t group, float** xs_out, float** xsum_out) {
  static const float kNibbleScale[8] = {1.0f, 0x1p-4f, 0x1p-8f, 0x1p-12f, 0x1p-16f, 0x1p-20f, 0x1p-24f, 0x1p-24f};
  const int64_t num_groups = K / group;
  float* xs = (float*)malloc(sizeof(float) * (size_t)(M * K + 1));
  float* xsum = (float*)malloc(sizeof(float) * (size_t)(M * num_groups + 1));
  if (!xs || !xsum) {
    free(xs);
    free(xsum);
    return -1;
  }
  for (int64_t m = 0; m < M; ++m)
    for (int64_t g = 0; g < num_groups; ++g) {
      float sum = 0.0f;
      for (int64_t k = g * group; k < (g + 1) * group; ++k) {
        sum += x[m * K + k];
        xs[m * K + k] = x[m * K + k] * kNibbleScale[k & 7];
      }
      xsum[m * num_groups + g] = sum;
    }
  *xs_out = xs;
  *xsum_out = xsum;
  return 0;
}

/* Routed experts in one call (llama.cpp's mul_mat_id, vLLM's fused MoE): the rows of x [T, K] come grouped by
 * expert, rows offsets[i]..offsets[i + 1] - 1 going to expert experts[i] (i < num_used), whose weights start
 * packed_stride bytes and scales scale_stride floats after expert 0's; y [T, N]. Weights as
 * `omnimtp_quantized_linear`'s. Every (expert, QSTREAMS panels) pair is a work item, all of them split over the
 * threads, so a decode step's k experts of one token keep both cores reading. A row's values are those it gets
 * from its expert's matrix alone. Returns 0, or -1 when out of memory. */
int omnimtp_quantized_experts(const float* x, const void* packed, const float* scales, float* y, int64_t T, int64_t K,
                              int64_t N, int bits, int64_t group, const int64_t* experts, const int64_t* offsets,
                              int64_t num_used, int64_t packed_stride, int64_t scale_stride, int num_threads) {
  const int64_t panels = (N + PANEL - 1) / PANEL;
  const int64_t chunks = (panels + QSTREAMS - 1) / QSTREAMS, items = num_used * chunks;
  const int64_t num_groups = bits == 4 ? K / group : 0;
  float *xs = NULL, *xsum = NULL;
  if (bits == 4) {
    if (int4_prepare(x, T, K, group, &xs, &xsum) != 0) return -1;
    x = xs;
  }
  int64_t max_rows = 0;
  for (int64_t i = 0; i < num_used; ++i)
    if (offsets[i + 1] - offsets[i] > max_rows) max_rows = offsets[i + 1] - offsets[i];
#ifdef __AVX512F__
  const int64_t work_floats = 0;
  (void)max_rows;
#else /* each thread's scratch for the paths of several rows (int4_panel_rows, int8_panel_rows) */
  const int64_t work_floats = max_rows >= QMANY_ROWS ? (max_rows + QTILE_ROWS) * PANEL : 0;
#endif
  const int threads = num_threads > 1 && items > 1 ? num_threads : 1;
  float* work = work_floats ? (float*)malloc(sizeof(float) * (size_t)(threads * work_floats)) : NULL;
  if (work_floats && work == NULL) {
    free(xs);
    free(xsum);
    return -1;
  }
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
  for (int64_t item = 0; item < items; ++item) {
    const int64_t i = item / chunks, first = (item % chunks) * QSTREAMS, m0 = offsets[i];
    const int64_t count = panels - first < QSTREAMS ? panels - first : QSTREAMS;
    const char* weights = (const char*)packed + experts[i] * packed_stride;
    float* own = work == NULL ? NULL : work + (int64_t)omp_get_thread_num() * work_floats;
    quantized_panels(x + m0 * K, xsum == NULL ? NULL : xsum + m0 * num_groups, weights,
                     scales + experts[i] * scale_stride, y + m0 * N, offsets[i + 1] - m0, K, N, bits, group, first,
                     count, own);
  }
  free(work);
  free(xs);
  free(xsum);
  return 0;
}

/* bits 8: packed int8 [panels][K][16], scales [panels * 16]; bits 4: packed [panels][ceil(K/8)][16] words, scales
 * [panels][K / group][16] (K a multiple of group). x [M, K], y [M, N] row-major. Groups of QSTREAMS panels
 * are split over the threads: one expert's worth of `omnimtp_quantized_experts`. Returns 0, or -1 when out of
 * memory. */
int omnimtp_quantized_linear(const float* x, const void* packed, const float* scales, float* y, int64_t M, int64_t K,
                             int64_t N, int bits, int64_t group, int num_threads) {
  const int64_t expert = 0, offsets[2] = {0, M};
  return omnimtp_quantized_experts(x, packed, scales, y, M, K, N, bits, group, &expert, offsets, 1, 0, 0,
                                   num_threads);
}

/* int4 weights with int8 activations ("w4a8"): y[M, N] = sum over groups of scale_w[g][n] * scale_x[m][g] *
 * sum_k xq[m, k] q[n, k], the inner sums in exact integers. The weights are int4's words as above (nothing is
 * packed again); the activations are quantized per row and group of inputs when the call starts:
 * scale_x = max|x| / 127 over the group, xq = round(x * (127 / max|x|)) (to nearest, ties to even) in
 * -127..127. In a word the bytes of w & 0x0F0F0F0F are inputs 0, 2, 4, 6 of the word and those of
 * (w >> 4) & 0x0F0F0F0F inputs 1, 3, 5, 7, each q + 8 in 0..15 (an unsigned byte), so a dot-product instruction
 * of 4 unsigned by 4 signed bytes (AVX512-VNNI `vpdpbusd`; on AVX2 `vpmaddubsw` then `vpmaddwd`, whose pair sums
 * stay below 2 * 15 * 127) multiplies 16 columns by 4 inputs each, the activations stored in that order. Per
 * group, the sum of (q + 8) xq less 8 sum xq is sum q xq, an exact int32 (|.| < 15 * 127 * K); it is converted
 * to float and multiplied by scale_w * scale_x with one FMA per group. Both instruction sets form the same
 * integers and round the same float operations in the same order, so they give the same bits, and a row's
 * values do not depend on the other rows. About 6 instructions per 128 weights against int4's 3 per 16: the
 * kernel reads its weights at memory speed instead of being bound by its conversions. */
#define W4A8_ROWS 4 /* rows at once: a panel's int32 sums for 4 rows live in registers */
/* Bytes ahead of the word being read that each panel's stream is prefetched (a panel is a sequential stream of
 * 64-byte words, a matrix its panels one after the other). The L2 streamer stops at every 4 KiB page and a routed
 * expert's matrix starts wherever the picked expert lies, so the software prefetch keeps more reads in flight: on a
 * 2-core AMD EPYC (L3 32 MiB), one row through 8 of 512 random experts' w4a8 gate_up and down, cold, read 23.8 /
 * 30.2 / 31.5 / 31.3 GB/s on one core at 512 B / 2 / 4 / 8 KiB ahead, 40.4 / 51.4 / 52.3 / 53.4 on two (measured
 * alternately while other jobs ran). */
#define W4A8_PREFETCH 8192

typedef struct {
  const int8_t* xq;     /* [M][8 * words]: each word's inputs 0, 2, 4, 6, 1, 3, 5, 7; zero past K */
  const int32_t* xsum;  /* [M][groups]: sum of the group's xq */
  const float* xscale;  /* [M][groups] */
  const int32_t* words; /* [panels][words][16] */
  const float* scales;  /* [panels][groups][16] */
  float* y;
  int64_t K, N, group, groups, words_per_panel;
} w4a8_args;

static inline int32_t load_i32(const int8_t* p) {
  int32_t v;
  __builtin_memcpy(&v, p, sizeof v);
  return v;
}

/* One word of 8 inputs (index I of the panel) for R rows into the chains C (its even inputs) and C + 1 (its odd
 * ones). With one chain of dependent vpdpbusd a row, a one-row call's instructions waited on each other and filled
 * the out-of-order window, so fewer weight reads were in flight: on a 2-core AMD EPYC one row through 8 of 512
 * random experts' gate_up and down (cold, 512 B prefetch) read 12.2 GB/s on one core and 22-23 on two with one
 * chain, 17.5 and 25-34 with W4A8_CHAINS independent chains a row (even and odd inputs of alternate words;
 * measured alternately while other jobs ran). The chains are added once per group: integer sums, the same bits in
 * any order. */
#define W4A8_CHAINS 4
#define W4A8_VNNI_WORD(R, I, C)                                                                        \
  {                                                                                                   \
    const int32_t* ws = a->words + (panel * words + (I)) * PANEL;                                     \
    _mm_prefetch((const char*)ws + W4A8_PREFETCH, _MM_HINT_T0);                                       \
    const __m512i v = _mm512_loadu_si512((const void*)ws);                                            \
    const __m512i even = _mm512_and_si512(v, nibbles);                                                \
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(v, 4), nibbles);                           \
    for (int m = 0; m < R; ++m) {                                                                     \
      const int8_t* xm = a->xq + (m0 + m) * kw + 8 * (I);                                             \
      dot[C][m] = _mm512_dpbusd_epi32(dot[C][m], even, _mm512_set1_epi32(load_i32(xm)));              \
      dot[C + 1][m] = _mm512_dpbusd_epi32(dot[C + 1][m], odd, _mm512_set1_epi32(load_i32(xm + 4)));   \
    }                                                                                                 \
  }

/* R rows (first row m0) of one panel, AVX512-VNNI. One panel at a time: one row on 2 threads read its weights
 * at 36.9 GB/s (the box's read bandwidth), four panels at once at 29.0 (2-core AMD EPYC). */
#define W4A8_VNNI_FN(R)                                                                                \
  __attribute__((target("avx512f,avx512bw,avx512vnni"))) static void w4a8_vnni_##R(const w4a8_args* a,  \
                                                                                   int64_t m0, int64_t panel) { \
    const int64_t words = a->words_per_panel, kw = 8 * words;                                         \
    const __m512i nibbles = _mm512_set1_epi32(0x0F0F0F0F);                                            \
    __m512 acc[R];                                                                                    \
    for (int m = 0; m < R; ++m) acc[m] = _mm512_setzero_ps();                                         \
    for (int64_t g = 0; g < a->groups; ++g) {                                                         \
      const int64_t i0 = g * a->group / 8, i1 = g == a->groups - 1 ? words : (g + 1) * a->group / 8;  \
      __m512i dot[W4A8_CHAINS][R];                                                                    \
      for (int c = 0; c < W4A8_CHAINS; ++c)                                                           \
        for (int m = 0; m < R; ++m) dot[c][m] = _mm512_setzero_si512();                               \
      int64_t i = i0;                                                                                 \
      for (; i + 1 < i1; i += 2) {                                                                    \
        W4A8_VNNI_WORD(R, i, 0)                                                                       \
        W4A8_VNNI_WORD(R, i + 1, 2)                                                                   \
      }                                                                                               \
      if (i < i1) W4A8_VNNI_WORD(R, i, 0)                                                             \
      for (int m = 0; m < R; ++m)                                                                     \
        dot[0][m] = _mm512_add_epi32(_mm512_add_epi32(dot[0][m], dot[1][m]),                          \
                                     _mm512_add_epi32(dot[2][m], dot[3][m]));                         \
      const __m512 sc = _mm512_loadu_ps(a->scales + (panel * a->groups + g) * PANEL);                 \
      for (int m = 0; m < R; ++m) {                                                                   \
        const int64_t row = m0 + m;                                                                   \
        const __m512i bias = _mm512_set1_epi32(8 * a->xsum[row * a->groups + g]);                    \
        const __m512 xs = _mm512_set1_ps(a->xscale[row * a->groups + g]);                            \
        acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(dot[0][m], bias)), _mm512_mul_ps(sc, xs), acc[m]); \
      }                                                                                               \
    }                                                                                                 \
    const int64_t n = a->N - panel * PANEL;                                                           \
    const __mmask16 mask = n >= PANEL ? (__mmask16)0xFFFF : (__mmask16)((1u << n) - 1u);              \
    for (int m = 0; m < R; ++m) _mm512_mask_storeu_ps(a->y + (m0 + m) * a->N + panel * PANEL, mask, acc[m]); \
  }

/* The same on AVX2, one panel (two 8-column halves) at a time: vpmaddubsw forms the pair sums (int16) of the
 * even and the odd bytes, their sum (below 4 * 15 * 127) goes through vpmaddwd by ones to the four-input int32
 * sums vpdpbusd forms. */
#define W4A8_AVX2_FN(R)                                                                                \
  __attribute__((target("avx2,fma"))) static void w4a8_avx2_##R(const w4a8_args* a, int64_t m0,     \
                                                                    int64_t panel) {                  \
    const int64_t words = a->words_per_panel, kw = 8 * words;                                         \
    const __m256i nibbles = _mm256_set1_epi32(0x0F0F0F0F), ones = _mm256_set1_epi16(1);               \
    float out[R][PANEL];                                                                              \
    for (int m = 0; m < R; ++m)                                                                       \
      for (int c = 0; c < PANEL; ++c) out[m][c] = 0.0f;                                               \
    for (int64_t g = 0; g < a->groups; ++g) {                                                         \
      const int64_t i0 = g * a->group / 8, i1 = g == a->groups - 1 ? words : (g + 1) * a->group / 8;  \
      __m256i dlo[R], dhi[R];                                                                         \
      for (int m = 0; m < R; ++m) dlo[m] = dhi[m] = _mm256_setzero_si256();                           \
      for (int64_t i = i0; i < i1; ++i) {                                                             \
        const int32_t* ws = a->words + (panel * words + i) * PANEL;                                   \
        _mm_prefetch((const char*)ws + W4A8_PREFETCH, _MM_HINT_T0);                                   \
        const __m256i vl = _mm256_loadu_si256((const __m256i*)ws), vh = _mm256_loadu_si256((const __m256i*)(ws + 8)); \
        const __m256i el = _mm256_and_si256(vl, nibbles), ol = _mm256_and_si256(_mm256_srli_epi32(vl, 4), nibbles); \
        const __m256i eh = _mm256_and_si256(vh, nibbles), oh = _mm256_and_si256(_mm256_srli_epi32(vh, 4), nibbles); \
        for (int m = 0; m < R; ++m) {                                                                 \
          const int8_t* xm = a->xq + (m0 + m) * kw + 8 * i;                                           \
          const __m256i xe = _mm256_set1_epi32(load_i32(xm)), xo = _mm256_set1_epi32(load_i32(xm + 4)); \
          const __m256i pl = _mm256_add_epi16(_mm256_maddubs_epi16(el, xe), _mm256_maddubs_epi16(ol, xo)); \
          const __m256i ph = _mm256_add_epi16(_mm256_maddubs_epi16(eh, xe), _mm256_maddubs_epi16(oh, xo)); \
          dlo[m] = _mm256_add_epi32(dlo[m], _mm256_madd_epi16(pl, ones));                             \
          dhi[m] = _mm256_add_epi32(dhi[m], _mm256_madd_epi16(ph, ones));                             \
        }                                                                                             \
      }                                                                                               \
      const float* sc = a->scales + (panel * a->groups + g) * PANEL;                                  \
      for (int m = 0; m < R; ++m) {                                                                   \
        const int64_t row = m0 + m;                                                                   \
        const __m256i bias = _mm256_set1_epi32(8 * a->xsum[row * a->groups + g]);                    \
        const __m256 xs = _mm256_set1_ps(a->xscale[row * a->groups + g]);                            \
        const __m256 fl = _mm256_cvtepi32_ps(_mm256_sub_epi32(dlo[m], bias));                        \
        const __m256 fh = _mm256_cvtepi32_ps(_mm256_sub_epi32(dhi[m], bias));                        \
        _mm256_storeu_ps(out[m], _mm256_fmadd_ps(fl, _mm256_mul_ps(_mm256_loadu_ps(sc), xs), _mm256_loadu_ps(out[m]))); \
        _mm256_storeu_ps(out[m] + 8,                                                                  \
                         _mm256_fmadd_ps(fh, _mm256_mul_ps(_mm256_loadu_ps(sc + 8), xs), _mm256_loadu_ps(out[m] + 8))); \
      }                                                                                               \
    }                                                                                                 \
    const int64_t col = panel * PANEL, n = a->N - col < PANEL ? a->N - col : PANEL;                   \
    for (int m = 0; m < R; ++m)                                                                       \
      for (int64_t c = 0; c < n; ++c) a->y[(m0 + m) * a->N + col + c] = out[m][c];                    \
  }

W4A8_VNNI_FN(1) W4A8_VNNI_FN(2) W4A8_VNNI_FN(3) W4A8_VNNI_FN(4)
W4A8_AVX2_FN(1) W4A8_AVX2_FN(2) W4A8_AVX2_FN(3) W4A8_AVX2_FN(4)

typedef void (*w4a8_fn)(const w4a8_args*, int64_t, int64_t);

static int has_vnni(void) { /* AVX512-VNNI and the AVX-512 subsets its code uses, on this CPU */
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vnni");
}

int omnimtp_w4a8_has_vnni(void) { return has_vnni(); }

/* One panel for every row, in tiles of up to W4A8_ROWS rows. */
static void w4a8_panel(const w4a8_args* a, int64_t M, int64_t panel, int vnni) {
  static const w4a8_fn kVnni[W4A8_ROWS + 1] = {0, w4a8_vnni_1, w4a8_vnni_2, w4a8_vnni_3, w4a8_vnni_4};
  static const w4a8_fn kAvx2[W4A8_ROWS + 1] = {0, w4a8_avx2_1, w4a8_avx2_2, w4a8_avx2_3, w4a8_avx2_4};
  for (int64_t m0 = 0; m0 < M; m0 += W4A8_ROWS) {
    const int64_t r = M - m0 < W4A8_ROWS ? M - m0 : W4A8_ROWS;
    (vnni ? kVnni : kAvx2)[r](a, m0, panel);
  }
}

/* max |x[t]| over x[0..n-1] and whether any is NaN: eight inputs at a time, the rest one by one (the activation
 * quantizers' first pass). */
__attribute__((target("avx2,fma"))) static float abs_max(const float* x, int64_t n, int* any_nan) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  __m256 vmax = _mm256_setzero_ps(), nan = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 8 <= n; k += 8) {
    const __m256 v = _mm256_loadu_ps(x + k);
    vmax = _mm256_max_ps(vmax, _mm256_andnot_ps(sign, v));
    nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  }
  float lanes[8];
  _mm256_storeu_ps(lanes, vmax);
  float amax = 0.0f;
  for (int j = 0; j < 8; ++j) amax = lanes[j] > amax ? lanes[j] : amax;
  *any_nan = _mm256_movemask_ps(nan) != 0;
  for (int64_t t = k; t < n; ++t) {
    const float v = x[t] < 0 ? -x[t] : x[t];
    *any_nan |= v != v;
    amax = v > amax ? v : amax;
  }
  return amax;
}

static const int kSlot[8] = {0, 4, 1, 5, 2, 6, 3, 7}; /* input j of a word → its byte: evens, then odds */

/* Quantizes the group x[0..n-1] (inputs k0..k0+n-1 of its row; k0 a multiple of 8) into q (the row's bytes, in
 * word order), its sum and scale. Eight inputs at a time, the rest one by one: the same values either way (a
 * maximum, one product and a rounding to nearest, ties to even, per input: `vcvtps2dq` under the default
 * rounding mode is `nearbyintf`). */
__attribute__((target("avx2,fma"))) static void w4a8_quantize_group(const float* x, int64_t n, int64_t k0,
                                                                    int8_t* q, int32_t* sum, float* scale) {
  int any_nan;
  const float amax = abs_max(x, n, &any_nan);
  int64_t k;
  if (any_nan || !(amax <= 3.4028234663852886e38f) || amax == 0.0f) {
    /* all zero: zeros out; an infinity or a NaN: NaN outputs (the scale NaN) */
    for (int64_t t = 0; t < n; ++t) q[((k0 + t) & ~7) + kSlot[(k0 + t) & 7]] = 0;
    *sum = 0;
    *scale = amax == 0.0f && !any_nan ? 0.0f : __builtin_nanf("");
    return;
  }
  const float inv = 127.0f / amax;
  const __m256 vinv = _mm256_set1_ps(inv);
  const __m256i order = _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7), lo = _mm256_set1_epi32(-127),
                hi = _mm256_set1_epi32(127);
  __m256i vsum = _mm256_setzero_si256();
  for (k = 0; k + 8 <= n; k += 8) { /* k0 + k is a multiple of 8: a whole word */
    __m256i r = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + k), vinv));
    r = _mm256_min_epi32(_mm256_max_epi32(r, lo), hi);
    vsum = _mm256_add_epi32(vsum, r);
    const __m256i p = _mm256_permutevar8x32_epi32(r, order); /* the word's byte order */
    const __m256i b = _mm256_packs_epi16(_mm256_packs_epi32(p, p), _mm256_packs_epi32(p, p));
    const int32_t first = _mm256_cvtsi256_si32(b), second = _mm256_extract_epi32(b, 4);
    __builtin_memcpy(q + k0 + k, &first, 4);
    __builtin_memcpy(q + k0 + k + 4, &second, 4);
  }
  int32_t ints[8], total = 0;
  _mm256_storeu_si256((__m256i*)ints, vsum);
  for (int j = 0; j < 8; ++j) total += ints[j];
  for (; k < n; ++k) {
    float r = __builtin_nearbyintf(x[k] * inv);
    r = r > 127.0f ? 127.0f : r < -127.0f ? -127.0f : r;
    q[((k0 + k) & ~7) + kSlot[(k0 + k) & 7]] = (int8_t)r;
    total += (int32_t)r;
  }
  *sum = total;
  *scale = amax / 127.0f;
}

/* The routed experts of `omnimtp_quantized_experts` (rows grouped by expert, experts[i] taking rows offsets[i]..
 * offsets[i + 1] - 1; its words words_stride and its scales scale_stride int32s / floats after expert 0's) in w4a8:
 * x [T, K] fp32 quantized once, y [T, N]; every (expert, panel) pair a work item. vnni: -1 for this CPU's best
 * (AVX512-VNNI where it has it), 0 for the AVX2 code, 1 for VNNI (what tests compare). A row's values are those it
 * gets from its expert alone. Returns 0, -1 when out of memory, -2 when VNNI is asked for and absent, -3 for a
 * group that does not divide K or, with several groups, falls inside words of 8 inputs. */
int omnimtp_w4a8_experts(const float* x, const int32_t* words, const float* scales, float* y, int64_t T, int64_t K,
                         int64_t N, int64_t group, const int64_t* experts, const int64_t* offsets, int64_t num_used,
                         int64_t words_stride, int64_t scale_stride, int num_threads, int vnni) {
  if (group < 1 || K % group != 0 || (K / group > 1 && group % 8 != 0)) return -3;
  if (vnni < 0) vnni = has_vnni();
  else if (vnni && !has_vnni()) return -2;
  const int64_t panels = (N + PANEL - 1) / PANEL, groups = K / group, words_per_panel = (K + 7) / 8;
  const int64_t kw = 8 * words_per_panel, items = num_used * panels;
  int8_t* xq = (int8_t*)malloc((size_t)(T * kw + 1));
  int32_t* xsum = (int32_t*)malloc(sizeof(int32_t) * (size_t)(T * groups + 1));
  float* xscale = (float*)malloc(sizeof(float) * (size_t)(T * groups + 1));
  if (!xq || !xsum || !xscale) {
    free(xq);
    free(xsum);
    free(xscale);
    return -1;
  }
  for (int64_t m = 0; m < T; ++m)
    for (int64_t g = 0; g < groups; ++g)
      w4a8_quantize_group(x + m * K + g * group, group, g * group, xq + m * kw, xsum + m * groups + g,
                          xscale + m * groups + g);
  for (int64_t m = 0; m < T; ++m)
    for (int64_t k = K; k < kw; ++k) xq[m * kw + (k & ~7) + kSlot[k & 7]] = 0;
  const int threads = num_threads > 1 && items > 1 ? num_threads : 1;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
  for (int64_t item = 0; item < items; ++item) {
    const int64_t i = item / panels, m0 = offsets[i];
    const w4a8_args args = {xq + m0 * kw, xsum + m0 * groups, xscale + m0 * groups, words + experts[i] * words_stride,
                            scales + experts[i] * scale_stride, y + m0 * N, K, N, group, groups, words_per_panel};
    w4a8_panel(&args, offsets[i + 1] - m0, item % panels, vnni);
  }
  free(xq);
  free(xsum);
  free(xscale);
  return 0;
}

/* x [M, K] fp32, words and scales as int4's (`omnimtp_quantized_linear` with bits 4), y [M, N]: one expert's worth
 * of `omnimtp_w4a8_experts` (its vnni and return values). */
int omnimtp_w4a8_linear(const float* x, const int32_t* words, const float* scales, float* y, int64_t M, int64_t K,
                        int64_t N, int64_t group, int num_threads, int vnni) {
  const int64_t expert = 0, offsets[2] = {0, M};
  return omnimtp_w4a8_experts(x, words, scales, y, M, K, N, group, &expert, offsets, 1, 0, 0, num_threads, vnni);
}

/* x [M, K] fp32 → q [M, K] unsigned bytes and scales [M] (the "w8a8" linear's input for oneDNN's u8 x s8 int8 GEMM,
 * zero point 128): per row, scale = max|x| / 127 and q = 128 + round(x * (127 / max|x|)) (ties to even, clamped to
 * -127..127 first): the values of `quantize_activations_int8` with one group, shifted. An all-zero row gives 128s and
 * scale 0; a row with a NaN or an infinity 128s and a NaN scale. Rows split over the threads; one pass to find a
 * row's maximum, one to round it. */
__attribute__((target("avx2,fma"))) static void quantize_row_u8(const float* x, int64_t K, uint8_t* q,
                                                                float* scale) {
  int any_nan;
  int64_t k;
#ifdef __AVX512F__
  /* 16 lanes a step (the same maximum, products and roundings as the 8-lane code below: twice its rate) */
  __m512 top = _mm512_setzero_ps();
  __mmask16 nan_lanes = 0;
  for (k = 0; k + 16 <= K; k += 16) {
    const __m512 v = _mm512_loadu_ps(x + k);
    top = _mm512_max_ps(top, _mm512_abs_ps(v));
    nan_lanes |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  }
  float amax = _mm512_reduce_max_ps(top);
  any_nan = nan_lanes != 0;
  for (int64_t t = k; t < K; ++t) {
    const float v = x[t] < 0 ? -x[t] : x[t];
    any_nan |= v != v;
    amax = v > amax ? v : amax;
  }
#else
  const float amax = abs_max(x, K, &any_nan);
#endif
  if (any_nan || !(amax <= 3.4028234663852886e38f) || amax == 0.0f) {
    memset(q, 128, (size_t)K);
    *scale = amax == 0.0f && !any_nan ? 0.0f : __builtin_nanf("");
    return;
  }
  const float inv = 127.0f / amax;
  k = 0;
#ifdef __AVX512F__
  const __m512 inverse = _mm512_set1_ps(inv);
  const __m512i low = _mm512_set1_epi32(-127), high = _mm512_set1_epi32(127), shift = _mm512_set1_epi32(128);
  for (; k + 16 <= K; k += 16) {
    __m512i r = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(x + k), inverse));
    r = _mm512_add_epi32(_mm512_min_epi32(_mm512_max_epi32(r, low), high), shift); /* 1..255 */
    _mm_storeu_si128((__m128i*)(q + k), _mm512_cvtepi32_epi8(r));
  }
#endif
  const __m256 vinv = _mm256_set1_ps(inv);
  const __m256i lo = _mm256_set1_epi32(-127), hi = _mm256_set1_epi32(127), zero_point = _mm256_set1_epi32(128);
  for (; k + 8 <= K; k += 8) {
    __m256i r = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + k), vinv));
    r = _mm256_add_epi32(_mm256_min_epi32(_mm256_max_epi32(r, lo), hi), zero_point); /* 1..255 */
    const __m256i w = _mm256_packus_epi16(_mm256_packs_epi32(r, r), _mm256_packs_epi32(r, r));
    const int32_t first = _mm256_cvtsi256_si32(w), second = _mm256_extract_epi32(w, 4);
    __builtin_memcpy(q + k, &first, 4);
    __builtin_memcpy(q + k + 4, &second, 4);
  }
  for (; k < K; ++k) {
    const float rounded = __builtin_nearbyintf(x[k] * inv);
    q[k] = (uint8_t)(128 + (int)(rounded > 127.0f ? 127.0f : rounded < -127.0f ? -127.0f : rounded));
  }
  *scale = amax / 127.0f;
}

void omnimtp_quantize_rows_u8(const float* x, int64_t M, int64_t K, uint8_t* q, float* scales, int num_threads) {
  const int threads = num_threads > 1 && M > 1 ? num_threads : 1;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
  for (int64_t m = 0; m < M; ++m) quantize_row_u8(x + m * K, K, q + m * K, scales + m);
}

/* x [B, H, W, C] channels last (fp32, or bf16 with bf16 = 1) → rows row0..row0+n-1 of its patch matrix for a kh x kw
 * convolution (strides sh, sw; padding ph, pw: zeros outside x), quantized as `omnimtp_quantize_rows_u8` quantizes
 * rows: q [n, kh * kw * C], scales [n]. Row r = (b, ho, wo) in order (Ho, Wo the output's height and width) holds
 * x[b, ho * sh - ph + i, wo * sw - pw + j, :] for i < kh, then j < kw (the weight's [O, kh, kw, C] order). Each
 * row is gathered (bf16 widened exactly) into a buffer of its thread and quantized there: the values of
 * `omnimtp_quantize_rows_u8` on the unfolded fp32 matrix, without holding it. Rows split over the threads. Returns
 * 0, or -1 when out of memory. */
static inline float bf16_to_float(uint16_t h); /* below, with the attention's helpers */

int omnimtp_quantize_patches_u8(const void* x, int bf16, int64_t B, int64_t H, int64_t W, int64_t C, int64_t kh,
                                int64_t kw, int64_t sh, int64_t sw, int64_t ph, int64_t pw, int64_t row0, int64_t n,
                                uint8_t* q, float* scales, int num_threads) {
  const int64_t Ho = (H + 2 * ph - kh) / sh + 1, Wo = (W + 2 * pw - kw) / sw + 1, K = kh * kw * C;
  const int threads = num_threads > 1 && n > 1 ? num_threads : 1;
  int failed = 0;
  (void)B;
#pragma omp parallel num_threads(threads) if (threads > 1)
  {
    float* patch = (float*)malloc(sizeof(float) * (size_t)K);
    if (!patch) {
#pragma omp atomic write
      failed = 1;
    }
#pragma omp for schedule(static)
    for (int64_t m = 0; m < n; ++m) {
      if (!patch) continue;
      const int64_t r = row0 + m, b = r / (Ho * Wo), ho = r / Wo % Ho, wo = r % Wo;
      float* out = patch;
      for (int64_t i = 0; i < kh; ++i) {
        const int64_t h = ho * sh - ph + i;
        for (int64_t j = 0; j < kw; ++j, out += C) {
          const int64_t w = wo * sw - pw + j;
          if (h < 0 || h >= H || w < 0 || w >= W) {
            memset(out, 0, sizeof(float) * (size_t)C);
            continue;
          }
          const int64_t at = ((b * H + h) * W + w) * C;
          if (bf16) {
            const uint16_t* src = (const uint16_t*)x + at;
            for (int64_t c = 0; c < C; ++c) out[c] = bf16_to_float(src[c]);
          } else {
            memcpy(out, (const float*)x + at, sizeof(float) * (size_t)C);
          }
        }
      }
      quantize_row_u8(patch, K, q + m * K, scales + m);
    }
    free(patch);
  }
  return failed ? -1 : 0;
}

/* ---------------------------------------------------------------------------------------------
 * Attention of one query position a row (a decode step), grouped-query: query head j reads key head j / (Nq /
 * Nkv); the layout is `omnimtp_decode_attention`'s.
 *
 * Why: at one query the step is bound by reading the keys and values. torch's SDPA CPU kernel runs such a step
 * as a small GEMM per block of keys and read them at 10-12 GB/s in a decoder's step on a 2-core AMD EPYC; here
 * each key and value row is read once for all the query heads of its group (scores, then a softmax, then the
 * weighted sum of the values), at the core's read bandwidth. The (row, key head) pairs are split over the threads.
 *
 * Numerics: scores, softmax and sums in fp32 in position order, exp within 1 ulp of libm's (SDPA's blocked online
 * softmax and its own exp round otherwise: equal up to fp32 rounding). A bf16 cache (a bf16 decoder's) is read as
 * it is stored and widened row by row, the sums still in fp32 and each output rounded to bf16 once (SDPA's bf16
 * CPU kernel rounds its probabilities to bf16 too). Returns 0, -1 when out of memory, -2 for D > 256 or a group of more than 16. */
#define ATTENTION_MAX_D 256
#define ATTENTION_MAX_GROUP 16

/* exp(x) for x <= 0 (a score minus its row's maximum) in plain arithmetic (libm's expf is one call per score: a
 * third of the step at 8 query heads a key head; gcc keeps this loop scalar too, so the AVX-512 code has its own
 * 16-lane form, `exp_nonpositive16`). Cephes' expf: x = n ln 2 + r with |r| <= ln 2 / 2, a degree-6 polynomial in
 * r, times 2^n; within 1 ulp of expf over [-87, 0]. Below -87 (where 2^n leaves the normal range) it gives exp(-87)
 * ~ 1.6e-38, nothing next to the maximum's 1. */
static inline float exp_nonpositive(float x) {
  x = x < -87.0f ? -87.0f : x;
  const float n = floorf(x * 1.44269504088896341f + 0.5f);
  const float r = x - n * 0.693359375f + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const int32_t bits = ((int32_t)n + 127) << 23;
  float two_n;
  memcpy(&two_n, &bits, sizeof two_n);
  return p * two_n;
}

/* bf16 (the upper 16 bits of an fp32) → fp32, exactly. */
static inline float bf16_to_float(uint16_t h) {
  const uint32_t bits = (uint32_t)h << 16;
  float f;
  memcpy(&f, &bits, sizeof f);
  return f;
}

/* fp32 → bf16 rounded to nearest, ties to even; a NaN gives 0x7FC0 (torch's conversion). */
static inline uint16_t float_to_bf16(float f) {
  uint32_t bits;
  memcpy(&bits, &f, sizeof bits);
  if ((bits & 0x7FFFFFFFu) > 0x7F800000u) return 0x7FC0;
  return (uint16_t)((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);
}

/* Row `index` of a key or value head (`stride` elements apart) as fp32: the row itself, or (bf16) its D values
 * widened into `buffer`. */
static inline const float* row_as_float(const void* head, int64_t index, int64_t stride, int64_t D, int bf16,
                                        float* buffer) {
  if (!bf16) return (const float*)head + index * stride;
  const uint16_t* row = (const uint16_t*)head + index * stride;
#pragma omp simd
  for (int64_t d = 0; d < D; ++d) buffer[d] = bf16_to_float(row[d]);
  return buffer;
}

/* The positions s < n whose mask byte is nonzero, in order, into positions; returns how many. */
static int64_t visible_positions(const uint8_t* mask, int64_t n, int64_t* positions) {
  int64_t count = 0;
  for (int64_t s = 0; s < n; ++s)
    if (mask[s]) positions[count++] = s;
  return count;
}

#ifdef __AVX512F__
#define ATTENTION_PREFETCH 16 /* rows ahead that the fp32 code prefetches */

/* The sums of the 16 lanes of a, b, c and d into s[0..3], each in one fixed tree of adds over its own lanes (a
 * sum does not depend on the other three vectors): four horizontal sums in ten shuffles and adds. */
static inline void sum_lanes4(__m512 a, __m512 b, __m512 c, __m512 d, float* s) {
  const __m512 ab = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x44), _mm512_shuffle_f32x4(a, b, 0xEE));
  const __m512 cd = _mm512_add_ps(_mm512_shuffle_f32x4(c, d, 0x44), _mm512_shuffle_f32x4(c, d, 0xEE));
  __m512 t = _mm512_add_ps(_mm512_shuffle_f32x4(ab, cd, 0x88), _mm512_shuffle_f32x4(ab, cd, 0xDD)); /* a|b|c|d */
  t = _mm512_add_ps(t, _mm512_permute_ps(t, 0xB1));
  t = _mm512_add_ps(t, _mm512_permute_ps(t, 0x4E)); /* lane 4j: the sum of vector j */
  const __m512 first = _mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0), t);
  _mm_storeu_ps(s, _mm512_castps512_ps128(first));
}

/* 16 values of a key or value row from element d on, in fp32: an fp32 row's own, a bf16 row's widened (exactly). */
static inline __attribute__((always_inline)) __m512 row16(const char* row, int64_t d, int bf16) {
  if (!bf16) return _mm512_loadu_ps((const float*)row + d);
  const __m256i halves = _mm256_loadu_si256((const __m256i*)((const uint16_t*)row + d));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(halves), 16));
}

/* The scores of a head (fp32 or bf16 rows), D a multiple of 16: four keys at a time, so that each query head's four
 * dot products are independent chains and their horizontal sums share one tree (one key at a time, a chain of D /
 * 16 dependent FMAs and a horizontal sum per score made the step's attention compute-bound: its time with the keys
 * in L2 was about its whole read from memory). Each score: lane-wise FMAs in d order, then `sum_lanes4`, times
 * scale. */
static inline __attribute__((always_inline)) void block_scores(const float* qh, const void* kh, int64_t k_row_stride,
                                                               const int64_t* positions, int64_t n, int64_t G,
                                                               int64_t D, float scale, float* scores, int bf16) {
  const int64_t size = bf16 ? 2 : 4;
  for (int64_t i = 0; i < n; i += 4) {
    const int64_t count = n - i < 4 ? n - i : 4;
    const char* k[4];
    for (int64_t j = 0; j < 4; ++j) { /* past the last key: the block's first again, its scores not stored */
      const int64_t index = i + (j < count ? j : 0);
      k[j] = (const char*)kh + (positions ? positions[index] : index) * k_row_stride * size;
    }
    for (int64_t j = 0; j < 4 && i + ATTENTION_PREFETCH + j < n; ++j) { /* the keys ATTENTION_PREFETCH ahead */
      const int64_t ahead = i + ATTENTION_PREFETCH + j;
      const char* row = (const char*)kh + (positions ? positions[ahead] : ahead) * k_row_stride * size;
      for (int64_t b = 0; b < D * size; b += 64) _mm_prefetch(row + b, _MM_HINT_T0);
    }
    for (int64_t g = 0; g < G; ++g) {
      const float* qg = qh + g * D;
      __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
      for (int64_t d = 0; d < D; d += 16) {
        const __m512 qv = _mm512_loadu_ps(qg + d);
        a0 = _mm512_fmadd_ps(qv, row16(k[0], d, bf16), a0);
        a1 = _mm512_fmadd_ps(qv, row16(k[1], d, bf16), a1);
        a2 = _mm512_fmadd_ps(qv, row16(k[2], d, bf16), a2);
        a3 = _mm512_fmadd_ps(qv, row16(k[3], d, bf16), a3);
      }
      float sums[4];
      sum_lanes4(a0, a1, a2, a3, sums);
      for (int64_t j = 0; j < count; ++j) scores[g * n + i + j] = sums[j] * scale;
    }
  }
}

static void block_scores_fp32(const float* qh, const void* kh, int64_t k_row_stride, const int64_t* positions,
                              int64_t n, int64_t G, int64_t D, float scale, float* scores) {
  block_scores(qh, kh, k_row_stride, positions, n, G, D, scale, scores, 0);
}

static void block_scores_bf16(const float* qh, const void* kh, int64_t k_row_stride, const int64_t* positions,
                              int64_t n, int64_t G, int64_t D, float scale, float* scores) {
  block_scores(qh, kh, k_row_stride, positions, n, G, D, scale, scores, 1);
}

/* `exp_nonpositive` on 16 lanes (its arithmetic, in FMAs; a NaN stays NaN). */
static inline __m512 exp_nonpositive16(__m512 x) {
  x = _mm512_max_ps(_mm512_set1_ps(-87.0f), x); /* the second operand where either is NaN: x */
  const __m512 n = _mm512_roundscale_ps(_mm512_fmadd_ps(x, _mm512_set1_ps(1.44269504088896341f), _mm512_set1_ps(0.5f)),
                                        _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  const __m512 r = _mm512_fmadd_ps(n, _mm512_set1_ps(2.12194440e-4f),
                                   _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x));
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_add_ps(_mm512_fmadd_ps(_mm512_mul_ps(p, r), r, r), _mm512_set1_ps(1.0f));
  const __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(p, _mm512_castsi512_ps(bits));
}

/* `softmax_rows` 16 scores at a time (the loop there runs one score at a time: as long as the scores). */
static void fp32_softmax(float* scores, int64_t n, int64_t G, float* inv_sum) {
  for (int64_t g = 0; g < G; ++g) {
    float* sg = scores + g * n;
    __m512 top = _mm512_set1_ps(-INFINITY);
    for (int64_t i = 0; i < n; i += 16) {
      const __mmask16 m = n - i >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (n - i)) - 1u);
      top = _mm512_max_ps(_mm512_mask_loadu_ps(top, m, sg + i), top); /* a NaN score left out, as there */
    }
    const __m512 vtop = _mm512_set1_ps(_mm512_reduce_max_ps(top));
    __m512 sum = _mm512_setzero_ps();
    for (int64_t i = 0; i < n; i += 16) {
      const __mmask16 m = n - i >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (n - i)) - 1u);
      const __m512 e = _mm512_maskz_mov_ps(m, exp_nonpositive16(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, sg + i), vtop)));
      _mm512_mask_storeu_ps(sg + i, m, e);
      sum = _mm512_add_ps(sum, e);
    }
    inv_sum[g] = 1.f / _mm512_reduce_add_ps(sum); /* no visible key: 1 / 0, and the output NaN */
  }
}

/* The weighted sum of a head's values (fp32 rows, or bf16 ones widened: BF) for query heads g0..g0+GB-1
 * (probabilities p, n apart), D = 16 * CH, the GB x CH accumulators in registers (in memory, each FMA's sum waited
 * on a store and a load): out = (sum over keys in order of p * value, one FMA each) * inv_sum, NaN with no key. */
#define BLOCK_VALUES_FN(CH, GB, BF)                                                                             \
  static void block_values_##CH##_##GB##_##BF(const void* vh, int64_t v_row_stride, const int64_t* positions,   \
                                              int64_t n, const float* p, const float* inv_sum, float* out) {    \
    const int64_t size = BF ? 2 : 4;                                                                           \
    __m512 acc[GB][CH];                                                                                        \
    for (int g = 0; g < GB; ++g)                                                                               \
      for (int c = 0; c < CH; ++c) acc[g][c] = _mm512_setzero_ps();                                            \
    for (int64_t i = 0; i < n; ++i) {                                                                          \
      const char* row = (const char*)vh + (positions ? positions[i] : i) * v_row_stride * size;                \
      if (i + ATTENTION_PREFETCH < n) {                                                                        \
        const int64_t ahead = i + ATTENTION_PREFETCH;                                                          \
        const char* next = (const char*)vh + (positions ? positions[ahead] : ahead) * v_row_stride * size;     \
        for (int64_t b = 0; b < 16 * CH * size; b += 64) _mm_prefetch(next + b, _MM_HINT_T0);                 \
      }                                                                                                        \
      __m512 weight[GB];                                                                                       \
      for (int g = 0; g < GB; ++g) weight[g] = _mm512_set1_ps(p[g * n + i]);                                   \
      for (int c = 0; c < CH; ++c) {                                                                           \
        const __m512 v = row16(row, 16 * c, BF);                                                               \
        for (int g = 0; g < GB; ++g) acc[g][c] = _mm512_fmadd_ps(weight[g], v, acc[g][c]);                     \
      }                                                                                                        \
    }                                                                                                          \
    for (int g = 0; g < GB; ++g)                                                                               \
      for (int c = 0; c < CH; ++c)                                                                             \
        _mm512_storeu_ps(out + g * 16 * CH + 16 * c,                                                           \
                         n ? _mm512_mul_ps(acc[g][c], _mm512_set1_ps(inv_sum[g])) : _mm512_set1_ps(NAN));      \
  }
BLOCK_VALUES_FN(4, 4, 0) BLOCK_VALUES_FN(4, 2, 0) BLOCK_VALUES_FN(4, 1, 0)
BLOCK_VALUES_FN(8, 2, 0) BLOCK_VALUES_FN(8, 1, 0) BLOCK_VALUES_FN(16, 1, 0)
BLOCK_VALUES_FN(4, 4, 1) BLOCK_VALUES_FN(4, 2, 1) BLOCK_VALUES_FN(4, 1, 1)
BLOCK_VALUES_FN(8, 2, 1) BLOCK_VALUES_FN(8, 1, 1) BLOCK_VALUES_FN(16, 1, 1)

typedef void (*block_values_fn)(const void*, int64_t, const int64_t*, int64_t, const float*, const float*, float*);

/* The widest `block_values` for D, bf16 or fp32 rows and at most `left` query heads (NULL: D is not 64, 128 or
 * 256). */
static block_values_fn block_values_for(int64_t D, int bf16, int64_t left, int64_t* heads) {
  static const block_values_fn k64[2][3] = {{block_values_4_1_0, block_values_4_2_0, block_values_4_4_0},
                                            {block_values_4_1_1, block_values_4_2_1, block_values_4_4_1}};
  static const block_values_fn k128[2][2] = {{block_values_8_1_0, block_values_8_2_0},
                                             {block_values_8_1_1, block_values_8_2_1}};
  static const block_values_fn k256[2] = {block_values_16_1_0, block_values_16_1_1};
  bf16 = bf16 != 0;
  *heads = 1;
  if (D == 64) {
    *heads = left >= 4 ? 4 : left >= 2 ? 2 : 1;
    return k64[bf16][*heads == 4 ? 2 : *heads - 1];
  }
  if (D == 128) {
    *heads = left >= 2 ? 2 : 1;
    return k128[bf16][*heads - 1];
  }
  return D == 256 ? k256[bf16] : NULL;
}
#endif

/* The softmax of each query head's n scores in place (exp of the score minus the head's maximum), and 1 / sum. */
static void softmax_rows(float* scores, int64_t n, int64_t G, float* inv_sum) {
  for (int64_t g = 0; g < G; ++g) {
    float* sg = scores + g * n;
    float top = -INFINITY;
    for (int64_t i = 0; i < n; ++i) top = sg[i] > top ? sg[i] : top;
    float sum = 0.f;
#pragma omp simd reduction(+ : sum)
    for (int64_t i = 0; i < n; ++i) {
      sg[i] = exp_nonpositive(sg[i] - top);
      sum += sg[i];
    }
    inv_sum[g] = 1.f / sum; /* no visible key: 1 / 0, and the output NaN, as SDPA's */
  }
}

/* One key head of one row: its G query heads qh [G, D] (fp32) over n key positions (positions[i], or i where
 * positions is NULL), each key and value row read once (bf16 rows widened to fp32 first: the same arithmetic on
 * the same values); scores: G * n floats of work space; out [G, D] fp32. Rows of D = 64, 128 or 256 on AVX-512
 * take `block_scores` and `block_values` (the same sums, other code: the scores' lanes added in another order);
 * the rest one key at a time here. */
static void attend_one_head(const float* qh, const void* kh, const void* vh, int64_t k_row_stride,
                            int64_t v_row_stride, int bf16, const int64_t* positions, int64_t n, int64_t G,
                            int64_t D, float scale, float* scores, float* out) {
  float inv_sum[ATTENTION_MAX_GROUP];
#ifdef __AVX512F__
  int64_t heads;
  if (block_values_for(D, bf16, G, &heads) != NULL) {
    (bf16 ? block_scores_bf16 : block_scores_fp32)(qh, kh, k_row_stride, positions, n, G, D, scale, scores);
    fp32_softmax(scores, n, G, inv_sum);
    for (int64_t g = 0; g < G; g += heads)
      block_values_for(D, bf16, G - g, &heads)(vh, v_row_stride, positions, n, scores + g * n, inv_sum + g,
                                               out + g * D);
    return;
  }
#endif
  float widened[ATTENTION_MAX_D];
  for (int64_t i = 0; i < n; ++i) {
    const float* row = row_as_float(kh, positions ? positions[i] : i, k_row_stride, D, bf16, widened);
    for (int64_t g = 0; g < G; ++g) {
      const float* qg = qh + g * D;
      float dot = 0.f;
#pragma omp simd reduction(+ : dot)
      for (int64_t d = 0; d < D; ++d) dot += qg[d] * row[d];
      scores[g * n + i] = dot * scale;
    }
  }
  softmax_rows(scores, n, G, inv_sum);
  float acc[ATTENTION_MAX_GROUP][ATTENTION_MAX_D];
  for (int64_t g = 0; g < G; ++g)
    for (int64_t d = 0; d < D; ++d) acc[g][d] = 0.f;
  for (int64_t i = 0; i < n; ++i) {
    const float* row = row_as_float(vh, positions ? positions[i] : i, v_row_stride, D, bf16, widened);
    for (int64_t g = 0; g < G; ++g) {
      const float p = scores[g * n + i];
      float* a = acc[g];
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) a[d] += p * row[d];
    }
  }
  for (int64_t g = 0; g < G; ++g)
    for (int64_t d = 0; d < D; ++d) out[g * D + d] = n ? acc[g][d] * inv_sum[g] : NAN;
}

/* R rows, each one query position: q row r at q + r * q_row_stride ([Nq, D] contiguous); row r's key head h's
 * position s at k + r * k_batch_stride + h * k_head_stride + s * k_row_stride (values likewise; strides in
 * elements); mask: NULL (every position visible) or bytes, row r's at mask + r * mask_row_stride, nonzero =
 * visible (a stride of 0 shares one row). A masked position is skipped, not weighted by zero, so a row's output
 * is bit for bit the same alone (its visible positions only, no mask) and in any batch. kv_rows: NULL, or the KV row
 * each query row reads (row r's keys at k + kv_rows[r] * k_batch_stride ...: several query positions of one
 * sequence attend to its cache slot in place, each with its own mask row). out [R, Nq, D]. bf16:
 * 0 for fp32 q, k, v and out; 1 for all four in bf16, the arithmetic in fp32 as above on the widened values and
 * each output rounded to bf16 once (to nearest, ties to even). */
int omnimtp_decode_attention(const void* q, const void* k, const void* v, const uint8_t* mask, void* out,
                             int64_t num_rows, int64_t num_q_heads, int64_t num_kv_heads, int64_t S, int64_t D,
                             int64_t q_row_stride, int64_t k_batch_stride, int64_t k_head_stride,
                             int64_t k_row_stride, int64_t v_batch_stride, int64_t v_head_stride,
                             int64_t v_row_stride, int64_t mask_row_stride, float scale, int num_threads, int bf16,
                             const int64_t* kv_rows) {
  if (D > ATTENTION_MAX_D || num_kv_heads < 1 || num_q_heads % num_kv_heads) return -2;
  const int64_t G = num_q_heads / num_kv_heads;
  if (G > ATTENTION_MAX_GROUP) return -2;
  const int64_t tasks = num_rows * num_kv_heads;
  const int64_t span = S > 0 ? S : 1;
  const size_t size = bf16 ? sizeof(uint16_t) : sizeof(float);
  float* work = (float*)malloc(sizeof(float) * (size_t)(tasks * G * span));
  int64_t* positions = mask ? (int64_t*)malloc(sizeof(int64_t) * (size_t)(num_rows * span)) : NULL;
  int64_t* counts = mask ? (int64_t*)malloc(sizeof(int64_t) * (size_t)num_rows) : NULL;
  if (work == NULL || (mask && (positions == NULL || counts == NULL))) {
    free(work);
    free(positions);
    free(counts);
    return -1;
  }
  for (int64_t r = 0; mask && r < num_rows; ++r) /* each row's visible positions, in order */
    counts[r] = visible_positions(mask + r * mask_row_stride, S, positions + r * span);
  const int threads = num_threads > 1 && tasks > 1 ? num_threads : 1;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
  for (int64_t t = 0; t < tasks; ++t) {
    const int64_t r = t / num_kv_heads, h = t % num_kv_heads, first = (r * num_q_heads + h * G) * D;
    const int64_t kv_row = kv_rows ? kv_rows[r] : r;
    const char* qh = (const char*)q + (size_t)(r * q_row_stride + h * G * D) * size;
    float widened_q[ATTENTION_MAX_GROUP * ATTENTION_MAX_D], result[ATTENTION_MAX_GROUP * ATTENTION_MAX_D];
    for (int64_t j = 0; bf16 && j < G * D; ++j) widened_q[j] = bf16_to_float(((const uint16_t*)qh)[j]);
    attend_one_head(bf16 ? widened_q : (const float*)qh,
                    (const char*)k + (size_t)(kv_row * k_batch_stride + h * k_head_stride) * size,
                    (const char*)v + (size_t)(kv_row * v_batch_stride + h * v_head_stride) * size, k_row_stride,
                    v_row_stride, bf16, mask ? positions + r * span : NULL, mask ? counts[r] : S, G, D, scale,
                    work + t * G * span, bf16 ? result : (float*)out + first);
    for (int64_t j = 0; bf16 && j < G * D; ++j) ((uint16_t*)out)[first + j] = float_to_bf16(result[j]);
  }
  free(work);
  free(positions);
  free(counts);
  return 0;
}

/* ---------------------------------------------------------------------------------------------
 * A w4a8 decoder's decode step, every layer in one call: R rows, one new position each.
 *
 * Why: a decode step of a small decoder at batch 1 ran about 65 torch ops and 5 kernel calls a layer from Python;
 * at Qwen3-TTS's talker widths (28 layers of 8 MB of int4 weights) that overhead was as long as reading the
 * weights. Here one call runs every layer, its threads in one parallel region (a barrier between the stages of a
 * layer instead of a fork and a join per kernel call).
 *
 * Per layer (dense, pre-norm, as `omnimtp.runtime.decoder.decoder_layer` computes it): RMSNorm, the w4a8 q/k/v
 * matmul (+ bias), the per-head RMSNorm of queries and keys (qk_norm, optional), RoPE on queries and keys (full
 * rotary, rotate-half: x * cos + roll(x, D / 2) * signed_sin), the new key and value written into the cache,
 * attention over the row's visible keys (`attend_one_head`), the w4a8 output projection (+ bias) and residual,
 * RMSNorm, the w4a8 gate/up matmul, silu(gate) * up, the w4a8 down matmul and residual. The matmuls are
 * `omnimtp_w4a8_linear`'s (the same quantization of their inputs, the same panels); the norms, RoPE and SiLU are
 * computed here in fp32 (equal to torch's up to rounding). Each row is computed on its own: a row's values are the
 * same alone and in any batch.
 *
 * x [R, H] holds the step's input embeddings and gets the last layer's output (before the final norm).
 * kv_bf16: the cache holds bf16 (each new key and value rounded to nearest, ties to even, as torch's conversion;
 * attention widens the rows as it reads them, its arithmetic in fp32), else fp32; strides stay in elements.
 * weights: STEP_WEIGHTS pointers a layer (see below; 0 for an absent bias or qk_norm); kv: the layer's keys and
 * values, 2 pointers a layer, each [B, Nkv, S, D] with strides (slot, head, column) in elements; row r writes its
 * key and value at slot slots[r], column columns[r], and attends to columns 0..n-1 of its slot (n = row_keys[r],
 * or num_keys for every row when row_keys is NULL), those with a nonzero byte in mask (row r's at mask + r *
 * mask_row_stride) when mask is not NULL. Every row's key and value are written before any row attends, so
 * several positions of one sequence may come as rows of one slot (a causal block: row_keys = columns + 1).
 * cos, signed_sin: [R, D].
 * groups: the group sizes of the matrices whose inputs are H, Nq * D and I wide. Returns 0, -1 when out of memory,
 * -2 for D > 256, an odd D or a group of more than 16 query heads, -3 for a group size that does not divide its
 * inputs in words of 8. */
#define STEP_WEIGHTS 13 /* input_norm, qkv words, scales, bias, qk_norm, o words, scales, bias, post_norm, gate_up
                           words, scales, down words, scales */

static void step_rms_norm(const float* x, const float* weight, int64_t n, float eps, float* out) {
  float sum = 0.f;
  for (int64_t i = 0; i < n; ++i) sum += x[i] * x[i];
  const float inv = 1.f / sqrtf(sum / (float)n + eps);
  for (int64_t i = 0; i < n; ++i) out[i] = x[i] * inv * weight[i];
}

static void step_quantize(const float* x, int64_t R, int64_t K, int64_t group, int8_t* xq, int32_t* xsum,
                          float* xscale) {
  const int64_t groups = K / group, kw = 8 * ((K + 7) / 8);
  for (int64_t m = 0; m < R; ++m) {
    for (int64_t g = 0; g < groups; ++g)
      w4a8_quantize_group(x + m * K + g * group, group, g * group, xq + m * kw, xsum + m * groups + g,
                          xscale + m * groups + g);
    for (int64_t k = K; k < kw; ++k) xq[m * kw + (k & ~7) + kSlot[k & 7]] = 0;
  }
}

/* out[i] = silu(gate[i]) * up[i] for i in i0..i1-1: gate * sigmoid(gate), the sigmoid from e = exp(-|gate|) (1 / (1 +
 * e), or e / (1 + e) for a negative gate), 16 lanes at a time on AVX-512 (libm's expf one value at a time was most
 * of a layer's work outside its matmuls, on one thread while the other waited); the rest with expf. The step runs
 * it a quantization group at a time, so a value's code (vector or not) depends on the group size alone. */
static void step_silu_mul(const float* gate, const float* up, int64_t i0, int64_t i1, float* out) {
  int64_t i = i0;
#ifdef __AVX512F__
  const __m512 one = _mm512_set1_ps(1.0f);
  const __m512i sign = _mm512_set1_epi32((int32_t)0x80000000u);
  for (; i + 16 <= i1; i += 16) {
    const __m512 g = _mm512_loadu_ps(gate + i);
    const __m512 minus_abs = _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(g), sign));
    const __m512 e = exp_nonpositive16(minus_abs);
    const __m512 inv = _mm512_div_ps(one, _mm512_add_ps(one, e));
    const __mmask16 negative = _mm512_cmp_ps_mask(g, _mm512_setzero_ps(), _CMP_LT_OQ);
    const __m512 sigmoid = _mm512_mask_mul_ps(inv, negative, e, inv);
    _mm512_storeu_ps(out + i, _mm512_mul_ps(_mm512_mul_ps(g, sigmoid), _mm512_loadu_ps(up + i)));
  }
#endif
  for (; i < i1; ++i) out[i] = gate[i] / (1.f + expf(-gate[i])) * up[i];
}

/* y [R, N] = the quantized rows @ W.T, the panels shared by the team's threads (an orphaned `omp for`). */
static void step_matmul(const int8_t* xq, const int32_t* xsum, const float* xscale, int64_t words, int64_t scales,
                        float* y, int64_t R, int64_t K, int64_t N, int64_t group, int vnni) {
  const int64_t panels = (N + PANEL - 1) / PANEL;
  const w4a8_args args = {xq, xsum, xscale, (const int32_t*)(intptr_t)words, (const float*)(intptr_t)scales, y,
                          K, N, group, K / group, (K + 7) / 8};
#pragma omp for schedule(static)
  for (int64_t p = 0; p < panels; ++p) w4a8_panel(&args, R, p, vnni);
}

static int step_group_ok(int64_t K, int64_t group) {
  return group >= 1 && K % group == 0 && (K / group == 1 || group % 8 == 0);
}

int omnimtp_w4a8_decode_step(float* x, int64_t R, int64_t H, int64_t L, const int64_t* weights, const int64_t* kv,
                             int64_t Nq, int64_t Nkv, int64_t D, int64_t I, int64_t group_h, int64_t group_o,
                             int64_t group_i, float eps, const float* cos, const float* signed_sin,
                             const int64_t* slots, const int64_t* columns, int64_t num_keys,
                             const int64_t* row_keys, int64_t slot_stride,
                             int64_t head_stride, int64_t column_stride, const uint8_t* mask, int64_t mask_row_stride,
                             float scale, int num_threads, int vnni, int kv_bf16) {
  if (D > ATTENTION_MAX_D || D % 2 || Nkv < 1 || Nq % Nkv || Nq / Nkv > ATTENTION_MAX_GROUP) return -2;
  if (!step_group_ok(H, group_h) || !step_group_ok(Nq * D, group_o) || !step_group_ok(I, group_i)) return -3;
  if (vnni < 0) vnni = has_vnni();
  else if (vnni && !has_vnni()) return -2;
  const int64_t G = Nq / Nkv, heads = Nq + 2 * Nkv, Nqkv = heads * D, half = D / 2;
  const int64_t groups_i = I / group_i, kw_i = 8 * ((I + 7) / 8); /* the down projection's input groups */
  const int64_t kv_size = kv_bf16 ? 2 : 4; /* bytes a cached value */
  int64_t widest = H > Nq * D ? H : Nq * D;
  widest = widest > I ? widest : I;
  const int64_t out_width = H > 2 * I ? H : 2 * I, span = num_keys > 0 ? num_keys : 1;
  const int64_t kw = 8 * ((widest + 7) / 8), max_groups = widest; /* at most one group per input */
  float* normed = (float*)malloc(sizeof(float) * (size_t)(R * widest));
  int8_t* xq = (int8_t*)malloc((size_t)(R * kw + 1));
  int32_t* xsum = (int32_t*)malloc(sizeof(int32_t) * (size_t)(R * max_groups));
  float* xscale = (float*)malloc(sizeof(float) * (size_t)(R * max_groups));
  float* qkv = (float*)malloc(sizeof(float) * (size_t)(R * Nqkv));
  float* attn = (float*)malloc(sizeof(float) * (size_t)(R * Nq * D));
  float* out = (float*)malloc(sizeof(float) * (size_t)(R * out_width));
  float* work = (float*)malloc(sizeof(float) * (size_t)(R * Nkv * G * span));
  int64_t* positions = mask ? (int64_t*)malloc(sizeof(int64_t) * (size_t)(R * span)) : NULL;
  int64_t* counts = (int64_t*)malloc(sizeof(int64_t) * (size_t)R);
  int status = 0;
  if (!normed || !xq || !xsum || !xscale || !qkv || !attn || !out || !work || !counts || (mask && !positions)) {
    status = -1;
    goto done;
  }
  for (int64_t r = 0; r < R; ++r) { /* each row's visible columns, in order */
    counts[r] = row_keys ? row_keys[r] : num_keys;
    if (mask) counts[r] = visible_positions(mask + r * mask_row_stride, counts[r], positions + r * span);
  }
  const int threads = num_threads > 1 ? num_threads : 1;
#pragma omp parallel num_threads(threads) if (threads > 1)
  for (int64_t l = 0; l < L; ++l) {
    const int64_t* w = weights + l * STEP_WEIGHTS;
    char* keys = (char*)(intptr_t)kv[2 * l];
    char* values = (char*)(intptr_t)kv[2 * l + 1];
    const float* qkv_bias = (const float*)(intptr_t)w[3];
    const float* qk_norm = (const float*)(intptr_t)w[4];
    const float* o_bias = (const float*)(intptr_t)w[7];
#pragma omp single
    {
      for (int64_t r = 0; r < R; ++r) step_rms_norm(x + r * H, (const float*)(intptr_t)w[0], H, eps, normed + r * H);
      step_quantize(normed, R, H, group_h, xq, xsum, xscale);
    }
    step_matmul(xq, xsum, xscale, w[1], w[2], qkv, R, H, Nqkv, group_h, vnni);
#pragma omp for schedule(static)
    for (int64_t t = 0; t < R * heads; ++t) { /* bias, qk norm and RoPE of one head; keys and values cached */
      const int64_t r = t / heads, h = t % heads;
      float* v = qkv + r * Nqkv + h * D;
      if (qkv_bias)
        for (int64_t d = 0; d < D; ++d) v[d] += qkv_bias[h * D + d];
      if (h < Nq + Nkv) {
        if (qk_norm) step_rms_norm(v, qk_norm + h * D, D, eps, v);
        float rotated[ATTENTION_MAX_D];
        const float* c = cos + r * D;
        const float* s = signed_sin + r * D;
        for (int64_t d = 0; d < D; ++d) rotated[d] = v[d] * c[d] + v[(d + half) % D] * s[d];
        memcpy(v, rotated, sizeof(float) * (size_t)D);
      }
      if (h >= Nq) {
        const int64_t kv_head = h < Nq + Nkv ? h - Nq : h - Nq - Nkv;
        char* cache = (h < Nq + Nkv ? keys : values) +
                      (slots[r] * slot_stride + kv_head * head_stride + columns[r] * column_stride) * kv_size;
        if (kv_bf16)
          for (int64_t d = 0; d < D; ++d) ((uint16_t*)cache)[d] = float_to_bf16(v[d]);
        else
          memcpy(cache, v, sizeof(float) * (size_t)D);
      }
    }
#pragma omp for schedule(static)
    for (int64_t t = 0; t < R * Nkv; ++t) {
      const int64_t r = t / Nkv, h = t % Nkv;
      attend_one_head(qkv + r * Nqkv + h * G * D, keys + (slots[r] * slot_stride + h * head_stride) * kv_size,
                      values + (slots[r] * slot_stride + h * head_stride) * kv_size, column_stride, column_stride,
                      kv_bf16, mask ? positions + r * span : NULL, counts[r], G, D, scale, work + t * G * span,
                      attn + r * Nq * D + h * G * D);
    }
#pragma omp single
    step_quantize(attn, R, Nq * D, group_o, xq, xsum, xscale);
    step_matmul(xq, xsum, xscale, w[5], w[6], out, R, Nq * D, H, group_o, vnni);
#pragma omp single
    {
      for (int64_t r = 0; r < R; ++r) {
        float* xr = x + r * H;
        for (int64_t i = 0; i < H; ++i) xr[i] += o_bias ? out[r * H + i] + o_bias[i] : out[r * H + i];
        step_rms_norm(xr, (const float*)(intptr_t)w[8], H, eps, normed + r * H);
      }
      step_quantize(normed, R, H, group_h, xq, xsum, xscale);
    }
    step_matmul(xq, xsum, xscale, w[9], w[10], out, R, H, 2 * I, group_h, vnni);
#pragma omp for schedule(static)
    for (int64_t t = 0; t < R * groups_i; ++t) { /* silu(gate) * up of a (row, group) pair, then its quantization */
      const int64_t r = t / groups_i, g = t % groups_i, i0 = g * group_i;
      step_silu_mul(out + r * 2 * I, out + r * 2 * I + I, i0, i0 + group_i, normed + r * I);
      w4a8_quantize_group(normed + r * I + i0, group_i, i0, xq + r * kw_i, xsum + r * groups_i + g,
                          xscale + r * groups_i + g);
      for (int64_t k = I; g == groups_i - 1 && k < kw_i; ++k) xq[r * kw_i + (k & ~7) + kSlot[k & 7]] = 0;
    }
    step_matmul(xq, xsum, xscale, w[11], w[12], out, R, I, H, group_i, vnni);
#pragma omp single
    for (int64_t i = 0; i < R * H; ++i) x[i] += out[i];
  }
done:
  free(normed);
  free(xq);
  free(xsum);
  free(xscale);
  free(qkv);
  free(attn);
  free(out);
  free(work);
  free(positions);
  free(counts);
  return status;
}
