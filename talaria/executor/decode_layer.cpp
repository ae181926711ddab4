// A decode step's decoder layer in two calls (talaria/executor/decode_layer.py): its attention block
// and its MLP block (dense, or routed experts), each from the residual stream back into it. Every
// stage of a block runs inside one OpenMP team, parted by its barriers, where the torch path makes
// fifteen to twenty calls a layer, each paying torch's dispatch (docs/engine-cpu.md).
#include <omp.h>

#include "cpu_kernels.h"

// out (n) = x (n) * (1 / sqrt(mean(x^2) + eps)) * w, float32: torch's RMSNorm, multiplied in its order.
static void rms_row(const float* x, const float* w, float* out, int64_t n, float eps) {
  __m512 sq = _mm512_setzero_ps();
  for (int64_t i = 0; i < n; i += 16) {
    const __m512 v = _mm512_maskz_loadu_ps(lanes(n - i), x + i);
    sq = _mm512_fmadd_ps(v, v, sq);
  }
  const __m512 r = _mm512_set1_ps(1.0f / std::sqrt(_mm512_reduce_add_ps(sq) / (float)n + eps));
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 live = lanes(n - i);
    const __m512 v = _mm512_mul_ps(_mm512_maskz_loadu_ps(live, x + i), r);
    _mm512_mask_storeu_ps(out + i, live, _mm512_mul_ps(v, _mm512_maskz_loadu_ps(live, w + i)));
  }
}

// One head x (hd) rotated in place by its token's cos, sin (hd): x * cos + rotate_half(x) * sin, the
// two halves of the head (transformers' layout), each product rounded, then summed, as torch does.
static void rope_head(float* x, const float* cos, const float* sin, int64_t hd) {
  float out[256];
  const int64_t half = hd / 2;
  for (int64_t i = 0; i < hd; ++i) {
    const float rotated = i < half ? -x[i + half] : x[i - half];
    out[i] = x[i] * cos[i] + rotated * sin[i];
  }
  std::copy_n(out, hd, x);
}

constexpr int64_t MAX_TOKENS = 64;  // a decode step's sequences a block takes (the default max_running)
constexpr int64_t WEIGHT_ROWS = 32;  // past 8 tokens, the weight rows each 8 tokens' pass reads while they are in L2

// Inside a team: y (M, N) = x (M, K) w (N, K)^T (+ bias; `add`: y += it), M <= MAX_TOKENS, the
// weight's rows parted between the team's threads. Up to 8 tokens, one pass over a thread's rows;
// past 8, its rows WEIGHT_ROWS at a time, each run of them read from memory once and by each 8
// tokens' pass from the cache. Ends at the team's barrier.
static void team_product(int64_t M, const float* x, const float* w, const float* bias, float* y, int64_t N,
                         int64_t K, int64_t pf, bool add) {
  const int64_t parts = omp_get_num_threads(), step = M <= 8 ? N : WEIGHT_ROWS;
#pragma omp for schedule(static)
  for (int64_t p = 0; p < parts; ++p)
    for (int64_t n0 = N * p / parts, n1 = N * (p + 1) / parts; n0 < n1; n0 += step)
      for (int64_t m = 0; m < M; m += 8)
        block_any(std::min<int64_t>(8, M - m), x + m * K, w, bias, y + m * N, n0, std::min(n0 + step, n1), N, K, pf,
                  add);
}

