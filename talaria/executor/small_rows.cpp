// The product of a few rows (tokens) with a float32 weight: the small-row kernel (cpu_kernels.h).
#include "cpu_kernels.h"

// y (M, N) = x (M, K) w (N, K)^T (+ bias), float32, M <= 8, rows n0..n1 of w: R weight rows at a
// time, one accumulator per weight row and token; the input's tail past a multiple of 16 through
// masked loads. `pf`: prefetch the weight `pf` rows ahead (0: none). `add`: y += the product
// instead (a residual stream: each element the product rounded, then added, as torch's x + y).
template <int M, int R>
static void block(const float* x, const float* w, const float* bias, float* y, int64_t n0, int64_t n1,
                  int64_t N, int64_t K, int64_t pf, bool add = false) {
  const int64_t K16 = K / 16 * 16;
  const __mmask16 tail = lanes(K - K16);
  for (int64_t n = n0; n < n1; n += R) {
    const int r_here = (int)std::min<int64_t>(R, n1 - n);
    __m512 acc[R][M];
    for (int r = 0; r < R; ++r)
      for (int m = 0; m < M; ++m) acc[r][m] = _mm512_setzero_ps();
    const float* wr[R];
    for (int r = 0; r < R; ++r) wr[r] = w + (n + std::min(r, r_here - 1)) * K;
    const bool fetch = pf > 0 && n + pf + R <= N;
    // the whole vectors, then the tail: plain loops keep the accumulators in registers; each step
    // loads the tokens' vectors once, then each weight row's
    for (int64_t k = 0; k < K16; k += 16) {
      __m512 xv[M];
      for (int m = 0; m < M; ++m) xv[m] = _mm512_loadu_ps(x + m * K + k);
      for (int r = 0; r < R; ++r) {
        const __m512 wv = _mm512_loadu_ps(wr[r] + k);
        if (fetch) _mm_prefetch((const char*)(wr[r] + pf * K + k), _MM_HINT_T0);
        for (int m = 0; m < M; ++m) acc[r][m] = _mm512_fmadd_ps(wv, xv[m], acc[r][m]);
      }
    }
    if (tail) {
      for (int r = 0; r < R; ++r) {
        const __m512 wv = _mm512_maskz_loadu_ps(tail, wr[r] + K16);
        for (int m = 0; m < M; ++m)
          acc[r][m] = _mm512_fmadd_ps(wv, _mm512_maskz_loadu_ps(tail, x + m * K + K16), acc[r][m]);
      }
    }
    for (int r = 0; r < r_here; ++r)
      for (int m = 0; m < M; ++m) {
        const float v = _mm512_reduce_add_ps(acc[r][m]) + (bias ? bias[n + r] : 0.0f);
        y[m * N + n + r] = add ? y[m * N + n + r] + v : v;
      }
  }
}

// Any M <= 8 rows of the product, on the calling thread (cpu_kernels.h).
void block_any(int64_t M, const float* x, const float* w, const float* bias, float* y, int64_t n0, int64_t n1,
               int64_t N, int64_t K, int64_t pf, bool add) {
  switch (M) {
    case 1: block<1, 2>(x, w, bias, y, n0, n1, N, K, pf, add); break;
    case 2: block<2, 2>(x, w, bias, y, n0, n1, N, K, pf, add); break;
    case 3: block<3, 2>(x, w, bias, y, n0, n1, N, K, pf, add); break;
    case 4: block<4, 2>(x, w, bias, y, n0, n1, N, K, pf, add); break;
    case 5: block<5, 2>(x, w, bias, y, n0, n1, N, K, pf, add); break;
    case 6: block<6, 2>(x, w, bias, y, n0, n1, N, K, pf, add); break;
    case 7: block<7, 2>(x, w, bias, y, n0, n1, N, K, pf, add); break;
    default: block<8, 2>(x, w, bias, y, n0, n1, N, K, pf, add); break;
  }
}

// y (M, N) = x (M, K) w (N, K)^T (+ bias) for 1 <= M <= 8: the weight's rows split evenly over at
// most `threads` threads, none with fewer than 256 rows.
extern "C" int talaria_small_rows(const float* x, const float* w, const float* bias, float* y, int64_t M,
                                  int64_t N, int64_t K, int64_t pf, int threads) {
  if (M < 1 || M > 8) return -1;
  const int64_t parts = std::max<int64_t>(1, std::min<int64_t>(threads, (N + 255) / 256));
#pragma omp parallel for num_threads(parts) schedule(static) if (parts > 1)
  for (int64_t p = 0; p < parts; ++p) block_any(M, x, w, bias, y, N * p / parts, N * (p + 1) / parts, N, K, pf);
  return 0;
}
