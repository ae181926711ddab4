"""A decode step's decoder layers on the CPU, each block in one kernel call (decode_layer.cpp).

A decode step of a few sequences (up to 64 here, the default `max_running`; a MoE block up to 8)
reads every weight once and computes little: on the 2-core Xeon a SmolLM2 step of 8 requests spent
28.6 of its 44 ms forward in the products and ~15 ms in the ops around them, fifteen to twenty torch
calls a layer (norms, RoPE, the cache writes, the attention's wrapper, silu, adds), each 30-55 us
there, several times what it costs alone (docs/engine-cpu.md, "A decode step's layer in two calls").
Here a layer is two calls, each one OpenMP team from the residual stream back into it:
- attention: RMSNorm, the q/k/v product (its bias), each head's q/k norm (Qwen3) and RoPE, the
  keys and values written to their pages, each sequence's attention over its pages
  (paged_attention.cpp's `attend`, as `paged_decode`; a prefix the batch shares is read in place,
  once for each group of sequences a task runs), the o product added to the residual;
- the MLP: RMSNorm, then a dense one's gate+up, silu(gate) * up, down added to the residual; or
  an MoE layer's router product and its routed experts, routing included (`cpu_kernels.moe_routed`'s
  inner part), their weighted sum added to the residual.
The products are the small-row kernel's (cpu_kernels.small_rows), the weights read where they lie in
the arena. A shared expert or sigmoid routing (DeepSeek-V3, GLM-5), a DeltaNet or MLA mixer, a gated
or partly rotated attention, a zero-centred norm, quantized weights, tensor parallelism (an
all-reduce inside the block) and any step with a prompt chunk or several decode batches run the
torch path, which also stays the reference: the fused blocks compute the same float32 operations,
in the same order where torch's order is defined (each product rounded, then added to the residual;
RoPE's two products, then their sum), and differ from it by summation order inside the dot
products, norms and softmax only.
"""

from __future__ import annotations

import torch

from talaria.contracts.arch import ModelArch
from talaria.executor import cpu_kernels
from talaria.executor.attention import AttentionMeta
from talaria.executor.kv_cache import KVCache

MAX_TOKENS = 64  # a step's sequences the attention and dense blocks take (decode_layer.cpp; the default max_running)
MAX_ROUTED = cpu_kernels.MAX_ROWS  # the MoE block's: an expert's rows are one pass of the small-row kernel


def _plain(*tensors: torch.Tensor | None) -> bool:
    """Every given tensor (None: absent, allowed) a contiguous float32 tensor on the CPU, not a packed weight."""
    return all(t is None or (type(t) is torch.Tensor and t.dtype == torch.float32 and t.device.type == "cpu"
                             and t.is_contiguous()) for t in tensors)


