// The inner parts Talaria's CPU kernels share (cpu_kernels.cpp, decode_layer.cpp): the small-row
// product, the vectorised exp, silu(gate) * up, one sequence's attention over its paged K/V, and a
// decode step's routed MoE experts.
#pragma once
#include <immintrin.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

// Scratch of floats on whole cache lines (64-byte aligned): a product's vector loads from it never
// straddle two lines, which costs them half their speed.
struct Floats {
  struct alignas(64) Line { float f[16]; };
  std::vector<Line> lines;
  explicit Floats(int64_t n = 0) : lines((n + 15) / 16) {}
  void resize(int64_t n) { lines.resize((n + 15) / 16); }
  float* data() { return lines.data()->f; }
};

// The lanes of a 16-float vector that hold elements when `left` of them remain.
static inline __mmask16 lanes(int64_t left) {
  return left >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1);
}

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

// The rows n0..n1 of y (M, N) = x (M, K) w (N, K)^T (+ bias; `add`: y += it) for any M <= 8, on the
// calling thread.
static void block_any(int64_t M, const float* x, const float* w, const float* bias, float* y, int64_t n0, int64_t n1,
                      int64_t N, int64_t K, int64_t pf, bool add = false) {
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

// A layer's paged K/V cache: element (page, row, kv head, d) of K at page * k_page + row * k_token +
// head * hd + d, of V likewise; `ps` rows (tokens) a page.
struct PagedKV {
  const float *k, *v;
  int64_t k_page, k_token, v_page, v_token, ps;
};

// f(t, row) for each of the n tokens in pages[...], in order, `row` its head's K (or V) in `cache`:
// page by page, with no division a token.
template <class F>
static inline void each_row(const float* cache, int64_t page_stride, int64_t token_stride, int64_t ps,
                            const int64_t* pages, int64_t n, int64_t head_offset, F&& f) {
  for (int64_t t = 0, p = 0; t < n; ++p) {
    const float* row = cache + pages[p] * page_stride + head_offset;
    for (const int64_t end = std::min(t + ps, n); t < end; ++t, row += token_stride) f(t, row);
  }
}

// Sequences whose contexts start with the same `shared` tokens (a whole number of pages, in sh[...];
// 0: none), then each its own: sequence i's own[i] tokens in pages[i * width ...]. Query head r of
// sequence i at q + i * q_stride + r * hd, its output at out + i * out_stride + r * hd.
struct Group {
  const float* q;
  float* out;
  int64_t q_stride, out_stride;
  const int64_t *sh, *pages, *own;
  int64_t shared, width, m;
};

// Sixteen vectors' sums, lane t the sum of a[t]'s 16 lanes, each added in _mm512_reduce_add_ps's
// order (its halves, then quarters, then pairs): the same sums, bit for bit, in 24 shuffles and adds
// where 16 reductions take 128.
static inline __m512 sums16(const __m512* a) {
  __m512 q[4];
  for (int m = 0; m < 4; ++m) {  // q[m]'s 128-bit block k: token 4k + m's halves and quarters added
    const __m512 lo = _mm512_add_ps(_mm512_shuffle_f32x4(a[m], a[4 + m], 0x44),
                                    _mm512_shuffle_f32x4(a[m], a[4 + m], 0xEE));
    const __m512 hi = _mm512_add_ps(_mm512_shuffle_f32x4(a[8 + m], a[12 + m], 0x44),
                                    _mm512_shuffle_f32x4(a[8 + m], a[12 + m], 0xEE));
    q[m] = _mm512_add_ps(_mm512_shuffle_f32x4(lo, hi, 0x88), _mm512_shuffle_f32x4(lo, hi, 0xDD));
  }
  auto pairs = [](__m512 x, __m512 y) {  // each block's elements 0 + 2 and 1 + 3
    const __m512d xd = _mm512_castps_pd(x), yd = _mm512_castps_pd(y);
    return _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(xd, yd)), _mm512_castpd_ps(_mm512_unpackhi_pd(xd, yd)));
  };
  const __m512 r01 = pairs(q[0], q[1]), r23 = pairs(q[2], q[3]);
  return _mm512_add_ps(_mm512_shuffle_ps(r01, r23, 0x88), _mm512_shuffle_ps(r01, r23, 0xDD));
}

// f(first, rows, count) for each run of up to 64 of the n tokens in pages[...]: rows[i] is token
// first + i's head in `cache`.
template <class F>
static void in_chunks(const float* cache, int64_t page_stride, int64_t token_stride, int64_t ps,
                      const int64_t* pages, int64_t n, int64_t head_offset, F&& f) {
  const float* rows[64];
  int64_t first = 0, count = 0;
  each_row(cache, page_stride, token_stride, ps, pages, n, head_offset, [&](int64_t, const float* row) {
    rows[count++] = row;
    if (count == 64) f(first, rows, count), first += count, count = 0;
  });
  if (count) f(first, rows, count);
}

