"""The gated delta rule: the chunked prefill against the token-by-token recurrence, and the
recurrence against the rule written out head by head, all in float64.

Inputs are made as the layer makes them (talaria/executor/deltanet.py): q and k L2-normalised,
q scaled by d_k**-0.5, g = -softplus(.) < 0, beta = sigmoid(.), and the state starts non-zero, so a
chunk that drops the carried state, or a decay applied once too often or too rarely, is off by far
more than the 1e-10 allowed.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from talaria.executor.deltanet import (
    BLOCK_CHUNKS,
    BLOCK_HEADS,
    CHUNK,
    _l2norm,
    chunked,
    recurrent_step,
)

H, DK, DV = 3, 16, 8  # heads and head dims: small, the chunk is what matters
TOL = 1e-10


def inputs(n: int, seed: int, heads: int = H) -> tuple[torch.Tensor, ...]:
    """q, k (heads, n, DK), v (heads, n, DV), g, beta (heads, n) and a state (heads, DK, DV), float64."""
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    q = _l2norm(randn(heads, n, DK)) * DK ** -0.5
    k = _l2norm(randn(heads, n, DK))
    g = -F.softplus(randn(heads, n))
    return q, k, randn(heads, n, DV), g, randn(heads, n).sigmoid(), randn(heads, DK, DV)


def by_recurrence(q, k, v, g, beta, state):
    """`recurrent_step` token by token (B = 1): o (H, n, DV); `state` updated in place."""
    s = state[None]  # (1, H, DK, DV), a view: updated in place with `state`
    out = [recurrent_step(q[None, :, t], k[None, :, t], v[None, :, t], g[None, :, t], beta[None, :, t], s)[0]
           for t in range(k.shape[1])]
    return torch.stack(out, dim=1)


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


@pytest.mark.parametrize("n", [1, 63, CHUNK, CHUNK + 1, 150])
def test_chunked_equals_the_recurrence(n):
    q, k, v, g, beta, s0 = inputs(n, seed=n)
    s_chunked, s_recurrent = s0.clone(), s0.clone()
    o_chunked = chunked(q, k, v, g, beta, s_chunked)
    o_recurrent = by_recurrence(q, k, v, g, beta, s_recurrent)
    assert o_chunked.shape == (H, n, DV)
    assert max_diff(o_chunked, o_recurrent) < TOL
    assert max_diff(s_chunked, s_recurrent) < TOL
    assert max_diff(s_chunked, s0) > 1e-3  # the state did move: the comparison above is not vacuous


def test_chunked_equals_the_recurrence_across_blocks():
    """More heads than BLOCK_HEADS and more chunks than BLOCK_CHUNKS, neither a multiple: every
    boundary between `chunked`'s blocks, and a last block of fewer heads and fewer chunks."""
    heads, n = BLOCK_HEADS + 3, (2 * BLOCK_CHUNKS + 1) * CHUNK + 5
    q, k, v, g, beta, s0 = inputs(n, seed=5, heads=heads)
    s_chunked, s_recurrent = s0.clone(), s0.clone()
    o_chunked = chunked(q, k, v, g, beta, s_chunked)
    assert max_diff(o_chunked, by_recurrence(q, k, v, g, beta, s_recurrent)) < TOL
    assert max_diff(s_chunked, s_recurrent) < TOL


@pytest.mark.parametrize("split", [1, 37, CHUNK, 100])
def test_chunked_in_two_pieces_equals_one(split):
    n = 150
    q, k, v, g, beta, s0 = inputs(n, seed=split)
    s_whole, s_pieces = s0.clone(), s0.clone()
    whole = chunked(q, k, v, g, beta, s_whole)
    first = chunked(*(x[:, :split] for x in (q, k, v, g, beta)), s_pieces)
    second = chunked(*(x[:, split:] for x in (q, k, v, g, beta)), s_pieces)
    assert max_diff(torch.cat((first, second), dim=1), whole) < TOL
    assert max_diff(s_pieces, s_whole) < TOL


@pytest.mark.parametrize("n", [1, 63, 150])
def test_without_writes_the_state_only_decays(n):
    """beta = 0: nothing is written, so o_t = q_t^T S0 exp(g_1 + ... + g_t), token t's own decay
    included, and the final state is S0 exp(sum of g). A decay applied once too often (or skipped,
    or taken from the wrong token) breaks this in either form."""
    q, k, v, g, _, s0 = inputs(n, seed=7)
    beta = torch.zeros(H, n, dtype=torch.float64)
    total = g.cumsum(dim=-1)  # (H, n)
    want = torch.einsum("hnd,hde->hne", q, s0) * total.exp()[..., None]
    for run in (chunked, by_recurrence):
        state = s0.clone()
        assert max_diff(run(q, k, v, g, beta, state), want) < TOL
        assert max_diff(state, s0 * total[:, -1].exp()[:, None, None]) < TOL


def test_a_key_written_twice_reads_back_the_second_value():
    """The delta rule replaces what a key stores (additive linear attention would sum): with beta 1
    and no decay, write v1 then v2 under the same key k, and reading k gives v2."""
    k = torch.randn(H, 1, DK, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    k = k / k.norm(dim=-1, keepdim=True)  # exactly unit length (`_l2norm`'s epsilon would leave 1e-7)
    keys = torch.cat((k, k, k), dim=1)  # write, overwrite, then read with q = k (unscaled)
    v = torch.randn(H, 3, DV, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    g, beta = torch.zeros(H, 3, dtype=torch.float64), torch.ones(H, 3, dtype=torch.float64)
    beta[:, 2] = 0  # the third token only reads
    for run in (chunked, by_recurrence):
        o = run(keys, keys, v, g, beta, torch.zeros(H, DK, DV, dtype=torch.float64))
        assert max_diff(o[:, 2], v[:, 1]) < TOL


def test_recurrent_step_is_the_rule_written_out():
    """A batch of sequences, each with its own state, against the docstring's rule per head:
    S <- exp(g) S; S <- S + k (beta (v - k^T S))^T; o = q^T S."""
    B, gen = 4, torch.Generator().manual_seed(11)
    q = _l2norm(torch.randn(B, H, DK, dtype=torch.float64, generator=gen)) * DK ** -0.5
    k = _l2norm(torch.randn(B, H, DK, dtype=torch.float64, generator=gen))
    v = torch.randn(B, H, DV, dtype=torch.float64, generator=gen)
    g = -F.softplus(torch.randn(B, H, dtype=torch.float64, generator=gen))
    beta = torch.randn(B, H, dtype=torch.float64, generator=gen).sigmoid()
    state = torch.randn(B, H, DK, DV, dtype=torch.float64, generator=gen)
    want_o, want_s = torch.empty_like(v), state.clone()
    for b in range(B):
        for h in range(H):
            s = want_s[b, h] * g[b, h].exp()
            s = s + torch.outer(k[b, h], beta[b, h] * (v[b, h] - s.T @ k[b, h]))
            want_s[b, h], want_o[b, h] = s, s.T @ q[b, h]
    o = recurrent_step(q, k, v, g, beta, state)
    assert max_diff(o, want_o) < TOL
    assert max_diff(state, want_s) < TOL
