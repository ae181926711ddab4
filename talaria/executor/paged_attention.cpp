// Decode attention over the paged K/V cache (cpu_kernels.h).
#include "cpu_kernels.h"

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
// against its context (at least one token), hd / 16 vectors a head: their scores, sixteen tokens
// at a time, each K row read once for all the queries that see it (a shared prefix once for the
// group); each query's softmax (the vectorised exp); the values weighted by it, each V row read once
// likewise. `s`, `o` scratch. W: the vectors a head, known when compiled (the common widths: the
// loops unrolled, the accumulators in registers), or 0 for any other width.
template <int W>
static void attend_v(const Group& G, const PagedKV& kv, int64_t h, int64_t g, int64_t hd, float scale, Floats& s,
                     Floats& o) {
  constexpr int most = W ? W : 16;
  const int V = W ? W : (int)(hd / 16);
  const int64_t Q = G.m * g, off = h * hd;
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
      __m512 qv[most];
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
      __m512 av[most];
      for (int v = 0; v < V; ++v) av[v] = _mm512_load_ps(a + 16 * v);
      for (int64_t t = 0; t < count; ++t) {
        const __m512 w = _mm512_set1_ps(p[t]);
        for (int v = 0; v < V; ++v) av[v] = _mm512_fmadd_ps(w, _mm512_loadu_ps(rows[t] + 16 * v), av[v]);
      }
      for (int v = 0; v < V; ++v) _mm512_store_ps(a + 16 * v, av[v]);
    }
  };
  // f(r0, r1, first, rows, count) over the group's context in runs of up to 64 tokens: the shared
  // prefix's for every query, then each sequence's own tokens for its g queries
  auto walk = [&](const float* cache, int64_t page_stride, int64_t token_stride, auto&& f) {
    in_chunks(cache, page_stride, token_stride, kv.ps, G.sh, G.shared, off,
              [&](int64_t first, const float* const* rows, int64_t count) { f(0, Q, first, rows, count); });
    for (int64_t i = 0; i < G.m; ++i)
      in_chunks(cache, page_stride, token_stride, kv.ps, G.pages + i * G.width, G.own[i], off,
                [&](int64_t first, const float* const* rows, int64_t count) {
                  f(i * g, (i + 1) * g, G.shared + first, rows, count);
                });
  };
  walk(kv.k, kv.k_page, kv.k_token, scores);
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
  walk(kv.v, kv.v_page, kv.v_token, values);
  for (int64_t r = 0; r < Q; ++r) {
    const __m512 w = _mm512_set1_ps(inv[r]);
    float* out = G.out + (r / g) * G.out_stride + (h * g + r % g) * hd;
    for (int v = 0; v < V; ++v) _mm512_storeu_ps(out + 16 * v, _mm512_mul_ps(_mm512_load_ps(acc + r * hd + 16 * v), w));
  }
}

// `attend_v` for a head width hd, a multiple of 16 up to 256: 64, 128 and 256 compiled for.
void attend(const Group& G, const PagedKV& kv, int64_t h, int64_t g, int64_t hd, float scale, Floats& s, Floats& o) {
  switch (hd) {
    case 64: return attend_v<4>(G, kv, h, g, hd, scale, s, o);
    case 128: return attend_v<8>(G, kv, h, g, hd, scale, s, o);
    case 256: return attend_v<16>(G, kv, h, g, hd, scale, s, o);
    default: return attend_v<0>(G, kv, h, g, hd, scale, s, o);
  }
}

// One decode query per sequence against its paged K/V: q (B, nh, hd) -> out (B, nh, hd), float32.
// Sequence b's token t lies in page pages[b * width + t / ps], row t % ps; a cache's element (page,
// row, kv head, d) at page * page_stride + row * token_stride + head * hd + d. Query head j reads KV
// head j / (nh / nkv) (GQA). Each (sequence, KV head) is one task (`attend`).
extern "C" int talaria_paged_decode(const float* q, const float* kc, const float* vc, int64_t k_page,
                                    int64_t k_token, int64_t v_page, int64_t v_token, const int64_t* pages,
                                    const int64_t* ctx, float* out, int64_t B, int64_t nh, int64_t nkv,
                                    int64_t hd, int64_t ps, int64_t width, float scale, int threads) {
  if (hd % 16 || hd > 256 || nh % nkv) return -1;
  const int64_t g = nh / nkv;
  const PagedKV kv{kc, vc, k_page, k_token, v_page, v_token, ps};
#pragma omp parallel num_threads(threads)
  {
    Floats s, o;
#pragma omp for schedule(dynamic, 1)
    for (int64_t task = 0; task < B * nkv; ++task) {
      const int64_t b = task / nkv, h = task % nkv;
      attend(Group{q + b * nh * hd, out + b * nh * hd, 0, 0, nullptr, pages + b * width, ctx + b, 0, width, 1}, kv, h,
             g, hd, scale, s, o);
    }
  }
  return 0;
}