// The g query heads of KV head h (query heads h g ... h g + g - 1) of the group's m sequences, each
// against its context (at least one token), V = hd / 16 vectors a head: their scores, sixteen tokens
// at a time, each K row read once for all the queries that see it (a shared prefix once for the
// group); each query's softmax (the vectorised exp); the values weighted by it, each V row read once
// likewise. `s`, `o` scratch.
template <int V>
static void attend_v(const Group& G, const PagedKV& kv, int64_t h, int64_t g, float scale, Floats& s, Floats& o) {
  const int64_t hd = 16 * V, Q = G.m * g, off = h * hd;
  int64_t longest = 0;
  for (int64_t i = 0; i < G.m; ++i) longest = std::max(longest, G.own[i]);
  const int64_t n16 = (G.shared + longest + 15) / 16 * 16;
  s.resize(Q * n16);
  o.resize(Q * hd + Q);  // each query's weighted values, then its 1 / (sum of its weights)
  float *sc = s.data(), *acc = o.data(), *inv = acc + Q * hd;
  auto query = [&](int64_t r) { return G.q + (r / g) * G.q_stride + (h * g + r % g) * hd; };
  // queries r0..r1's scores of tokens first .. first + count (rows: their K)
  auto scores = [&](int64_t r0, int64_t r1, int64_t first, const float* const* rows, int64_t count) {
    for (int64_t r = r0; r < r1; ++r) {
      const float* qr = query(r);
      __m512 qv[V];
      for (int v = 0; v < V; ++v) qv[v] = _mm512_loadu_ps(qr + 16 * v);
      for (int64_t b = 0; b < count; b += 16) {
        const int64_t live = std::min<int64_t>(16, count - b);
        __m512 a[16];
        for (int u = 0; u < 16; ++u) {  // past the live tokens: the last one again, never stored
          const float* kr = rows[b + std::min<int64_t>(u, live - 1)];
          a[u] = _mm512_mul_ps(qv[0], _mm512_loadu_ps(kr));
          for (int v = 1; v < V; ++v) a[u] = _mm512_fmadd_ps(qv[v], _mm512_loadu_ps(kr + 16 * v), a[u]);
        }
        _mm512_mask_storeu_ps(sc + r * n16 + first + b, lanes(live), _mm512_mul_ps(sums16(a), _mm512_set1_ps(scale)));
      }
    }
  };
  auto values = [&](int64_t r0, int64_t r1, int64_t first, const float* const* rows, int64_t count) {
    for (int64_t r = r0; r < r1; ++r) {
      float* a = acc + r * hd;
      const float* p = sc + r * n16 + first;
      __m512 av[V];
      for (int v = 0; v < V; ++v) av[v] = _mm512_load_ps(a + 16 * v);
      for (int64_t t = 0; t < count; ++t) {
        const __m512 w = _mm512_set1_ps(p[t]);
        for (int v = 0; v < V; ++v) av[v] = _mm512_fmadd_ps(w, _mm512_loadu_ps(rows[t] + 16 * v), av[v]);
      }
      for (int v = 0; v < V; ++v) _mm512_store_ps(a + 16 * v, av[v]);
    }
  };
  in_chunks(kv.k, kv.k_page, kv.k_token, kv.ps, G.sh, G.shared, off,
            [&](int64_t first, const float* const* rows, int64_t count) { scores(0, Q, first, rows, count); });
  for (int64_t i = 0; i < G.m; ++i)
    in_chunks(kv.k, kv.k_page, kv.k_token, kv.ps, G.pages + i * G.width, G.own[i], off,
              [&](int64_t first, const float* const* rows, int64_t count) {
                scores(i * g, (i + 1) * g, G.shared + first, rows, count);
              });
  for (int64_t r = 0; r < Q; ++r) {
    const int64_t n = G.shared + G.own[r / g];
    float* sr = sc + r * n16;
    float mx = sr[0];
    for (int64_t t = 1; t < n; ++t) mx = std::max(mx, sr[t]);
    __m512 sum = _mm512_setzero_ps();
    for (int64_t t = 0; t < n; t += 16) {
      const __mmask16 live = lanes(n - t);
      const __m512 e = exp_le0(_mm512_sub_ps(_mm512_maskz_loadu_ps(live, sr + t), _mm512_set1_ps(mx)));
      sum = _mm512_mask_add_ps(sum, live, sum, e);
      _mm512_mask_storeu_ps(sr + t, live, e);
    }
    inv[r] = 1.0f / _mm512_reduce_add_ps(sum);
    std::fill_n(acc + r * hd, hd, 0.0f);
  }
  in_chunks(kv.v, kv.v_page, kv.v_token, kv.ps, G.sh, G.shared, off,
            [&](int64_t first, const float* const* rows, int64_t count) { values(0, Q, first, rows, count); });
  for (int64_t i = 0; i < G.m; ++i)
    in_chunks(kv.v, kv.v_page, kv.v_token, kv.ps, G.pages + i * G.width, G.own[i], off,
              [&](int64_t first, const float* const* rows, int64_t count) {
                values(i * g, (i + 1) * g, G.shared + first, rows, count);
              });
  for (int64_t r = 0; r < Q; ++r) {
    const __m512 w = _mm512_set1_ps(inv[r]);
    float* out = G.out + (r / g) * G.out_stride + (h * g + r % g) * hd;
    for (int v = 0; v < V; ++v) _mm512_storeu_ps(out + 16 * v, _mm512_mul_ps(_mm512_load_ps(acc + r * hd + 16 * v), w));
  }
}

