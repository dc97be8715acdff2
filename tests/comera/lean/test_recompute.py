"""recomputed_in_backward: autograd keeps a recipe, not the tensor; gradients are unchanged."""

import pytest
import torch

from benchmarks.lib.memory import held_bytes
from comera.lean.recompute import hooks_available, recomputed_in_backward


class _Counted:
    """A recipe that counts its runs: ``2 * a``."""

    def __init__(self, a: torch.Tensor):
        self.a, self.runs = a, 0

    def __call__(self) -> torch.Tensor:
        self.runs += 1
        return self.a * 2


def _through_views(t: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Ops that save ``t`` and two views of it for their backward."""
    return (t @ w).sum() + (t.t() @ t).sum() + (t[1:, ::2] * t[:-1, ::2]).sum()


def _grads(a, w, recompute: bool):
    a = a.detach().requires_grad_()
    t = a * 2
    recipe = _Counted(a)
    with recomputed_in_backward([(t, recipe)] if recompute else []):
        loss = _through_views(t, w)
    loss.backward()
    return loss, a.grad, recipe.runs


def test_views_are_rebuilt_once_with_bit_identical_gradients():
    a = torch.randn(6, 8, dtype=torch.float64)
    w = torch.randn(8, 3, dtype=torch.float64)
    loss, grad, runs = _grads(a, w, recompute=True)
    want_loss, want_grad, _ = _grads(a, w, recompute=False)
    assert torch.equal(loss, want_loss) and torch.equal(grad, want_grad)
    assert runs == 1  # one rebuild serves every saved view


def test_the_tensor_is_not_held_between_forward_and_backward():
    a = torch.randn(512, 512, requires_grad=True)
    w = torch.randn(512, 512, requires_grad=True)  # so the product saves t

    def forward(recompute: bool):
        t = a * 2
        with recomputed_in_backward([(t, lambda: a * 2)] if recompute else []):
            return (t @ w).sum()

    held = held_bytes(lambda: forward(True))
    held_plain = held_bytes(lambda: forward(False))
    assert held_plain - held == 512 * 512 * 4


def test_double_backward_differentiates_through_the_recipe():
    a = torch.randn(4, 5, dtype=torch.float64, requires_grad=True)
    w = torch.randn(5, 3, dtype=torch.float64)

    def f(a):
        t = torch.sin(a)
        with recomputed_in_backward([(t, lambda: torch.sin(a))]):
            return torch.tanh(t @ w)

    assert torch.autograd.gradcheck(f, (a,))
    assert torch.autograd.gradgradcheck(f, (a,))


def test_stands_aside_under_an_outer_hook_without_grad_and_under_torch_func():
    a = torch.randn(6, 8)
    w = torch.randn(8, 3)
    t = (a * 2).requires_grad_()
    recipe = _Counted(a)
    with torch.autograd.graph.save_on_cpu():
        assert not hooks_available()
        with recomputed_in_backward([(t, recipe)]):
            _through_views(t, w).backward()
    assert recipe.runs == 0  # the enclosing hook saw the tensors themselves
    with torch.no_grad():
        assert not hooks_available()

    def loss(a):
        t = a * 2
        with recomputed_in_backward([(t, lambda: a * 2)]):
            return _through_views(t, w)

    grad = torch.func.grad(loss)(a)
    _, want, _ = _grads(a, w, recompute=False)
    torch.testing.assert_close(grad, want)


@pytest.mark.parametrize("make", [lambda a: (a * 2)[1:], lambda a: (a * 2).t(),
                                  lambda a: torch.zeros(0, requires_grad=True)])
def test_tensors_that_do_not_own_their_storage_are_saved_as_usual(make):
    a = torch.randn(6, 8, requires_grad=True)
    t = make(a)
    recipe = _Counted(a)
    with recomputed_in_backward([(t, recipe)]):
        torch.sin(t).sum().backward()
    assert recipe.runs == 0


def test_a_tensor_changed_in_place_before_it_is_saved_is_saved_as_usual():
    """The recipe rebuilds the values from before the change: autograd must keep the tensor."""
    a = torch.randn(6, 8, dtype=torch.float64, requires_grad=True)
    w = torch.randn(8, 3, dtype=torch.float64, requires_grad=True)
    grads = []
    for recompute in (True, False):
        w.grad = None
        t = a * 2
        recipe = _Counted(a)
        with recomputed_in_backward([(t, recipe)] if recompute else []):
            loss = (t.mul_(3) @ w).sum()
        loss.backward()
        grads.append(w.grad.clone())
        assert recipe.runs == 0
    assert torch.equal(grads[0], grads[1])
