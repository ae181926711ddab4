// What the sources of Talaria's CPU kernels share (talaria/executor/cpu_kernels.py builds them into
// one library and calls it through ctypes). Each source is one kernel family:
// - small_rows.cpp: the product of a few rows (tokens) with a weight;
// - paged_attention.cpp: decode attention over the paged K/V cache;
// - moe_kernels.cpp: a decode step's MoE experts, routing included;
// - decode_layer.cpp: a decode step's layer blocks, built from the three.
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

// A layer's paged K/V cache: element (page, row, kv head, d) of K at page * k_page + row * k_token +
// head * hd + d, of V likewise; `ps` rows (tokens) a page.
struct PagedKV {
  const float *k, *v;
  int64_t k_page, k_token, v_page, v_token, ps;
};

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

// The rows n0..n1 of y (M, N) = x (M, K) w (N, K)^T (+ bias; `add`: y += it) for any M <= 8, on the
// calling thread.
void block_any(int64_t M, const float* x, const float* w, const float* bias, float* y, int64_t n0, int64_t n1,
               int64_t N, int64_t K, int64_t pf, bool add = false);

// silu(gate) * up for m rows of gu (m, 2I: gate, then up) into act (m, I); sigmoid from e^-|g| (exp_le0's domain).
void silu_mul(const float* gu, float* act, int64_t m, int64_t I);

// The g query heads of KV head h (query heads h g ... h g + g - 1) of the group's m sequences, each
// against its context (at least one token) -> their outputs: scores, softmax, the values weighted by
// it, each K and V row read once for all the queries that see it (a shared prefix once for the
// group). hd a multiple of 16 up to 256; `s`, `o` scratch.
void attend(const Group& G, const PagedKV& kv, int64_t h, int64_t g, int64_t hd, float scale, Floats& s, Floats& o);

// A whole MoE layer (its routed experts) on T <= 8 tokens, routing included: each token's k best
// experts by router logit (logits (T, E); the softmax keeps their order, the earlier expert first among
// equals), weighted by their softmax probabilities, renormalised over the k when `norm`; each chosen
// expert one task over its tokens; out (T, H) = the sum over a token's experts, in rank order, of
// weight * expert(x) (`add`: out += that sum). Where the torch path makes a dozen calls around the
// experts: routing, sorting the assignments by expert, gathering their rows, scattering the results
// back, the weighted sum.
int routed_experts(const float* logits, const float* x, const float* gate_up, const float* down, float* out,
                   int64_t T, int64_t E, int64_t k, int norm, int64_t H, int64_t I, int64_t pf, int threads,
                   bool add = false);
