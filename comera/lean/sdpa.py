"""Scaled dot-product attention whose CPU training backward keeps a quarter of the bytes.

With dropout, ``F.scaled_dot_product_attention`` on the CPU runs its math path, and autograd
keeps, per attention call, the scaled q and k, a contiguous copy of v, the softmax
probabilities, the float dropout mask and the dropped-out probabilities: in the paper's
transformer at batch 32 (12 heads, 128 tokens) that is 108 MiB per encoder block, four
(b, h, s, s) float tensors among them.

:func:`scaled_dot_product_attention` is a drop-in for it. Where torch would take that path
(training with dropout, a CPU float tensor, no autocast, not traced), it runs the same ops in
the same order, so the output, the random stream after it and the gradients are bit-identical
(``tests/comera/lean/test_sdpa.py``), but keeps only q, k and v themselves (views of the projection
output, no copies) and the dropout mask as bool; the backward recomputes the scores, the
probabilities and the scaled copies from them. That is 42 MiB per block instead of 108 in the
shape above; the recompute is one (s x d) by (d x s) product and a softmax per head.
Everywhere else it is ``F.scaled_dot_product_attention`` itself.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from comera.lean.dropout import kept

_safe_softmax = getattr(torch, "_safe_softmax", None)  # the math path's softmax (torch >= 2.5)


def scaled_dot_product_attention(query: Tensor, key: Tensor, value: Tensor,
                                 attn_mask: Tensor | None = None, dropout_p: float = 0.0,
                                 is_causal: bool = False, scale: float | None = None) -> Tensor:
    """``F.scaled_dot_product_attention``'s results; with dropout on the CPU in training, its
    backward keeps q, k, v and a bool mask instead of six intermediates (module docstring)."""
    if not _lean_path_applies(query, key, value, attn_mask, dropout_p, is_causal):
        return F.scaled_dot_product_attention(query, key, value, attn_mask=attn_mask,
                                              dropout_p=dropout_p, is_causal=is_causal,
                                              scale=scale)
    if attn_mask is not None and attn_mask.dtype == torch.bool:  # as torch converts it
        attn_mask = torch.where(attn_mask, 0.0, float("-inf")).to(query.dtype)
    size = query.size(-1)
    softmax_scale = scale if scale is not None else 1.0 / math.sqrt(size)
    return _DropoutAttention.apply(query, key, value, attn_mask, float(dropout_p),
                                   math.sqrt(softmax_scale))


def _lean_path_applies(query: Tensor, key: Tensor, value: Tensor, attn_mask: Tensor | None,
                       dropout_p: float, is_causal: bool) -> bool:
    """Where torch runs its math path with dropout and autograd records it, on the CPU."""
    tensors = (query, key, value)
    return (_safe_softmax is not None and 0.0 < dropout_p < 1.0 and not is_causal
            and torch.is_grad_enabled() and any(t.requires_grad for t in tensors)
            and all(t.device.type == "cpu" and t.dtype in (torch.float32, torch.float64)
                    and t.dim() == 4 and t.dtype == query.dtype for t in tensors)
            and (attn_mask is None or attn_mask.device.type == "cpu")
            and (attn_mask is None or attn_mask.dtype in (torch.bool, query.dtype))
            and not torch.is_autocast_enabled("cpu")
            and not torch.compiler.is_compiling()
            and not torch._C._are_functorch_transforms_active())


def _scaled(query: Tensor, key: Tensor, factor: float) -> tuple[Tensor, Tensor]:
    """q and k^T each times sqrt(scale), as (b*h, s, d) and (b*h, d, s) batches: what torch's
    math path multiplies (the same ops, so the same values)."""
    qs = query * factor
    ks = key.transpose(-2, -1) * factor
    return _batched(qs), _batched(ks)


def _batched(t: Tensor) -> Tensor:
    """A (b, h, m, n) tensor as (b*h, m, n): a view where its strides allow, else a copy."""
    return t.reshape(-1, t.size(-2), t.size(-1))


def _probabilities(qs: Tensor, ks: Tensor, attn_mask: Tensor | None,
                   shape: tuple[int, ...]) -> Tensor:
    """softmax(q k^T * scale + mask), fully masked rows zero, as (b, h, s_q, s_k)."""
    scores = torch.bmm(qs, ks).view(shape)
    if attn_mask is not None:
        scores.add_(attn_mask)
    assert _safe_softmax is not None
    return _safe_softmax(scores, -1)


class _DropoutAttention(torch.autograd.Function):
    """Attention with dropout on the probabilities; saves q, k, v and the bool keep mask."""

    @staticmethod
    def forward(ctx, query: Tensor, key: Tensor, value: Tensor, attn_mask: Tensor | None,
                p: float, factor: float) -> Tensor:
        b, h, s_q, d_v = (*query.shape[:3], value.size(-1))
        shape = (b, h, s_q, key.size(-2))
        probs = _probabilities(*_scaled(query, key, factor), attn_mask, shape)
        # at::dropout draws a float noise tensor, then scales it: the same draws as bool, and
        # probs * noise as (probs * keep) * (what a kept noise entry holds), bit for bit
        keep = torch.empty_like(probs, dtype=torch.bool).bernoulli_(1 - p)
        kept_value = torch.ones((), dtype=probs.dtype).div_(1 - p).item()
        dropped = kept(probs, keep, in_place=True).mul_(kept_value)
        out = torch.bmm(_batched(dropped), _batched(value))
        ctx.save_for_backward(query, key, value, attn_mask, keep)
        ctx.kept_value, ctx.factor, ctx.shape = kept_value, factor, shape
        return out.view(b, h, s_q, d_v)

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        query, key, value, attn_mask, keep = ctx.saved_tensors
        qs, ks = _scaled(query, key, ctx.factor)
        probs = _probabilities(qs, ks, attn_mask, ctx.shape)
        grad = _batched(grad_out)
        dropped = kept(probs, keep).mul_(ctx.kept_value)
        grad_value = torch.bmm(_batched(dropped).transpose(1, 2), grad)
        del dropped
        grad_probs = torch.bmm(grad, _batched(value).transpose(1, 2)).view(ctx.shape)
        kept(grad_probs, keep, in_place=True).mul_(ctx.kept_value)
        grad_scores = _batched(torch._softmax_backward_data(grad_probs, probs, -1, probs.dtype))
        del probs, grad_probs
        grad_ks = torch.bmm(qs.transpose(1, 2), grad_scores)
        grad_qs = torch.bmm(grad_scores, ks.transpose(1, 2))
        b, h = query.shape[:2]
        grad_query = grad_qs.view(b, h, *grad_qs.shape[1:]) * ctx.factor
        grad_key = (grad_ks.view(b, h, *grad_ks.shape[1:]) * ctx.factor).transpose(-2, -1)
        return (grad_query, grad_key, grad_value.view(b, h, *grad_value.shape[1:]),
                None, None, None)
