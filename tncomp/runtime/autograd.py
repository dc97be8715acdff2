"""One torch.autograd.Function that runs a plan's forward steps and its gradient steps."""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from tncomp.runtime.codegen import GeneratedCode


class Runner:
    """A plan ready to run: generated code plus which operands the backward reads."""

    __slots__ = ("code", "n_operands", "plan")

    def __init__(self, plan, code: GeneratedCode):
        self.plan = plan
        self.code = code
        self.n_operands = plan.n_operands


class ContractFunction(torch.autograd.Function):
    """``y = contract(*operands)`` with the plan's own backward (first-order gradients only)."""

    @staticmethod
    def forward(ctx, runner: Runner, *operands: torch.Tensor) -> torch.Tensor:
        y, saved = runner.code.forward(*operands)
        ctx.runner = runner
        ctx.intermediates = saved
        ctx.save_for_backward(*operands)
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx, dy: torch.Tensor):
        operands = ctx.saved_tensors
        grads = ctx.runner.code.backward(operands, ctx.intermediates, dy)
        return (None, *grads)