// x (T, H) += o_proj(attention(rope(norms(qkv(rms_norm(x)))))) for T <= MAX_TOKENS tokens, token t the newest
// of decoding sequence t: norm (H) the input norm's weight; wqkv ((nh + 2 nkv) hd, H) and its bias
// bqkv (or null) the queries', keys' and values' rows; q_norm, k_norm (hd) each head's norm (or null);
// cos, sin (T, hd) each token's RoPE rows; wo (H, nh hd). Token t's key and value are written to
// page write_page[t], row write_row[t] of the cache before it attends: sequence t's context is the
// batch's shared_tokens (0: none) in pages shared[...], then its own ctx[t] in pages[t * width ...].
// Query head j reads KV head j / (nh / nkv) (GQA).
extern "C" int talaria_decode_attention(float* x, int64_t T, int64_t H, const float* norm, float eps,
                                        const float* wqkv, const float* bqkv, const float* q_norm,
                                        const float* k_norm, const float* cos, const float* sin, const float* wo,
                                        float* kc, float* vc, int64_t k_page, int64_t k_token, int64_t v_page,
                                        int64_t v_token, int64_t ps, const int64_t* write_page,
                                        const int64_t* write_row, const int64_t* shared, int64_t shared_tokens,
                                        const int64_t* pages, const int64_t* ctx, int64_t width, int64_t nh,
                                        int64_t nkv, int64_t hd, float scale, int64_t pf, int threads) {
  if (T < 1 || T > MAX_TOKENS || hd % 16 || hd > 256 || nh % nkv) return -1;
  const int64_t g = nh / nkv, heads = nh + nkv, width_qkv = (nh + 2 * nkv) * hd;
  Floats h(T * H), qkv(T * width_qkv), attn(T * nh * hd);
  const PagedKV kv{kc, vc, k_page, k_token, v_page, v_token, ps};
#pragma omp parallel num_threads(threads)
  {
#pragma omp for schedule(static)
    for (int64_t t = 0; t < T; ++t) rms_row(x + t * H, norm, h.data() + t * H, H, eps);
    team_product(T, h.data(), wqkv, bqkv, qkv.data(), width_qkv, H, pf, false);
#pragma omp for schedule(static)
    for (int64_t task = 0; task < T * heads; ++task) {  // each query and key head: norm, RoPE; K and V to the cache
      const int64_t t = task / heads, j = task % heads;
      float* head = qkv.data() + t * width_qkv + j * hd;
      const float* w = j < nh ? q_norm : k_norm;
      if (w) rms_row(head, w, head, hd, eps);
      rope_head(head, cos + t * hd, sin + t * hd, hd);
      if (j >= nh) {
        std::copy_n(head, hd, kc + write_page[t] * k_page + write_row[t] * k_token + (j - nh) * hd);
        std::copy_n(head + nkv * hd, hd, vc + write_page[t] * v_page + write_row[t] * v_token + (j - nh) * hd);
      }
    }
    // a task a KV head and a sequence; with a shared prefix, a KV head and a group of sequences, each
    // group reading the prefix once, as few groups as keep the threads busy
    const int64_t parts = shared_tokens ? std::min<int64_t>(T, (2 * omp_get_num_threads() + nkv - 1) / nkv) : T;
    Floats s, o;
#pragma omp for schedule(dynamic, 1)
    for (int64_t task = 0; task < nkv * parts; ++task) {
      const int64_t k = task / parts, p = task % parts, i0 = T * p / parts, i1 = T * (p + 1) / parts;
      const Group group{qkv.data() + i0 * width_qkv, attn.data() + i0 * nh * hd, width_qkv, nh * hd, shared,
                        pages + i0 * width, ctx + i0, shared_tokens, width, i1 - i0};
      attend(group, kv, k, g, hd, scale, s, o);
    }
    team_product(T, attn.data(), wo, nullptr, x, H, nh * hd, pf, true);
  }
  return 0;
}

// x (T, H) += down(silu(gate) * up) of gate_up(rms_norm(x)) for T <= MAX_TOKENS tokens: norm (H) the norm's
// weight, gate_up (2I, H) the gate's rows then the up's, down (H, I).
extern "C" int talaria_decode_mlp(float* x, int64_t T, int64_t H, const float* norm, float eps, const float* gate_up,
                                  const float* down, int64_t I, int64_t pf, int threads) {
  if (T < 1 || T > MAX_TOKENS) return -1;
  Floats h(T * H), gu(T * 2 * I), act(T * I);
#pragma omp parallel num_threads(threads)
  {
#pragma omp for schedule(static)
    for (int64_t t = 0; t < T; ++t) rms_row(x + t * H, norm, h.data() + t * H, H, eps);
    team_product(T, h.data(), gate_up, nullptr, gu.data(), 2 * I, H, pf, false);
#pragma omp for schedule(static)
    for (int64_t t = 0; t < T; ++t) silu_mul(gu.data() + t * 2 * I, act.data() + t * I, 1, I);
    team_product(T, act.data(), down, nullptr, x, H, I, pf, true);
  }
  return 0;
}

// x (T, H) += the routed experts of rms_norm(x) for T <= 8 tokens (`routed_experts`, routing
// included): norm (H) the norm's weight, router (E, H), each token's k best experts by softmax,
// renormalised when `norm_topk`; gate_up (E, 2I, H), down (E, H, I).
extern "C" int talaria_decode_moe(float* x, int64_t T, int64_t H, const float* norm, float eps, const float* router,
                                  const float* gate_up, const float* down, int64_t E, int64_t k, int norm_topk,
                                  int64_t I, int64_t pf, int threads) {
  if (T < 1 || T > 8 || k < 1 || k > E) return -1;
  Floats h(T * H), logits(T * E);
#pragma omp parallel num_threads(threads)
  {
#pragma omp for schedule(static)
    for (int64_t t = 0; t < T; ++t) rms_row(x + t * H, norm, h.data() + t * H, H, eps);
    team_product(T, h.data(), router, nullptr, logits.data(), E, H, pf, false);
  }
  return routed_experts(logits.data(), h.data(), gate_up, down, x, T, E, k, norm_topk, H, I, pf, threads, true);
}
