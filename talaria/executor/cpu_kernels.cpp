// Talaria's CPU kernels: the source talaria/executor/cpu_kernels.py builds and calls (see its docstring).
#include <immintrin.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

// The lanes of a 16-float vector that hold elements when `left` of them remain.
static inline __mmask16 lanes(int64_t left) {
  return left >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1);
}

// y (M, N) = x (M, K) w (N, K)^T (+ bias), float32, M <= 8, rows n0..n1 of w: R weight rows at a
// time, one accumulator per weight row and token; the input's tail past a multiple of 16 through
// masked loads. `pf`: prefetch the weight `pf` rows ahead (0: none).
template <int M, int R>
static void block(const float* x, const float* w, const float* bias, float* y, int64_t n0, int64_t n1,
                  int64_t N, int64_t K, int64_t pf) {
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
    for (int64_t k = 0; k <= K16; k += 16) {
      if (k == K16 && !tail) break;
      __m512 wv[R];
      for (int r = 0; r < R; ++r) {
        wv[r] = k < K16 ? _mm512_loadu_ps(wr[r] + k) : _mm512_maskz_loadu_ps(tail, wr[r] + k);
        if (fetch) _mm_prefetch((const char*)(wr[r] + pf * K + k), _MM_HINT_T0);
      }
      for (int m = 0; m < M; ++m) {
        const __m512 xv = k < K16 ? _mm512_loadu_ps(x + m * K + k) : _mm512_maskz_loadu_ps(tail, x + m * K + k);
        for (int r = 0; r < R; ++r) acc[r][m] = _mm512_fmadd_ps(wv[r], xv, acc[r][m]);
      }
    }
    for (int r = 0; r < r_here; ++r)
      for (int m = 0; m < M; ++m)
        y[m * N + n + r] = _mm512_reduce_add_ps(acc[r][m]) + (bias ? bias[n + r] : 0.0f);
  }
}

// The weight's rows split evenly over at most `threads` threads, none with fewer than 256 rows.
template <int M>
static void run(const float* x, const float* w, const float* bias, float* y, int64_t N, int64_t K, int64_t pf,
                int threads) {
  const int64_t parts = std::max<int64_t>(1, std::min<int64_t>(threads, (N + 255) / 256));
#pragma omp parallel for num_threads(parts) schedule(static) if (parts > 1)
  for (int64_t p = 0; p < parts; ++p) block<M, 2>(x, w, bias, y, N * p / parts, N * (p + 1) / parts, N, K, pf);
}

extern "C" int talaria_small_rows(const float* x, const float* w, const float* bias, float* y, int64_t M,
                                  int64_t N, int64_t K, int64_t pf, int threads) {
  switch (M) {
    case 1: run<1>(x, w, bias, y, N, K, pf, threads); return 0;
    case 2: run<2>(x, w, bias, y, N, K, pf, threads); return 0;
    case 3: run<3>(x, w, bias, y, N, K, pf, threads); return 0;
    case 4: run<4>(x, w, bias, y, N, K, pf, threads); return 0;
    case 5: run<5>(x, w, bias, y, N, K, pf, threads); return 0;
    case 6: run<6>(x, w, bias, y, N, K, pf, threads); return 0;
    case 7: run<7>(x, w, bias, y, N, K, pf, threads); return 0;
    case 8: run<8>(x, w, bias, y, N, K, pf, threads); return 0;
    default: return -1;
  }
}

// e^x for x <= 0 (scores less their maximum): 2^n e^r with |r| <= ln2 / 2, e^r by its Taylor series
// to r^7 (truncation under 6e-9, below float32's rounding), 2^n by scalef; under -87 it is 0 to float32.
static inline __m512 exp_le0(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);  // x - n ln2, ln2 in two parts
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.0f / 5040);
  const float c[] = {1.0f / 720, 1.0f / 120, 1.0f / 24, 1.0f / 6, 0.5f, 1.0f, 1.0f};
  for (float ci : c) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(ci));
  return _mm512_scalef_ps(p, n);
}