class DecodeLayers:
    """Which of a model's layers run fused at a decode step, and the two calls that run them."""

    def __init__(self, arch: ModelArch, layers: list, heads: int, kv_heads: int, scale: float) -> None:
        self.arch, self.heads, self.kv_heads, self.scale = arch, heads, kv_heads, scale
        hd = arch.head_dim
        plain_attention = (not arch.is_mla and not arch.attn_output_gate and arch.rotary_dim == hd
                           and hd % 16 == 0 and hd <= 256 and heads % kv_heads == 0)
        self.attention = [plain_attention and lw.la_qkv is None
                          and _plain(lw.input_norm, lw.qkv, lw.qkv_bias, lw.q_norm, lw.k_norm, lw.o_proj)
                          for lw in layers]
        self.dense = [lw.router is None and _plain(lw.post_norm, lw.gate_up, lw.down) for lw in layers]
        self.routed = [lw.router is not None and arch.router_scoring != "sigmoid" and lw.shared_gate_up is None
                       and _plain(lw.post_norm, lw.router, lw.experts_gate_up, lw.experts_down)
                       and lw.experts_gate_up.dim() == 3 for lw in layers]
        self.first_attention = next((i for i, a in enumerate(self.attention) if a), None)  # whose caches `runs` checks
        self._mlp = {False: self.dense, True: [d or r for d, r in zip(self.dense, self.routed, strict=True)]}

    def mlp(self, tokens: int) -> list[bool]:
        """Per layer, whether its MLP block runs fused in a step of `tokens`: a dense one, or
        softmax-routed experts without a shared expert at most MAX_ROUTED tokens while the MoE kernels
        run (`cpu_kernels.MOE_EXPERTS`: bench/engine.py counts the experts a step reads with them off,
        routing in torch)."""
        return self._mlp[cpu_kernels.MOE_EXPERTS and tokens <= MAX_ROUTED]

    @classmethod
    def of(cls, arch: ModelArch, layers: list, heads: int, kv_heads: int, ranks: int, scale: float,
           dtype: torch.dtype, device: torch.device) -> DecodeLayers | None:
        """The model's fused layers; None where no layer can be (not float32 on the CPU, tensor
        parallel, a norm with an offset, or the kernels not here)."""
        if (dtype != torch.float32 or device.type != "cpu" or ranks != 1 or arch.norm_offset
                or cpu_kernels.library() is None):
            return None
        fused = cls(arch, layers, heads, kv_heads, scale)
        return fused if any(fused.attention) or any(fused.dense) or any(fused.routed) else None

    def runs(self, x: torch.Tensor, meta: AttentionMeta, kv: KVCache) -> bool:
        """Whether this step's layers run fused: a step of at most MAX_TOKENS decoding sequences and
        nothing else, one batch (with a shared prefix or not), the caches' heads contiguous."""
        if not (cpu_kernels.DECODE_LAYERS and x.shape[0] <= MAX_TOKENS and not meta.prefills
                and len(meta.decodes) == 1):
            return False
        if self.first_attention is None:
            return True
        k_cache, v_cache = kv.layer(self.first_attention)
        hd = self.arch.head_dim
        return k_cache.stride()[2:] == v_cache.stride()[2:] == (hd, 1)

    def attend(self, x: torch.Tensor, lw, layer: int, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMeta,
               kv: KVCache) -> None:
        """x (T, H) += layer `layer`'s attention block of x, its keys and values written to the pages.
        cos, sin: (T, 1, head_dim), contiguous, the tokens' RoPE rows."""
        d = meta.decodes[0]
        k_cache, v_cache = kv.layer(layer)
        T, H = x.shape
        ptr = _pointer
        shared_tokens = 0 if d.shared is None else d.shared.numel() * k_cache.shape[1]
        refused = cpu_kernels.library().talaria_decode_attention(
            x.data_ptr(), T, H, lw.input_norm.data_ptr(), self.arch.rms_norm_eps, lw.qkv.data_ptr(),
            ptr(lw.qkv_bias), ptr(lw.q_norm), ptr(lw.k_norm), cos.data_ptr(), sin.data_ptr(), lw.o_proj.data_ptr(),
            k_cache.data_ptr(), v_cache.data_ptr(), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0),
            v_cache.stride(1), k_cache.shape[1], meta.write_pages.data_ptr(), meta.write_offsets.data_ptr(),
            ptr(d.shared), shared_tokens, d.pages.data_ptr(), d.lengths.data_ptr(), d.pages.numel() // d.batch,
            self.heads, self.kv_heads, self.arch.head_dim, self.scale, cpu_kernels.PREFETCH_ROWS,
            torch.get_num_threads())
        if refused:
            raise ValueError(f"decode_attention: {T} tokens of {self.heads} heads over {self.kv_heads} KV heads "
                             f"of width {self.arch.head_dim}: not a step it runs")

    def mlp_block(self, x: torch.Tensor, lw) -> None:
        """x (T, H) += the layer's MLP block of x: dense, or its routed experts, routing included."""
        T, H = x.shape
        lib, eps, pf, threads = cpu_kernels.library(), self.arch.rms_norm_eps, cpu_kernels.PREFETCH_ROWS, \
            torch.get_num_threads()
        if lw.router is None:
            refused = lib.talaria_decode_mlp(x.data_ptr(), T, H, lw.post_norm.data_ptr(), eps, lw.gate_up.data_ptr(),
                                             lw.down.data_ptr(), lw.down.shape[1], pf, threads)
        else:
            E, two_i, _ = lw.experts_gate_up.shape
            refused = lib.talaria_decode_moe(x.data_ptr(), T, H, lw.post_norm.data_ptr(), eps, lw.router.data_ptr(),
                                             lw.experts_gate_up.data_ptr(), lw.experts_down.data_ptr(), E,
                                             self.arch.num_experts_per_tok, int(self.arch.norm_topk_prob),
                                             two_i // 2, pf, threads)
        if refused:
            raise ValueError(f"decode_mlp: {T} tokens, not 1 to {MAX_TOKENS} ({MAX_ROUTED} routed)")


def _pointer(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()
