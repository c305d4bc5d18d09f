/* The output pass of an audio encoder's int8 GEMM (a "w8a8" linear or convolution): each exact int32 sum, already
 * times its column's weight scale in fp32 (oneDNN's output), times its row's scale, plus the column's bias, through
 * GELU where the model applies one next, written in the dtype the next op reads (fp32, or bf16 rows a convolution's
 * patches are gathered from).
 *
 * Why: done as torch ops these are three or four passes over the widest rows of the encoder (a row-scale multiply,
 * a bias add, GELU, a cast), each reading and writing every element; here it is one pass, the values kept in
 * registers between the steps.
 *
 * Numerics: the multiply and the add are rounded separately (no fused multiply-add: `_mm512_mul_round_ps` and
 * `_mm512_add_round_ps` are never contracted), as torch's `mul_` then `add_` round them, so the values before GELU
 * are bit for bit those ops'. GELU is the exact (erf) one, 0.5 x (1 + erf(x / sqrt 2)), with erf by Abramowitz &
 * Stegun 7.1.26 (|error| <= 1.5e-7 absolute) and the exp of -x^2 within 1 ulp of expf: within 5e-7 of the float64
 * GELU for |x| up to 15 (torch's fp32 `F.gelu` on this CPU: within 1.2e-6; tests/test_encoder_epilogue.py). bf16 output:
 * rounded once, to nearest, ties to even (a NaN as 0x7FC0: torch's conversion). Each row is computed on its own:
 * its values do not depend on the other rows.
 *
 * Where the next op is another int8 GEMM (fc1 → GELU → fc2), `omnimtp_encoder_epilogue_u8` hands it its input
 * quantized: each row's fp32 values kept in a buffer of its thread, then rounded to int8 over the row as
 * `small_batch_linear.c`'s `omnimtp_quantize_rows_u8` rounds them (the same bytes and scale), never written out in
 * fp32.
 */
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define EPILOGUE_ISA "avx512f,avx512dq"
#define EPILOGUE_TARGET __attribute__((target(EPILOGUE_ISA)))
#define INLINE_EPILOGUE static inline __attribute__((always_inline, target(EPILOGUE_ISA)))
#define ROUND_NEAREST (_MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)

int omnimtp_encoder_epilogue_supported(void) {
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq");
}

/* exp(x) for x <= 0, 16 lanes (Cephes' expf, as `bf16_attention.c`'s: within 1 ulp of expf over [-87, 0]). Below
 * -87 it gives exp(-87) ~ 1.6e-38. */
INLINE_EPILOGUE __m512 exp_nonpositive16(__m512 x) {
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
  return _mm512_scalef_ps(p, n);
}

/* 0.5 x (1 + erf(x / sqrt 2)), 16 lanes; erf(z) = sign(z) (1 - t (p1 + t (p2 + t (p3 + t (p4 + t p5)))) e^(-z^2)),
 * t = 1 / (1 + p |z|). A NaN or an infinity gives a NaN (as torch's `F.gelu` does). */
INLINE_EPILOGUE __m512 gelu16(__m512 x) {
  const __m512 one = _mm512_set1_ps(1.0f), negative_zero = _mm512_set1_ps(-0.0f);
  const __m512 z = _mm512_mul_ps(x, _mm512_set1_ps(0.70710678118654752440f));
  const __m512 sign = _mm512_and_ps(z, negative_zero);
  /* t = 1 / d: the reciprocal estimate (14 bits) and a Newton step (~28 bits, within 1 ulp): no division */
  const __m512 d = _mm512_fmadd_ps(_mm512_set1_ps(0.3275911f), _mm512_abs_ps(z), one);
  const __m512 estimate = _mm512_rcp14_ps(d);
  const __m512 t = _mm512_fmadd_ps(estimate, _mm512_fnmadd_ps(d, estimate, one), estimate);
  __m512 r = _mm512_fmadd_ps(_mm512_set1_ps(1.061405429f), t, _mm512_set1_ps(-1.453152027f));
  r = _mm512_fmadd_ps(r, t, _mm512_set1_ps(1.421413741f));
  r = _mm512_fmadd_ps(r, t, _mm512_set1_ps(-0.284496736f));
  r = _mm512_fmadd_ps(r, t, _mm512_set1_ps(0.254829592f));
  const __m512 e = exp_nonpositive16(_mm512_xor_ps(negative_zero, _mm512_mul_ps(z, z)));
  const __m512 erf = _mm512_xor_ps(sign, _mm512_fmadd_ps(_mm512_mul_ps(_mm512_xor_ps(negative_zero, e), t), r, one));
  return _mm512_mul_ps(_mm512_mul_ps(x, _mm512_set1_ps(0.5f)), _mm512_add_ps(one, erf));
}