// One decode query per sequence against its paged K/V: q (B, nh, hd) -> out (B, nh, hd), float32.
// Sequence b's token t lies in page pages[b * width + t / ps], row t % ps; a cache's element (page,
// row, kv head, d) at page * page_stride + row * token_stride + head * hd + d. Query head j reads KV
// head j / (nh / nkv) (GQA). Each (sequence, KV head) is one task: its scores for the group's query
// heads over the context, their softmax, then the values weighted by it.
extern "C" int talaria_paged_decode(const float* q, const float* kc, const float* vc, int64_t k_page,
                                    int64_t k_token, int64_t v_page, int64_t v_token, const int64_t* pages,
                                    const int64_t* ctx, float* out, int64_t B, int64_t nh, int64_t nkv,
                                    int64_t hd, int64_t ps, int64_t width, float scale, int threads) {
  if (hd % 16 || hd > 256 || nh % nkv) return -1;
  const int64_t g = nh / nkv, V = hd / 16;
#pragma omp parallel num_threads(threads)
  {
    std::vector<float> s;
#pragma omp for schedule(dynamic, 1)
    for (int64_t task = 0; task < B * nkv; ++task) {
      const int64_t b = task / nkv, h = task % nkv, n = ctx[b], n16 = (n + 15) / 16 * 16;
      const int64_t* pg = pages + b * width;
      s.resize(g * n16);
      for (int64_t j = 0; j < g; ++j) {
        const float* qj = q + (b * nh + h * g + j) * hd;
        __m512 qv[16];
        for (int64_t v = 0; v < V; ++v) qv[v] = _mm512_loadu_ps(qj + 16 * v);
        float* sj = s.data() + j * n16;
        for (int64_t t = 0; t < n; ++t) {
          const float* kr = kc + pg[t / ps] * k_page + (t % ps) * k_token + h * hd;
          __m512 acc = _mm512_mul_ps(qv[0], _mm512_loadu_ps(kr));
          for (int64_t v = 1; v < V; ++v) acc = _mm512_fmadd_ps(qv[v], _mm512_loadu_ps(kr + 16 * v), acc);
          sj[t] = _mm512_reduce_add_ps(acc) * scale;
        }
        float m = sj[0];
        for (int64_t t = 1; t < n; ++t) m = std::max(m, sj[t]);
        __m512 sum = _mm512_setzero_ps();
        for (int64_t t = 0; t < n; t += 16) {
          const __mmask16 live = lanes(n - t);
          const __m512 e = exp_le0(_mm512_sub_ps(_mm512_maskz_loadu_ps(live, sj + t), _mm512_set1_ps(m)));
          sum = _mm512_mask_add_ps(sum, live, sum, e);
          _mm512_mask_storeu_ps(sj + t, live, e);
        }
        const __m512 inv = _mm512_set1_ps(1.0f / _mm512_reduce_add_ps(sum));
        __m512 acc[16];
        for (int64_t v = 0; v < V; ++v) acc[v] = _mm512_setzero_ps();
        for (int64_t t = 0; t < n; ++t) {
          const float* vr = vc + pg[t / ps] * v_page + (t % ps) * v_token + h * hd;
          const __m512 p = _mm512_set1_ps(sj[t]);
          for (int64_t v = 0; v < V; ++v) acc[v] = _mm512_fmadd_ps(p, _mm512_loadu_ps(vr + 16 * v), acc[v]);
        }
        float* o = out + (b * nh + h * g + j) * hd;
        for (int64_t v = 0; v < V; ++v) _mm512_storeu_ps(o + 16 * v, _mm512_mul_ps(acc[v], inv));
      }
    }
  }
  return 0;
}

// The rows n0..n1 of y (M, N) = x (M, K) w (N, K)^T for any M <= 8, on the calling thread.
static void block_any(int64_t M, const float* x, const float* w, float* y, int64_t n0, int64_t n1, int64_t N,
                      int64_t K, int64_t pf) {
  switch (M) {
    case 1: block<1, 2>(x, w, nullptr, y, n0, n1, N, K, pf); break;
    case 2: block<2, 2>(x, w, nullptr, y, n0, n1, N, K, pf); break;
    case 3: block<3, 2>(x, w, nullptr, y, n0, n1, N, K, pf); break;
    case 4: block<4, 2>(x, w, nullptr, y, n0, n1, N, K, pf); break;
    case 5: block<5, 2>(x, w, nullptr, y, n0, n1, N, K, pf); break;
    case 6: block<6, 2>(x, w, nullptr, y, n0, n1, N, K, pf); break;
    case 7: block<7, 2>(x, w, nullptr, y, n0, n1, N, K, pf); break;
    default: block<8, 2>(x, w, nullptr, y, n0, n1, N, K, pf); break;
  }
}

// silu(gate) * up for m rows of gu (m, 2I: gate, then up) into act (m, I); sigmoid from e^-|g| (exp_le0's domain).
static void silu_mul(const float* gu, float* act, int64_t m, int64_t I) {
  const __m512 zero = _mm512_setzero_ps(), one = _mm512_set1_ps(1.0f);
  for (int64_t i = 0; i < m; ++i) {
    const float* g = gu + i * 2 * I;
    for (int64_t j = 0; j < I; j += 16) {
      const __mmask16 live = lanes(I - j);
      const __m512 gv = _mm512_maskz_loadu_ps(live, g + j), uv = _mm512_maskz_loadu_ps(live, g + I + j);
      const __m512 t = exp_le0(_mm512_sub_ps(zero, _mm512_abs_ps(gv)));
      const __mmask16 pos = _mm512_cmp_ps_mask(gv, zero, _CMP_GE_OQ);
      const __m512 sig = _mm512_div_ps(_mm512_mask_blend_ps(pos, t, one), _mm512_add_ps(one, t));
      _mm512_mask_storeu_ps(act + i * I + j, live, _mm512_mul_ps(_mm512_mul_ps(gv, sig), uv));
    }
  }
}

