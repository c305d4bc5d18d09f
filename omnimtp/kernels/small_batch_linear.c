/* fp32 y[M, N] = x[M, K] @ W[N, K]^T for a few rows M, on a CPU with AVX-512F.
 *
 * Why: at a batch of a few rows a linear layer is bound by reading its weights from memory, and a
 * general SGEMM (MKL's, packed or not) streams them well below one core's read bandwidth once it does
 * several rows of FMAs per weight: the FMAs fill the out-of-order window, fewer cache-line reads are
 * in flight, and the hardware prefetcher stops at every 4 KiB page. Here the weights are one
 * sequential stream, packed as [ceil(N/16)][K][16] (panels of 16 output columns, zero padded), and
 * the loop prefetches that stream ahead into L1 and, further ahead, into L2. Per input k the kernel
 * loads one 64-byte panel row and broadcasts x[m, k] for every row m (outer-product form: no
 * horizontal sums, and x is read once per panel row instead of once per weight vector).
 *
 * Numerics: each output is summed with fused multiply-adds in k order; it equals F.linear up to fp32
 * rounding, not bit for bit. Rows are independent: row m's output does not depend on the other rows
 * or on M.
 */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>

#define PANEL 16         /* output columns per panel: one AVX-512 register */
#define PREFETCH_L1 512  /* floats ahead in the stream (2 KiB: 32 panel rows) */
#define PREFETCH_L2 4096 /* floats ahead (16 KiB) */

/* One panel for M rows: M accumulators. xt is x transposed, [K][M]. */
#define PANEL_FN(M)                                                                                    \
  static void panel_##M(const float* xt, const float* w, float* y, int64_t K, int64_t N, int64_t col, \
                        __mmask16 mask) {                                                             \
    __m512 acc[M];                                                                                    \
    for (int m = 0; m < M; ++m) acc[m] = _mm512_setzero_ps();                                         \
    for (int64_t k = 0; k < K; ++k, w += PANEL, xt += M) {                                           \
      _mm_prefetch((const char*)(w + PREFETCH_L1), _MM_HINT_T0);                                      \
      _mm_prefetch((const char*)(w + PREFETCH_L2), _MM_HINT_T1);                                      \
      const __m512 v = _mm512_loadu_ps(w);                                                            \
      for (int m = 0; m < M; ++m) acc[m] = _mm512_fmadd_ps(v, _mm512_set1_ps(xt[m]), acc[m]);         \
    }                                                                                                 \
    for (int m = 0; m < M; ++m) _mm512_mask_storeu_ps(y + m * N + col, mask, acc[m]);                 \
  }

PANEL_FN(1) PANEL_FN(2) PANEL_FN(3) PANEL_FN(4) PANEL_FN(5) PANEL_FN(6) PANEL_FN(7) PANEL_FN(8)
PANEL_FN(9) PANEL_FN(10) PANEL_FN(11) PANEL_FN(12) PANEL_FN(13) PANEL_FN(14) PANEL_FN(15) PANEL_FN(16)

typedef void (*panel_fn)(const float*, const float*, float*, int64_t, int64_t, int64_t, __mmask16);
static const panel_fn kPanelFns[17] = {
    0,        panel_1,  panel_2,  panel_3,  panel_4,  panel_5,  panel_6,  panel_7,  panel_8,
    panel_9,  panel_10, panel_11, panel_12, panel_13, panel_14, panel_15, panel_16,
};

static __mmask16 first_n(int64_t n) { /* mask of the first n (clamped to 0..16) lanes */
  return n <= 0 ? 0 : n >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << n) - 1u);
}

/* x [M, K] row-major, packed as described above, y [M, N] row-major; any M >= 0 (passes of 16 rows,
 * each reads the weights once). Splits the panels over `num_threads` OpenMP threads. Returns 0, or -1
 * when out of memory. */
int omnimtp_small_batch_linear(const float* x, const float* packed, float* y, int64_t M, int64_t K, int64_t N,
                               int num_threads) {
  const int64_t panels = (N + PANEL - 1) / PANEL;
  const int64_t max_rows = M < 16 ? M : 16;
  float* xt = malloc(sizeof(float) * (size_t)(K * max_rows + 1));
  if (xt == NULL) return -1;
  for (int64_t m0 = 0; m0 < M; m0 += 16) {
    const int64_t rows = M - m0 < 16 ? M - m0 : 16;
    for (int64_t m = 0; m < rows; ++m)
      for (int64_t k = 0; k < K; ++k) xt[k * rows + m] = x[(m0 + m) * K + k];
    const panel_fn fn = kPanelFns[rows];
    float* ym = y + m0 * N;
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t p = 0; p < panels; ++p) {
      const int64_t col = p * PANEL;
      fn(xt, packed + p * K * PANEL, ym, K, N, col, first_n(N - col));
    }
  }
  free(xt);
  return 0;
}
