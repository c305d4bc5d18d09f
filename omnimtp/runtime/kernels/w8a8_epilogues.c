/* The elementwise work between the int8 GEMMs of a "w8a8" decoder layer of many rows (a prompt's forward: Qwen3-ASR's
 * prefill, the forced aligner's one forward), each stretch as one pass that reads and writes a row once.
 *
 * Why: oneDNN's int8 GEMM leaves each row's exact sums times the column's weight scale; what follows it (the row's
 * own scale, a bias, the residual add, the next RMSNorm, SiLU-gated up, the q/k norm and RoPE, and the next GEMM's
 * row quantization to bytes) ran as a dozen torch ops, each a pass over [rows, 1024..6144] fp32 tensors: about a
 * third of the GEMMs' time on a 2-core AMD EPYC. Here a row stays in L1 between the steps.
 *
 * Passes (rows split over the threads; `sums` is the GEMM's output [N, width] fp32, `row_scales` [N] each row's
 * quantization scale):
 *   omnimtp_w8a8_residual_norm:  x = residual + (sums * row_scale + bias), written over sums; then, given a norm
 *                                weight, RMSNorm(x) * weight quantized to bytes for the next GEMM;
 *   omnimtp_w8a8_gated:          silu(gate * row_scale) * (up * row_scale) quantized to bytes (gate, up: the two
 *                                halves of a row of sums);
 *   omnimtp_w8a8_attention_inputs: sums * row_scale + bias in place; the query and key heads then RMSNormed per
 *                                head (times their weight) and rotated (RoPE), the value heads left as they are.
 *
 * Numerics: the values of the torch ops they replace (`omnimtp.runtime.ops`: `rms_norm`, `apply_rope`, `F.silu`,
 * `small_batch_linear.quantize_rows_u8`), op by op in the same order with each product and sum rounded to fp32 (no
 * contraction into FMAs), except the order of a row's sum of squares and SiLU's exp (within an ulp of expf).
 * Quantized bytes follow `quantize_rows_u8`: scale = max|v| / 127, byte = 128 + round(v * (127 / max|v|)) (ties to
 * even, clamped to -127..127); an all-zero row gives 128s and scale 0, one with a NaN or an infinity 128s and a NaN
 * scale. A row's values depend on that row only.
 */
#pragma GCC optimize("fp-contract=off")
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

#define ISA "avx512f,avx512bw,avx512vl,avx512dq"
#define TARGET __attribute__((target(ISA)))
#define INLINE static inline __attribute__((always_inline, target(ISA)))
#define MAX_HEAD_DIM 256

int omnimtp_w8a8_epilogues_supported(void) {
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
}

static int threads_for(int64_t rows, int num_threads) { return num_threads > 1 && rows > 1 ? num_threads : 1; }

/* lanes of the first n - k (< 16) elements */
INLINE __mmask16 tail_mask(int64_t n, int64_t k) { return (__mmask16)((1u << (n - k)) - 1u); }

/* sum of v[0..n-1]² in fp32 (16 lanes, then the lanes in order) */
INLINE float sum_of_squares(const float* v, int64_t n) {
  __m512 acc = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 16 <= n; k += 16) {
    const __m512 x = _mm512_loadu_ps(v + k);
    acc = _mm512_add_ps(acc, _mm512_mul_ps(x, x));
  }
  if (k < n) {
    const __m512 x = _mm512_maskz_loadu_ps(tail_mask(n, k), v + k);
    acc = _mm512_add_ps(acc, _mm512_mul_ps(x, x));
  }
  return _mm512_reduce_add_ps(acc);
}