// One expert over m <= 8 rows: x (m, H) -> y (m, H) = (silu(x Wg^T) * x Wu^T) Wd^T, with gate_up (2I, H)
// and down (H, I) its weights; gu (8, 2I) and act (8, I) the caller's scratch.
static void expert(const float* x, int64_t m, const float* gate_up, const float* down, float* gu, float* act,
                   float* y, int64_t H, int64_t I, int64_t pf) {
  block_any(m, x, gate_up, gu, 0, 2 * I, 2 * I, H, pf);
  silu_mul(gu, act, m, I);
  block_any(m, act, down, y, 0, H, H, I, pf);
}

// One MoE layer's routed experts, each over its assignments: x (A, H) grouped by expert, counts[e]
// of them for expert e in order; gate_up (E, 2I, H) (gate rows, then up rows), down (E, H, I) ->
// y (A, H) = (silu(x Wg^T) * x Wu^T) Wd^T per expert. One expert a task, eight rows at a time.
extern "C" int talaria_moe_experts(const float* x, const float* gate_up, const float* down, const int64_t* counts,
                                   float* y, int64_t E, int64_t H, int64_t I, int64_t pf, int threads) {
  std::vector<int64_t> start(E + 1, 0);
  for (int64_t e = 0; e < E; ++e) start[e + 1] = start[e] + counts[e];
#pragma omp parallel num_threads(threads)
  {
    std::vector<float> gu(8 * 2 * I), act(8 * I);
#pragma omp for schedule(dynamic, 1)
    for (int64_t e = 0; e < E; ++e)
      for (int64_t r = start[e]; r < start[e + 1]; r += 8)
        expert(x + r * H, std::min<int64_t>(8, start[e + 1] - r), gate_up + e * 2 * I * H, down + e * H * I,
               gu.data(), act.data(), y + r * H, H, I, pf);
  }
  return 0;
}

// A whole MoE layer (its routed experts) on T <= 8 tokens, routing included: each token's k best
// experts by router logit (logits (T, E); the softmax keeps their order, the earlier expert first among
// equals), weighted by their softmax probabilities, renormalised over the k when `norm`; each chosen
// expert one task over its tokens; out (T, H) = the sum over a token's experts, in rank order, of
// weight * expert(x). Where the torch path makes a dozen calls around the experts: routing, sorting
// the assignments by expert, gathering their rows, scattering the results back, the weighted sum.
extern "C" int talaria_moe_routed(const float* logits, const float* x, const float* gate_up, const float* down,
                                  float* out, int64_t T, int64_t E, int64_t k, int norm, int64_t H, int64_t I,
                                  int64_t pf, int threads) {
  if (T < 1 || T > 8 || k < 1 || k > E) return -1;
  std::vector<int64_t> chosen(T * k), count(E, 0), rows(E * 8), used;  // rows: expert e's assignments t * k + j
  std::vector<float> weight(T * k);
  for (int64_t t = 0; t < T; ++t) {
    const float* l = logits + t * E;
    float top = l[0], sum = 0.0f, picked = 0.0f;
    for (int64_t e = 1; e < E; ++e) top = std::max(top, l[e]);
    for (int64_t e = 0; e < E; ++e) sum += std::exp(l[e] - top);
    int64_t* c = chosen.data() + t * k;
    for (int64_t j = 0; j < k; ++j) {
      int64_t best = -1;
      for (int64_t e = 0; e < E; ++e)
        if (std::find(c, c + j, e) == c + j && (best < 0 || l[e] > l[best])) best = e;
      c[j] = best;
      weight[t * k + j] = std::exp(l[best] - top) / sum;
      picked += weight[t * k + j];
      if (count[best] == 0) used.push_back(best);
      rows[best * 8 + count[best]++] = t * k + j;  // a token picks an expert once: at most T <= 8 rows
    }
    for (int64_t j = 0; j < k && norm; ++j) weight[t * k + j] /= picked;
  }
  std::vector<float> ya(T * k * H);  // each assignment's expert output
  const int64_t U = (int64_t)used.size();
#pragma omp parallel num_threads(threads)
  {
    std::vector<float> xe(8 * H), gu(8 * 2 * I), act(8 * I), ye(8 * H);
#pragma omp for schedule(dynamic, 1)
    for (int64_t u = 0; u < U; ++u) {
      const int64_t e = used[u], m = count[e];
      for (int64_t i = 0; i < m; ++i) std::copy_n(x + rows[e * 8 + i] / k * H, H, xe.data() + i * H);
      expert(xe.data(), m, gate_up + e * 2 * I * H, down + e * H * I, gu.data(), act.data(), ye.data(), H, I, pf);
      for (int64_t i = 0; i < m; ++i) std::copy_n(ye.data() + i * H, H, ya.data() + rows[e * 8 + i] * H);
    }
#pragma omp for schedule(static)
    for (int64_t t = 0; t < T; ++t)
      for (int64_t d = 0; d < H; d += 16) {
        const __mmask16 live = lanes(H - d);
        __m512 acc = _mm512_setzero_ps();
        for (int64_t j = 0; j < k; ++j)
          acc = _mm512_fmadd_ps(_mm512_set1_ps(weight[t * k + j]),
                                _mm512_maskz_loadu_ps(live, ya.data() + (t * k + j) * H + d), acc);
        _mm512_mask_storeu_ps(out + t * H + d, live, acc);
      }
  }
  return 0;
}