/* 16 fp32 → 16 bf16 (in the low half of each 32-bit lane), to nearest, ties to even; NaN → 0x7FC0. */
INLINE_EPILOGUE __m512i to_bf16(__m512 x) {
  const __m512i bits = _mm512_castps_si512(x);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(bits, _mm512_set1_epi32(0x7FFF)), lsb), 16);
  const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
  return _mm512_mask_mov_epi32(rounded, nan, _mm512_set1_epi32(0x7FC0));
}

/* 16 columns of a row (the first `lanes` of them): gelu?(sums * scale + bias) stored at element `at` of out. */
INLINE_EPILOGUE void epilogue16(const float* sums, __m512 scale, const float* bias, int gelu, void* out, int64_t at,
                                int out_bf16, __mmask16 lanes) {
  const int whole = lanes == 0xFFFF;
  __m512 y = _mm512_mul_round_ps(whole ? _mm512_loadu_ps(sums) : _mm512_maskz_loadu_ps(lanes, sums), scale,
                                 ROUND_NEAREST);
  if (bias)
    y = _mm512_add_round_ps(y, whole ? _mm512_loadu_ps(bias) : _mm512_maskz_loadu_ps(lanes, bias), ROUND_NEAREST);
  if (gelu) y = gelu16(y);
  if (out_bf16 && whole)
    _mm256_storeu_si256((__m256i*)((uint16_t*)out + at), _mm512_cvtepi32_epi16(to_bf16(y)));
  else if (out_bf16)
    _mm512_mask_cvtepi32_storeu_epi16((uint16_t*)out + at, lanes, to_bf16(y));
  else if (whole)
    _mm512_storeu_ps((float*)out + at, y);
  else
    _mm512_mask_storeu_ps((float*)out + at, lanes, y);
}

/* sums [M, N] fp32 (rows sum_stride floats apart), row_scales [M], bias [N] fp32 or NULL → out [M, N] (rows
 * out_stride elements apart; fp32, or bf16 with out_bf16 = 1; out may be sums itself, fp32 with the same stride):
 * out = gelu?(sums * row_scale + bias). Rows split over the threads. Returns 0, or -3 without AVX-512F and DQ. */
EPILOGUE_TARGET int omnimtp_encoder_epilogue(const float* sums, int64_t M, int64_t N, int64_t sum_stride,
                                             const float* row_scales, const float* bias, int gelu, void* out,
                                             int64_t out_stride, int out_bf16, int num_threads) {
  if (!omnimtp_encoder_epilogue_supported()) return -3;
  const int threads = num_threads > 1 && M > 1 ? num_threads : 1;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
  for (int64_t m = 0; m < M; ++m) {
    const float* row = sums + m * sum_stride;
    const __m512 scale = _mm512_set1_ps(row_scales[m]);
    int64_t n = 0;
    for (; n + 16 <= N; n += 16) /* whole registers: unmasked loads and stores (masked stores are slow on some CPUs) */
      epilogue16(row + n, scale, bias ? bias + n : NULL, gelu, out, m * out_stride + n, out_bf16, 0xFFFF);
    if (n < N)
      epilogue16(row + n, scale, bias ? bias + n : NULL, gelu, out, m * out_stride + n, out_bf16,
                 (__mmask16)((1u << (N - n)) - 1u));
  }
  return 0;
}