/* v[0..n-1] (fp32, in a row buffer) → bytes q and *scale as `quantize_rows_u8` makes them */
INLINE void quantize_row(const float* v, int64_t n, uint8_t* q, float* scale) {
  const __m512 sign = _mm512_set1_ps(-0.0f);
  __m512 vmax = _mm512_setzero_ps();
  __mmask16 nan = 0;
  int64_t k = 0;
  for (; k + 16 <= n; k += 16) {
    const __m512 x = _mm512_loadu_ps(v + k);
    vmax = _mm512_max_ps(vmax, _mm512_andnot_ps(sign, x));
    nan |= _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
  }
  if (k < n) {
    const __mmask16 m = tail_mask(n, k);
    const __m512 x = _mm512_maskz_loadu_ps(m, v + k);
    vmax = _mm512_max_ps(vmax, _mm512_andnot_ps(sign, x));
    nan |= _mm512_mask_cmp_ps_mask(m, x, x, _CMP_UNORD_Q);
  }
  const float amax = _mm512_reduce_max_ps(vmax);
  if (nan || !(amax <= 3.4028234663852886e38f) || amax == 0.0f) {
    memset(q, 128, (size_t)n);
    *scale = amax == 0.0f && !nan ? 0.0f : __builtin_nanf("");
    return;
  }
  const __m512 inv = _mm512_set1_ps(127.0f / amax);
  const __m512i lo = _mm512_set1_epi32(-127), hi = _mm512_set1_epi32(127), zero_point = _mm512_set1_epi32(128);
  for (k = 0; k < n; k += 16) {
    const __mmask16 m = k + 16 <= n ? (__mmask16)0xFFFF : tail_mask(n, k);
    __m512i r = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_maskz_loadu_ps(m, v + k), inv)); /* to nearest, even */
    r = _mm512_add_epi32(_mm512_min_epi32(_mm512_max_epi32(r, lo), hi), zero_point);   /* 1..255 */
    _mm_mask_storeu_epi8(q + k, m, _mm512_cvtepi32_epi8(r));
  }
  *scale = amax / 127.0f;
}

/* out[k] = sums[k] * scale (+ bias[k]) (+ residual[k]) for k < n; out may be sums */
INLINE void scale_row(const float* sums, float scale, const float* bias, const float* residual, float* out,
                      int64_t n) {
  const __m512 s = _mm512_set1_ps(scale);
  for (int64_t k = 0; k < n; k += 16) {
    const __mmask16 m = k + 16 <= n ? (__mmask16)0xFFFF : tail_mask(n, k);
    __m512 x = _mm512_mul_ps(_mm512_maskz_loadu_ps(m, sums + k), s);
    if (bias) x = _mm512_add_ps(x, _mm512_maskz_loadu_ps(m, bias + k));
    if (residual) x = _mm512_add_ps(_mm512_maskz_loadu_ps(m, residual + k), x);
    _mm512_mask_storeu_ps(out + k, m, x);
  }
}

/* out[k] = (x[k] * r) * weight[k] (weight NULL: x[k] * r), r = 1 / sqrt(sum x² / n + eps): `ops.rms_norm`'s order */
INLINE void rms_norm_row(const float* x, const float* weight, float eps, float* out, int64_t n) {
  const float r = 1.0f / sqrtf(sum_of_squares(x, n) / (float)n + eps);
  const __m512 vr = _mm512_set1_ps(r);
  for (int64_t k = 0; k < n; k += 16) {
    const __mmask16 m = k + 16 <= n ? (__mmask16)0xFFFF : tail_mask(n, k);
    __m512 y = _mm512_mul_ps(_mm512_maskz_loadu_ps(m, x + k), vr);
    if (weight) y = _mm512_mul_ps(y, _mm512_maskz_loadu_ps(m, weight + k));
    _mm512_mask_storeu_ps(out + k, m, y);
  }
}

/* Rows n < N of sums [N, H] (row stride H): x = residual + (sums * row_scales[n] + bias) written over sums (residual
 * NULL: no add; row_scales NULL: sums as they are, left unwritten: a layer's first norm of its input); then with
 * norm_weight [H], RMSNorm(x) * norm_weight quantized into q [N, H] and q_scales [N]. */
TARGET void omnimtp_w8a8_residual_norm(float* sums, int64_t N, int64_t H, const float* row_scales, const float* bias,
                                       const float* residual, const float* norm_weight, float eps, uint8_t* q,
                                       float* q_scales, float* row_buffer, int num_threads) {
  const int threads = threads_for(N, num_threads);
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
  for (int64_t n = 0; n < N; ++n) {
    float* x = sums + n * H;
    if (row_scales) scale_row(x, row_scales[n], bias, residual ? residual + n * H : NULL, x, H);
    if (norm_weight) {
      float* normed = row_buffer + (int64_t)omp_get_thread_num() * H;
      rms_norm_row(x, norm_weight, eps, normed, H);
      quantize_row(normed, H, q + n * H, q_scales + n);
    }
  }
}

