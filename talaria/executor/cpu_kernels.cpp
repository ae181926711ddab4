// Talaria's CPU kernels: the source talaria/executor/cpu_kernels.py builds and calls (see its docstring).
#include "cpu_kernels.h"

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

// One MoE layer's routed experts, each over its assignments: x (A, H) grouped by expert, counts[e]
// of them for expert e in order; gate_up (E, 2I, H) (gate rows, then up rows), down (E, H, I) ->
// y (A, H) = (silu(x Wg^T) * x Wu^T) Wd^T per expert. One expert a task, eight rows at a time.
extern "C" int talaria_moe_experts(const float* x, const float* gate_up, const float* down, const int64_t* counts,
                                   float* y, int64_t E, int64_t H, int64_t I, int64_t pf, int threads) {
  std::vector<int64_t> start(E + 1, 0);
  for (int64_t e = 0; e < E; ++e) start[e + 1] = start[e] + counts[e];
#pragma omp parallel num_threads(threads)
  {
    Floats gu(8 * 2 * I), act(8 * I);
#pragma omp for schedule(dynamic, 1)
    for (int64_t e = 0; e < E; ++e)
      for (int64_t r = start[e]; r < start[e + 1]; r += 8)
        expert(x + r * H, std::min<int64_t>(8, start[e + 1] - r), gate_up + e * 2 * I * H, down + e * H * I,
               gu.data(), act.data(), y + r * H, H, I, pf);
  }
  return 0;
}

// A whole MoE layer (its routed experts) on T <= 8 tokens, routing included (`routed_experts`).
extern "C" int talaria_moe_routed(const float* logits, const float* x, const float* gate_up, const float* down,
                                  float* out, int64_t T, int64_t E, int64_t k, int norm, int64_t H, int64_t I,
                                  int64_t pf, int threads) {
  return routed_experts(logits, x, gate_up, down, out, T, E, k, norm, H, I, pf, threads);
}
