"""The autograd Functions that run a plan's forward steps and its gradient steps.

:class:`ContractFunction` is the eager fast path: pooled buffers, forward intermediates kept for
the backward. Its backward runs the plan's gradient steps directly when no graph is being built;
when it is (``create_graph=True``: gradient penalties, Hessian-vector products, MAML-style inner
steps) it recomputes the forward from the saved operands and runs the gradient steps with the
plain (unpooled) code under autograd, so the gradients are themselves differentiable, to any
order. :class:`FuncContractFunction` is the same contraction in the form torch.func needs
(``setup_context``, a generated vmap rule): used while a torch.func transform is active.
"""

from __future__ import annotations

import torch

from tncomp.runtime.buffers import alias
from tncomp.runtime.codegen import GeneratedCode, generate


class Runner:
    """A plan ready to run: generated code plus which operands the backward reads.

    ``code`` is the fast code (large results in pooled buffers); :meth:`plain` is the same plan
    without ``out=`` buffers, which autograd, fake tensors and vmap can all run through."""

    __slots__ = ("_plain", "code", "device", "dtype", "n_operands", "plan", "shapes")

    def __init__(self, plan, code: GeneratedCode, shapes=(), dtype=None, device=None):
        self.plan = plan
        self.code = code
        self.n_operands = plan.n_operands
        self.shapes = tuple(tuple(s) for s in shapes)
        self.dtype = dtype
        self.device = device
        self._plain: GeneratedCode | None = None if code.pools or code.fused else code

    def plain(self) -> GeneratedCode:
        """The plan's code with no pooled buffers (generated on first use)."""
        if self._plain is None:
            self._plain = generate(self.plan, self.shapes, self.dtype, self.device,
                                   name="differentiable", pool=False)
        return self._plain

    def differentiable_grads(self, operands, dy: torch.Tensor) -> tuple:
        """The gradients as a graph of torch ops (recomputing the forward from ``operands``)."""
        code = self.plain()
        _y, saved = code.forward(*operands)
        return code.backward(operands, saved, dy)


def _owned(y: torch.Tensor, operands, saved) -> torch.Tensor:
    """``y`` as a base tensor when it is a contiguous view of a result that neither the operands
    nor the backward's saved values share: autograd forbids in-place ops on views made inside a
    custom Function, and callers add into the result in place (comera adds a layer's bias that
    way instead of allocating a second output). Pooled outputs are base tensors already."""
    if not y._is_view() or not y.is_contiguous():
        return y
    ptr = y.untyped_storage().data_ptr()
    if any(t is not None and t.untyped_storage().data_ptr() == ptr for t in (*operands, *saved)):
        return y
    return alias(y, tuple(y.shape))


class ContractFunction(torch.autograd.Function):
    """``y = contract(*operands)`` with the plan's own backward (differentiable when
    ``create_graph=True``)."""

    @staticmethod
    def forward(ctx, runner: Runner, *operands: torch.Tensor) -> torch.Tensor:
        y, saved = runner.code.forward(*operands)
        y = _owned(y, operands, saved)
        ctx.runner = runner
        # The intermediates go through save_for_backward too, so saved-tensor hooks
        # (torch.autograd.graph.save_on_cpu, non-reentrant checkpointing, byte counts) see
        # everything the backward keeps: the operands and the plan's ``saved`` slots.
        ctx.save_for_backward(*operands, *saved)
        return y

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        tensors = ctx.saved_tensors
        n = ctx.runner.n_operands
        operands = tensors[:n]
        if torch.is_grad_enabled():  # create_graph: build the gradients as a graph
            return (None, *ctx.runner.differentiable_grads(operands, dy))
        grads = ctx.runner.code.backward(operands, tensors[n:], dy)
        return (None, *grads)


class FuncContractFunction(torch.autograd.Function):
    """The contraction for torch.func (``grad``, ``vjp``, ``jacrev``, ``vmap``): no ctx in
    ``forward``, no pooled buffers, and a backward that recomputes the forward, so every
    transform (and any order of derivative) sees plain torch ops."""

    generate_vmap_rule = True

    @staticmethod
    def forward(runner: Runner, *operands: torch.Tensor) -> torch.Tensor:
        return runner.plain().forward(*operands)[0]

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        ctx.runner = inputs[0]
        ctx.save_for_backward(*inputs[1:])

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        return (None, *ctx.runner.differentiable_grads(ctx.saved_tensors, dy))