/* exp(x), 16 lanes (Cephes' expf: x = n ln 2 + r, a degree-6 polynomial in r, times 2^n; within an ulp of expf,
 * x clamped to [-87.3, 88.7]) */
INLINE __m512 exp16(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.3f)), _mm512_set1_ps(88.7f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  return _mm512_scalef_ps(p, n);
}

/* Rows n < N of sums [N, 2I] ([gate | up]): h = silu(gate * s) * (up * s), s = row_scales[n], as `F.silu(g) * u`
 * (silu(g) = g / (1 + exp(-g))), written over the gate half, then quantized into q [N, I] and q_scales [N]. */
TARGET void omnimtp_w8a8_gated(float* sums, int64_t N, int64_t I, const float* row_scales, uint8_t* q,
                               float* q_scales, int num_threads) {
  const int threads = threads_for(N, num_threads);
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
  for (int64_t n = 0; n < N; ++n) {
    float* gate = sums + n * 2 * I;
    const float* up = gate + I;
    const __m512 s = _mm512_set1_ps(row_scales[n]), one = _mm512_set1_ps(1.0f), sign = _mm512_set1_ps(-0.0f);
    for (int64_t k = 0; k < I; k += 16) {
      const __mmask16 m = k + 16 <= I ? (__mmask16)0xFFFF : tail_mask(I, k);
      const __m512 g = _mm512_mul_ps(_mm512_maskz_loadu_ps(m, gate + k), s);
      const __m512 u = _mm512_mul_ps(_mm512_maskz_loadu_ps(m, up + k), s);
      const __m512 silu = _mm512_div_ps(g, _mm512_add_ps(one, exp16(_mm512_xor_ps(g, sign))));
      _mm512_mask_storeu_ps(gate + k, m, _mm512_mul_ps(silu, u));
    }
    quantize_row(gate, I, q + n * I, q_scales + n);
  }
}

/* Rows n < N of sums [N, (Nq + 2 Nkv) D] (heads of D channels: Nq query heads, Nkv key heads, Nkv value heads), in
 * place: v = sums * row_scales[n] (+ bias); each query and key head j then, with qk_norm [Nq + Nkv, D], RMSNormed
 * (v * r) times qk_norm[j] (as `rms_norm` with a weight per head: the weight times the normed value), and rotated:
 * out[d] = v[d] * cos[d] + v[partner[d]] * signed_sin[d] (`apply_rope`), cos and signed_sin [D] of row n at
 * tables + (n / T) * table_row_stride + (n % T) * D (table_row_stride 0: the rows share positions). */
TARGET void omnimtp_w8a8_attention_inputs(float* sums, int64_t N, int64_t num_heads, int64_t num_kv_heads,
                                          int64_t D, const float* row_scales, const float* bias, const float* qk_norm,
                                          float eps, const float* cos, const float* signed_sin, int64_t T,
                                          int64_t table_row_stride, const int64_t* partner, int num_threads) {
  const int threads = threads_for(N, num_threads);
  const int64_t num_qk = num_heads + num_kv_heads, width = (num_qk + num_kv_heads) * D, half = D / 2;
  int is_roll = D % 2 == 0;
  for (int64_t d = 0; d < D && is_roll; ++d) is_roll = partner[d] == (d + half) % D;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
  for (int64_t n = 0; n < N; ++n) {
    float* row = sums + n * width;
    const int64_t at = (n / T) * table_row_stride + (n % T) * D;
    const float *c = cos + at, *s = signed_sin + at;
    float v[MAX_HEAD_DIM];
    scale_row(row, row_scales[n], bias, NULL, row, width);
    for (int64_t j = 0; j < num_qk; ++j) {
      float* head = row + j * D;
      if (qk_norm) {
        rms_norm_row(head, NULL, eps, v, D);
        for (int64_t d = 0; d < D; ++d) v[d] = qk_norm[j * D + d] * v[d];
      } else {
        memcpy(v, head, sizeof(float) * (size_t)D);
      }
      if (is_roll) {
        for (int64_t d = 0; d < half; ++d) head[d] = v[d] * c[d] + v[d + half] * s[d];
        for (int64_t d = half; d < D; ++d) head[d] = v[d] * c[d] + v[d - half] * s[d];
      } else {
        for (int64_t d = 0; d < D; ++d) head[d] = v[d] * c[d] + v[partner[d]] * s[d];
      }
    }
  }
}
