"""Dropout that keeps a one-byte mask for the backward, and a backward without full temporaries.

On the CPU ``nn.Dropout`` draws its mask as a float tensor and saves it for the backward: four
bytes per activation, the size of the activation itself. ``torch.native_dropout`` (what CUDA
runs anyway) draws the same mask from the same random numbers and keeps it as bool, one byte.
Both its forward (``x * mask * scale``) and its backward (``grad * mask * scale``) convert the
whole mask to a float temporary for the product, and the backward makes an intermediate product
too: one or two more activation-sized tensors at the moments the step peaks (the FFN's dropout in
the paper transformer at batch 32: 48 MiB each). :class:`BoolMaskDropout` runs the same ops with
each product computed into its output a slice at a time.

Outputs, gradients and the random stream after it are bit-identical to ``nn.Dropout``
(``tests/comera/lean/test_dropout.py``); in the paper transformer at batch 1 the float masks of the
residual and FFN dropouts were 13.5 MiB of CoMERA's 86 MiB step peak.

:meth:`BoolMaskDropout.feed` goes one step further for a dropout whose output feeds a layer that
saves its input (the FFN's second linear layer): that layer's backward rebuilds the output from
the mask and the dropout's input (GELU's output, recomputed from the GELU input autograd keeps
anyway) instead of holding it, 48 MiB per encoder block of the paper transformer at batch 32.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

import torch
from torch import Tensor, nn

from comera.lean.recompute import recomputed_in_backward

# Elements per slice of the backward's product: bounds its bool-to-float temporary to 1 MiB.
_SLICE = 1 << 18


class BoolMaskDropout(nn.Dropout):
    """``nn.Dropout`` whose backward keeps a bool mask (same results, a quarter of the bytes).

    Under ``torch.compile`` and torch.func transforms it is plain ``nn.Dropout``: those trace or
    batch their own random ops."""

    def forward(self, x: Tensor) -> Tensor:
        """``x`` with each element zeroed with probability ``p`` and the rest scaled by
        ``1 / (1 - p)`` in training (``nn.Dropout``'s draws and values); ``x`` in eval."""
        if not self._lean():
            return super().forward(x)
        if not (torch.is_grad_enabled() and x.requires_grad):
            return torch.native_dropout(x, self.p, True)[0]
        return _Dropout.apply(x, self.p)[0]

    def feed(self, x: Tensor, consumer: Callable[[Tensor], Tensor],
             x_again: Callable[[], Tensor]) -> Tensor:
        """``consumer(self(x))`` (the same values, gradients and random stream), where autograd
        does not keep the dropout's output for ``consumer``'s backward: the backward rebuilds it
        from ``x_again()`` and the bool mask (:mod:`comera.lean.recompute`).

        ``x_again()`` must compute ``x``'s values anew from tensors autograd keeps anyway, as
        ``lambda: gelu(h)`` does for ``x = gelu(h)`` (GELU keeps ``h``); the mask is applied to
        its result in place when nothing else holds that result (else to a copy). Plain
        ``consumer(self(x))`` outside training, under autocast (the backward may run under
        another autocast state) and where :meth:`forward` is plain ``nn.Dropout``."""
        if (not self._lean() or not (torch.is_grad_enabled() and x.requires_grad)
                or torch.is_autocast_enabled(x.device.type) or not x.is_contiguous()):
            return consumer(self(x))
        out, keep = _Dropout.apply(x, self.p)
        scale = 1.0 / (1.0 - self.p)

        def out_again() -> Tensor:
            again = x_again().contiguous()
            # in place only into a fresh result (not x, a tensor held elsewhere, or its view)
            fresh = sys.getrefcount(again) <= 2 and _sole_owner(again)
            return kept(again, keep, in_place=fresh).mul_(scale)  # _Dropout's ops, bit for bit

        with recomputed_in_backward([(out, out_again)]):
            return consumer(out)

    def _lean(self) -> bool:
        """Whether this call runs :class:`_Dropout` (else ``nn.Dropout``'s own forward)."""
        return (self.training and not self.inplace and 0 < self.p < 1
                and not torch.compiler.is_compiling()
                and not torch._C._are_functorch_transforms_active())


def _sole_owner(t: Tensor) -> bool:
    """Whether ``t`` is the only tensor on its storage (no view, ``detach()`` or base shares
    it), so writing into it changes nothing else. False where torch cannot tell."""
    use_count = getattr(torch._C, "_storage_Use_Count", None)
    if use_count is None or t._base is not None:
        return False
    return use_count(t.untyped_storage()._cdata) <= 2  # t's own and this call's storage object


class _Dropout(torch.autograd.Function):
    """``torch.native_dropout`` whose forward and backward allocate only their results (and
    the mask). Returns ``(output, mask)``; the mask is not differentiable."""

    @staticmethod
    def forward(ctx, x: Tensor, p: float) -> tuple[Tensor, Tensor]:
        ctx.set_materialize_grads(False)  # no zero-filled gradient for the mask
        scale = 1.0 / (1.0 - p)
        if x.is_contiguous():  # native_dropout's ops, its product a slice at a time
            keep = torch.empty_like(x, dtype=torch.bool).bernoulli_(1.0 - p)
            out = kept(x, keep).mul_(scale)
        else:
            out, keep = torch.native_dropout(x, p, True)
        ctx.save_for_backward(keep)
        ctx.mark_non_differentiable(keep)
        ctx.scale = scale
        return out, keep

    @staticmethod
    def backward(ctx, grad: Tensor | None, _keep_grad: None):
        if grad is None:
            return None, None
        (keep,) = ctx.saved_tensors
        return dropped_grad(grad, keep, ctx.scale), None


def dropped_grad(grad: Tensor, keep: Tensor, scale: float) -> Tensor:
    """``grad * keep * scale`` (``native_dropout_backward``'s values, bit for bit) with no
    temporary larger than one slice; the plain expression where autograd records it (double
    backward) or the layouts differ."""
    if grad.shape != keep.shape or not grad.is_contiguous() or not keep.is_contiguous():
        return grad * keep * scale
    return kept(grad, keep).mul_(scale)


def kept(x: Tensor, keep: Tensor, in_place: bool = False) -> Tensor:
    """``x * keep`` (into ``x`` itself with ``in_place``) for contiguous ``x`` and bool ``keep``
    of one shape, a slice at a time: the product's bool-to-float conversion (on the CPU a
    temporary as large as ``x``) stays one slice large. The values are those of ``x * keep``
    bit for bit: each is ``x`` times exactly 1 or 0. One whole-tensor op where autograd
    records it (``out=`` is not differentiable)."""
    if torch.is_grad_enabled() and x.requires_grad:
        return x.mul_(keep) if in_place else x * keep
    out = x if in_place else torch.empty_like(x)
    flat_out, flat_x, flat_keep = out.view(-1), x.view(-1), keep.view(-1)
    for start in range(0, flat_out.numel(), _SLICE):
        part = slice(start, start + _SLICE)
        torch.mul(flat_x[part], flat_keep[part], out=flat_out[part])
    return out
