"""Capture a plan's forward and backward passes into CUDA graphs and replay them.

As in ``torch.cuda.make_graphed_callables``: warm up on a side stream, capture the forward and
then the backward into one memory pool, read inputs through static buffers. Each compiled
network keeps one graph per binding (shapes, dtype, gradients); a new binding captures anew.
A graph holds one set of saved intermediates, so a second forward before the first one's
backward (the same layer applied twice in one step) runs eagerly instead; ``captures`` counts
captures so tests can check that replays do not re-capture.
"""

from __future__ import annotations

import logging

import torch

from tncomp.errors import CudaGraphError
from tncomp.runtime.autograd import ContractFunction, Runner
from tncomp.runtime.codegen import generate

log = logging.getLogger("tncomp.cudagraph")

WARMUP = 3
MAX_GRAPHS_PER_NETWORK = 16


class GraphedPlan:
    """Static buffers and the two captured graphs of one plan binding."""

    def __init__(self, runner: Runner, operands):
        if not torch.cuda.is_available():
            raise CudaGraphError("CUDA graphs need a CUDA device; compile without cuda_graphs.")
        plan = runner.plan
        shapes = [tuple(t.shape) for t in operands]
        code = generate(plan, shapes, operands[0].dtype, operands[0].device, name="graphed",
                        pool=False)
        self.plan = plan
        self.static_in = [t.detach().clone() for t in operands]
        self.static_dy = torch.zeros(plan.output_shape, dtype=operands[0].dtype,
                                     device=operands[0].device)
        self.with_grad = any(plan.needs_grad)
        self.in_flight = False
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(WARMUP):
                _out, saved = code.forward(*self.static_in)
                if self.with_grad:
                    code.backward(self.static_in, saved, self.static_dy)
        torch.cuda.current_stream().wait_stream(stream)
        self.pool = torch.cuda.graph_pool_handle()
        self.fwd_graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.fwd_graph, pool=self.pool):
            self.static_out, self.static_saved = code.forward(*self.static_in)
        if self.with_grad:
            self.bwd_graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.bwd_graph, pool=self.pool):
                self.static_grads = code.backward(self.static_in, self.static_saved,
                                                  self.static_dy)

    def forward(self, operands) -> torch.Tensor:
        for dst, src in zip(self.static_in, operands, strict=True):
            dst.copy_(src)
        self.fwd_graph.replay()
        return self.static_out

    def backward(self, dy: torch.Tensor):
        self.static_dy.copy_(dy)
        self.bwd_graph.replay()
        self.in_flight = False
        return tuple(None if g is None else g.clone() for g in self.static_grads)


class _Lease:
    """Held by the autograd node: when the graph is dropped without a backward, release."""

    __slots__ = ("graphed",)

    def __init__(self, graphed: GraphedPlan):
        self.graphed = graphed

    def __del__(self):
        self.graphed.in_flight = False


class _GraphedFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, graphed: GraphedPlan, *operands):
        ctx.graphed = graphed
        ctx.lease = _Lease(graphed)
        return graphed.forward(operands).clone()

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dy):
        return (None, *ctx.graphed.backward(dy))


class CapturedGraphs:
    """One compiled network's captured graphs, one per runner (binding), and a count of the
    captures made (tests check that replays do not re-capture)."""

    __slots__ = ("by_runner", "captures")

    def __init__(self) -> None:
        self.by_runner: dict[Runner, GraphedPlan] = {}
        self.captures = 0

    def clear(self) -> None:
        """Drop the graphs (and their memory pools); the count of captures stays."""
        self.by_runner.clear()


def graphed_call(graphs: CapturedGraphs, runner: Runner, operands) -> torch.Tensor:
    """Run ``runner`` through its captured graphs in ``graphs`` (capturing on first use of a
    binding)."""
    by_runner = graphs.by_runner
    graphed = by_runner.get(runner)
    if graphed is None:
        if len(by_runner) >= MAX_GRAPHS_PER_NETWORK:
            raise CudaGraphError(
                f"this network was captured for {len(by_runner)} bindings already; CUDA graphs "
                "suit fixed shapes: pad inputs to a few sizes or compile without cuda_graphs."
            )
        graphed = GraphedPlan(runner, operands)
        by_runner[runner] = graphed
        graphs.captures += 1
        log.debug("captured CUDA graphs for binding %s", [tuple(t.shape) for t in operands])
    grad = torch.is_grad_enabled() and graphed.with_grad
    if graphed.in_flight:
        log.debug("graph in flight (a second forward before backward): running eagerly")
        if grad:
            return ContractFunction.apply(runner, *operands)
        return runner.code.forward(*operands)[0]
    if grad:
        graphed.in_flight = True
        return _GraphedFunction.apply(graphed, *operands)
    return graphed.forward(operands).clone()