/* One row's fp32 values y[0..N-1] → q (N unsigned bytes) and its scale, as `omnimtp_quantize_rows_u8` quantizes a
 * row: scale = max|y| / 127, q = 128 + round(y * (127 / max|y|)) (to nearest, ties to even; clamped to -127..127);
 * a row of zeros 128s and scale 0, one with a NaN or an infinity 128s and a NaN scale. */
EPILOGUE_TARGET static void quantize_row_u8(const float* y, int64_t N, uint8_t* q, float* scale) {
  __m512 top = _mm512_setzero_ps();
  __mmask16 nan = 0;
  int64_t n = 0;
  for (; n + 16 <= N; n += 16) {
    const __m512 v = _mm512_loadu_ps(y + n);
    top = _mm512_max_ps(top, _mm512_abs_ps(v));
    nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  }
  float amax = _mm512_reduce_max_ps(top);
  int any_nan = nan != 0;
  for (int64_t t = n; t < N; ++t) {
    const float v = y[t] < 0 ? -y[t] : y[t];
    any_nan |= v != v;
    amax = v > amax ? v : amax;
  }
  if (any_nan || !(amax <= 3.4028234663852886e38f) || amax == 0.0f) {
    memset(q, 128, (size_t)N);
    *scale = amax == 0.0f && !any_nan ? 0.0f : __builtin_nanf("");
    return;
  }
  const __m512 inverse = _mm512_set1_ps(127.0f / amax);
  const __m512i low = _mm512_set1_epi32(-127), high = _mm512_set1_epi32(127), zero_point = _mm512_set1_epi32(128);
  for (n = 0; n + 16 <= N; n += 16) {
    __m512i r = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(y + n), inverse)); /* to nearest, ties to even */
    r = _mm512_add_epi32(_mm512_min_epi32(_mm512_max_epi32(r, low), high), zero_point);
    _mm_storeu_si128((__m128i*)(q + n), _mm512_cvtepi32_epi8(r));
  }
  for (; n < N; ++n) {
    const float rounded = __builtin_nearbyintf(y[n] * (127.0f / amax));
    q[n] = (uint8_t)(128 + (int)(rounded > 127.0f ? 127.0f : rounded < -127.0f ? -127.0f : rounded));
  }
  *scale = amax / 127.0f;
}

/* sums, row_scales, bias, gelu as `omnimtp_encoder_epilogue`'s → q [M, N] unsigned bytes and q_scales [M]: each
 * row's fp32 output quantized as `omnimtp_quantize_rows_u8` quantizes it (the next int8 GEMM's input, zero point
 * 128), without writing the fp32 rows. Rows split over the threads. Returns 0, -1 when out of memory, -3 without
 * AVX-512F and DQ. */
EPILOGUE_TARGET int omnimtp_encoder_epilogue_u8(const float* sums, int64_t M, int64_t N, int64_t sum_stride,
                                                const float* row_scales, const float* bias, int gelu, uint8_t* q,
                                                float* q_scales, int num_threads) {
  if (!omnimtp_encoder_epilogue_supported()) return -3;
  const int threads = num_threads > 1 && M > 1 ? num_threads : 1;
  int failed = 0;
#pragma omp parallel num_threads(threads) if (threads > 1)
  {
    float* row = (float*)malloc(sizeof(float) * (size_t)(N + 16));
    if (!row) {
#pragma omp atomic write
      failed = 1;
    }
#pragma omp for schedule(static)
    for (int64_t m = 0; m < M; ++m) {
      if (!row) continue;
      const __m512 scale = _mm512_set1_ps(row_scales[m]);
      int64_t n = 0;
      for (; n + 16 <= N; n += 16)
        epilogue16(sums + m * sum_stride + n, scale, bias ? bias + n : NULL, gelu, row, n, 0, 0xFFFF);
      if (n < N)
        epilogue16(sums + m * sum_stride + n, scale, bias ? bias + n : NULL, gelu, row, n, 0,
                   (__mmask16)((1u << (N - n)) - 1u));
      quantize_row_u8(row, N, q + m * N, q_scales + m);
    }
    free(row);
  }
  return failed ? -1 : 0;
}