// `attend_v` for a head width hd, a multiple of 16 up to 256.
static void attend(const Group& G, const PagedKV& kv, int64_t h, int64_t g, int64_t hd, float scale, Floats& s,
                   Floats& o) {
  switch (hd / 16) {
    case 1: return attend_v<1>(G, kv, h, g, scale, s, o);
    case 2: return attend_v<2>(G, kv, h, g, scale, s, o);
    case 3: return attend_v<3>(G, kv, h, g, scale, s, o);
    case 4: return attend_v<4>(G, kv, h, g, scale, s, o);
    case 5: return attend_v<5>(G, kv, h, g, scale, s, o);
    case 6: return attend_v<6>(G, kv, h, g, scale, s, o);
    case 7: return attend_v<7>(G, kv, h, g, scale, s, o);
    case 8: return attend_v<8>(G, kv, h, g, scale, s, o);
    case 9: return attend_v<9>(G, kv, h, g, scale, s, o);
    case 10: return attend_v<10>(G, kv, h, g, scale, s, o);
    case 11: return attend_v<11>(G, kv, h, g, scale, s, o);
    case 12: return attend_v<12>(G, kv, h, g, scale, s, o);
    case 13: return attend_v<13>(G, kv, h, g, scale, s, o);
    case 14: return attend_v<14>(G, kv, h, g, scale, s, o);
    case 15: return attend_v<15>(G, kv, h, g, scale, s, o);
    default: return attend_v<16>(G, kv, h, g, scale, s, o);
  }
}

// One expert over m <= 8 rows: x (m, H) -> y (m, H) = (silu(x Wg^T) * x Wu^T) Wd^T, with gate_up (2I, H)
// and down (H, I) its weights; gu (8, 2I) and act (8, I) the caller's scratch.
static void expert(const float* x, int64_t m, const float* gate_up, const float* down, float* gu, float* act,
                   float* y, int64_t H, int64_t I, int64_t pf) {
  block_any(m, x, gate_up, nullptr, gu, 0, 2 * I, 2 * I, H, pf);
  silu_mul(gu, act, m, I);
  block_any(m, act, down, nullptr, y, 0, H, H, I, pf);
}

// A whole MoE layer (its routed experts) on T <= 8 tokens, routing included: each token's k best
// experts by router logit (logits (T, E); the softmax keeps their order, the earlier expert first among
// equals), weighted by their softmax probabilities, renormalised over the k when `norm`; each chosen
// expert one task over its tokens; out (T, H) = the sum over a token's experts, in rank order, of
// weight * expert(x) (`add`: out += that sum). Where the torch path makes a dozen calls around the
// experts: routing, sorting the assignments by expert, gathering their rows, scattering the results
// back, the weighted sum.
static int routed_experts(const float* logits, const float* x, const float* gate_up, const float* down, float* out,
                          int64_t T, int64_t E, int64_t k, int norm, int64_t H, int64_t I, int64_t pf, int threads,
                          bool add = false) {
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
  Floats ya(T * k * H);  // each assignment's expert output
  const int64_t U = (int64_t)used.size();
#pragma omp parallel num_threads(threads)
  {
    Floats xe(8 * H), gu(8 * 2 * I), act(8 * I), ye(8 * H);
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
        if (add) acc = _mm512_add_ps(_mm512_maskz_loadu_ps(live, out + t * H + d), acc);
        _mm512_mask_storeu_ps(out + t * H + d, live, acc);
      }
  }
  return 0;
}
