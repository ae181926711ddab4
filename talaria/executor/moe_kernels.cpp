// A decode step's MoE experts, routing included (cpu_kernels.h).
#include "cpu_kernels.h"

// silu(gate) * up (cpu_kernels.h).
void silu_mul(const float* gu, float* act, int64_t m, int64_t I) {
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
  block_any(m, x, gate_up, nullptr, gu, 0, 2 * I, 2 * I, H, pf);
  silu_mul(gu, act, m, I);
  block_any(m, act, down, nullptr, y, 0, H, H, I, pf);
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

// A decode step's routed experts, routing included (cpu_kernels.h).
int routed_experts(const float* logits, const float* x, const float* gate_up, const float* down, float* out,
                   int64_t T, int64_t E, int64_t k, int norm, int64_t H, int64_t I, int64_t pf, int threads,
                   bool add) {
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
// A whole MoE layer (its routed experts) on T <= 8 tokens, routing included (`routed_experts`).
extern "C" int talaria_moe_routed(const float* logits, const float* x, const float* gate_up, const float* down,
                                  float* out, int64_t T, int64_t E, int64_t k, int norm, int64_t H, int64_t I,
                                  int64_t pf, int threads) {
  return routed_experts(logits, x, gate_up, down, out, T, E, k, norm, H, I, pf, threads);
}
