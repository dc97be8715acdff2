"""A compiled network as torch sees it outside eager mode: one ``torch.library`` operator.

``torch.compile`` cannot trace into generated code, a plan cache or a disk cache, so under
dynamo a call becomes one opaque operator, ``tncomp::contract(network, needs_grad, operands)``,
whose backward is a second one, ``tncomp::contract_backward``. Both refer to the compiled
network by an id (a string) in a registry of weak references (operators take tensors, numbers
and strings, not Python objects); their fake implementations give output shapes from the operand
shapes alone (symbolic sizes welcome), so tracing needs no plan. At run time the real
implementations look the network up and run its cached plan. The backward operator recomputes
the forward intermediates (an operator cannot hand Python objects to its backward).

This module also holds what every call path shares: the operand checks, the autocast rule
(floating operands other than float64 cast to the autocast dtype, as ``nn.Linear`` does), and
the empty-operand case (``torch.einsum``'s result: empty, or zeros where an empty index is
summed).
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Sequence

import torch

from tncomp.compiler.ir import Dim
from tncomp.errors import DtypeError, OperandError, SizeError, TncompError
from tncomp.runtime.autograd import FuncContractFunction

_NETWORKS: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
_IDS = itertools.count()


def register(compiled) -> str:
    """A fresh id under which the ``tncomp::`` operators find ``compiled`` (a string: dynamo
    keeps strings constant, where an int that differs between layers would turn symbolic)."""
    op_id = str(next(_IDS))
    _NETWORKS[op_id] = compiled
    return op_id


def lookup(op_id: str):
    """The compiled network registered as ``op_id``."""
    compiled = _NETWORKS.get(op_id)
    if compiled is None:
        raise TncompError(
            f"compiled network #{op_id} no longer exists (it was garbage-collected); keep a "
            "reference to the CompiledNetwork a torch.compile'd function calls."
        )
    return compiled


# -- checks and rules shared by every call path -------------------------------------------------
def check_tensors(operands: Sequence, what: str, names: Sequence[str] = ()) -> None:
    """An :class:`OperandError` naming the first operand that is not a torch tensor."""
    for k, t in enumerate(operands):
        if not isinstance(t, torch.Tensor):
            name = f" ({names[k]!r})" if k < len(names) else ""
            got = "None" if t is None else f"a {type(t).__name__}"
            raise OperandError(
                f"{what} takes torch tensors; operand {k}{name} is {got}. Convert it with "
                "torch.as_tensor(...) first."
            )


def check_operands(net, operands: Sequence) -> None:
    """Tensors of one floating dtype on one device, one per operand of ``net``."""
    names = [t.name for t in net.operands]
    check_tensors(operands, "compiled network", names)
    if len(operands) != len(names):
        raise SizeError(f"expected {len(names)} tensors ({', '.join(names)}), got "
                        f"{len(operands)}.")
    dtype, device = operands[0].dtype, operands[0].device
    for name, t in zip(names, operands, strict=True):
        if t.device != device:
            raise SizeError(f"tensor {name!r} is on {t.device} but {names[0]!r} is on {device}; "
                            "pass all operands with one dtype and device.")
        if t.dtype != dtype:
            raise DtypeError(
                f"tensor {name!r} is {t.dtype} but {names[0]!r} is {dtype}; pass all operands "
                "with one dtype (cast with .to(dtype)), or call inside torch.autocast, which "
                "casts them to its dtype."
            )
    check_dtype(dtype, device)


def check_dtype(dtype: torch.dtype, device: torch.device) -> None:
    """A :class:`DtypeError` unless tncomp (and torch's einsum) contract ``dtype`` on
    ``device``: floating and complex dtypes anywhere, integers on the CPU (exact results, no
    gradients), as ``torch.einsum``; never bool, which torch's matrix products refuse."""
    if dtype.is_floating_point or dtype.is_complex:
        return
    if dtype == torch.bool:
        raise DtypeError(f"operands have dtype {dtype}; torch multiplies no bool matrices (nor "
                         "does torch.einsum): cast to an integer or floating dtype.")
    if device.type != "cpu":
        raise DtypeError(f"operands have dtype {dtype} on {device}; torch has integer matrix "
                         "products on the CPU only (torch.einsum refuses them there too): use "
                         "a floating dtype, or CPU tensors.")


def autocast_dtype(device_type: str) -> torch.dtype | None:
    """The dtype ``torch.autocast`` computes matmuls in on ``device_type`` now (None when off,
    and on device types autocast does not know, such as ``meta``). The one home of the autocast
    rule: tncomp's operators and comera's layers (their bias add, their empty-batch results)
    follow it."""
    try:
        if not torch.is_autocast_enabled(device_type):
            return None
        return torch.get_autocast_dtype(device_type)
    except RuntimeError:  # "unknown device type for autocast": nothing is autocast there
        return None


def autocast_cast(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """What autocast does to a matmul operand: float32/float16/bfloat16 to ``dtype``; float64
    (and non-float) tensors are left alone."""
    return t.to(dtype) if t.is_floating_point() and t.dtype != torch.float64 else t


def autocast_operands(operands: tuple) -> tuple:
    """``operands`` as autocast would pass them to a matmul (see :func:`autocast_cast`), in the
    autocast dtype of their device (unchanged when autocast is off there)."""
    if not operands or not isinstance(operands[0], torch.Tensor):
        return operands
    dtype = autocast_dtype(operands[0].device.type)
    if dtype is None:
        return operands
    return tuple(autocast_cast(t, dtype) if isinstance(t, torch.Tensor) else t for t in operands)


def is_empty(operands: Sequence) -> bool:
    """True when some operand has an axis of size 0."""
    return any(isinstance(t, torch.Tensor) and t.numel() == 0 for t in operands)


def einsum_args(net) -> tuple[list[list[int]], list[int]]:
    """``net`` in torch.einsum's sublist form: one list of index numbers per operand, output."""
    numbers: dict[str, int] = {}
    for spec in (*net.operands, net.output):
        for index in spec.indices:
            numbers.setdefault(index, len(numbers))
    return ([[numbers[i] for i in t.indices] for t in net.operands],
            [numbers[i] for i in net.output.indices])


def empty_result(net, operands: Sequence[torch.Tensor]) -> torch.Tensor:
    """What ``torch.einsum`` gives for operands with an empty axis (differentiable, zero
    gradients), after the usual checks of shapes and dtypes. A symbolic size may be 0 unless
    its :class:`~tncomp.Dim` declares ``min`` above 1."""
    check_operands(net, operands)
    bound: dict[str, int] = {}
    declared = net.size_dict
    for spec, t in zip(net.operands, operands, strict=True):
        if t.dim() != len(spec.indices):
            raise SizeError(f"tensor {spec.name!r} should have {len(spec.indices)} axes "
                            f"({', '.join(spec.indices)}), got shape {tuple(t.shape)}.")
        for axis, (index, value) in enumerate(zip(spec.indices, t.shape, strict=True)):
            fixed = declared[index]
            if isinstance(fixed, Dim) and (value or fixed.min > 1):
                fixed.check(value, f"tensor {spec.name!r} axis {axis} ({index})")
            clash = isinstance(fixed, int) and value != fixed
            if clash or bound.setdefault(index, value) != value:
                raise SizeError(f"tensor {spec.name!r} axis {axis} ({index}): size {value} "
                                f"disagrees with {bound.get(index, fixed)} for index {index!r}.")
    inputs, output = einsum_args(net)
    return torch.einsum(*itertools.chain.from_iterable(zip(operands, inputs, strict=True)),
                        output)


def output_shape(net, operands: Sequence[torch.Tensor]) -> list:
    """The output's shape read off the operands' shapes (works for symbolic sizes)."""
    where: dict[str, object] = {}
    for spec, t in zip(net.operands, operands, strict=True):
        for index, size in zip(spec.indices, t.shape, strict=True):
            where.setdefault(index, size)
    return [where[i] for i in net.output.indices]


# -- the operators --------------------------------------------------------------------------------
def _own(t: torch.Tensor, inputs: Sequence[torch.Tensor]) -> torch.Tensor:
    """``t`` as a contiguous tensor that shares no storage with ``inputs`` (an operator's
    outputs may not alias its inputs)."""
    t = t.contiguous()
    ptr = t.untyped_storage().data_ptr()
    if any(x.untyped_storage().data_ptr() == ptr for x in inputs if x.numel()):
        t = t.clone()
    return t


@torch.library.custom_op("tncomp::contract", mutates_args=())
def contract_op(network: str, needs_grad: list[bool], operands: list[torch.Tensor]
                ) -> torch.Tensor:
    """Contract ``operands`` with compiled network #``network``."""
    compiled = lookup(network)
    runner = compiled.runner_for(operands, False)
    return _own(runner.code.forward(*operands)[0], operands)


@contract_op.register_fake
def _contract_fake(network, needs_grad, operands):
    net = lookup(network).network
    return operands[0].new_empty(output_shape(net, operands))


@torch.library.custom_op("tncomp::contract_backward", mutates_args=())
def contract_backward_op(network: str, needs_grad: list[bool], operands: list[torch.Tensor],
                         dy: torch.Tensor) -> list[torch.Tensor]:
    """The gradients of the operands flagged in ``needs_grad``, in order."""
    compiled = lookup(network)
    runner = compiled.runner_for(operands, True, needs_grad)
    _y, saved = runner.code.forward(*operands)
    grads = runner.code.backward(operands, saved, dy)
    return [_own(g, [*operands, dy]) for g in grads if g is not None]


@contract_backward_op.register_fake
def _contract_backward_fake(network, needs_grad, operands, dy):
    return [t.new_empty(t.shape) for t, g in zip(operands, needs_grad, strict=True) if g]


def _setup_context(ctx, inputs, output) -> None:
    network, needs_grad, operands = inputs
    ctx.network = network
    ctx.needs_grad = list(needs_grad)
    ctx.n_saved = 0
    ctx.save_for_backward(*operands)


def _backward(ctx, dy, *_saved_grads):
    tensors = ctx.saved_tensors
    n = len(tensors) - ctx.n_saved
    operands, saved = tensors[:n], tensors[n:]
    needs_grad = ctx.needs_grad
    if not any(needs_grad):
        return None, None, [None] * len(operands)
    if torch.is_grad_enabled() and not torch.compiler.is_compiling():  # create_graph, eager
        runner = lookup(ctx.network).runner_for(operands, True, needs_grad)
        return None, None, list(runner.differentiable_grads(operands, dy))
    if ctx.n_saved:
        grads = contract_backward_saved_op(ctx.network, needs_grad, list(operands),
                                           list(saved), dy)
    else:
        grads = contract_backward_op(ctx.network, needs_grad, list(operands), dy)
    grads = iter(grads)
    return None, None, [next(grads) if g else None for g in needs_grad]


contract_op.register_autograd(_backward, setup_context=_setup_context)


# The plan of concrete sizes is known while tracing (a size dynamo made symbolic is specialized
# by the fake implementation), so the forward hands its saved intermediates to the backward as
# extra outputs (no recomputation).
@torch.library.custom_op("tncomp::contract_saving", mutates_args=())
def contract_saving_op(network: str, needs_grad: list[bool], operands: list[torch.Tensor]
                       ) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Contract ``operands``; also return the intermediates the backward reads."""
    runner = lookup(network).runner_for(operands, True, needs_grad)
    y, saved = runner.code.forward(*operands)
    y = _own(y, operands)
    kept = [y]
    for t in saved:
        kept.append(_own(t, [*operands, *kept]))
    return y, kept[1:]


@contract_saving_op.register_fake
def _contract_saving_fake(network, needs_grad, operands):
    # The saved intermediates' shapes come from the plan of concrete sizes. Dynamo hides
    # symbolic sizes from traced code (a SymInt passes isinstance(s, int) there), so a size
    # made dynamic by a recompile (a new batch size) arrives here: specialize it (int() adds a
    # guard, so each batch size gets its own graph, as with static shapes).
    if any(isinstance(s, torch.SymInt) for t in operands for s in t.shape):
        operands = [t.new_empty(tuple(int(s) for s in t.shape)) for t in operands]
    runner = lookup(network).runner_for(operands, True, needs_grad)
    y, saved = runner.plain().forward(*operands)
    return y.new_empty(y.shape), [t.new_empty(t.shape) for t in saved]


@torch.library.custom_op("tncomp::contract_backward_saved", mutates_args=())
def contract_backward_saved_op(network: str, needs_grad: list[bool],
                               operands: list[torch.Tensor], saved: list[torch.Tensor],
                               dy: torch.Tensor) -> list[torch.Tensor]:
    """The gradients of the operands flagged in ``needs_grad`` from the forward's ``saved``."""
    runner = lookup(network).runner_for(operands, True, needs_grad)
    grads = runner.code.backward(operands, tuple(saved), dy)
    return [_own(g, [*operands, *saved, dy]) for g in grads if g is not None]


@contract_backward_saved_op.register_fake
def _contract_backward_saved_fake(network, needs_grad, operands, saved, dy):
    return [t.new_empty(t.shape) for t, g in zip(operands, needs_grad, strict=True) if g]


def _setup_saving_context(ctx, inputs, output) -> None:
    network, needs_grad, operands = inputs
    _y, saved = output
    ctx.network = network
    ctx.needs_grad = list(needs_grad)
    ctx.n_saved = len(saved)
    ctx.mark_non_differentiable(*saved)
    ctx.save_for_backward(*operands, *saved)


contract_saving_op.register_autograd(_backward, setup_context=_setup_saving_context)


def traced_call(compiled, operands: tuple) -> torch.Tensor:
    """A call while dynamo traces (one ``tncomp::contract`` node) or while a torch.func
    transform is active (:class:`FuncContractFunction`)."""
    if is_empty(operands):
        return empty_result(compiled.network, operands)
    grad = torch.is_grad_enabled()
    if torch.compiler.is_compiling():
        check_operands(compiled.network, operands)
        needs_grad = [grad and t.requires_grad for t in operands]
        if any(needs_grad):  # sizes dynamo made symbolic are specialized by the fake impl
            return contract_saving_op(compiled.op_id, needs_grad, list(operands))[0]
        return contract_op(compiled.op_id, needs_grad, list(operands))
    runner = compiled.runner_for(operands, grad)
    if grad and any(runner.plan.needs_grad):
        return FuncContractFunction.apply(runner, *operands)
    return runner.plain().forward(*operands)[0]
