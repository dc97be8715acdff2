"""The relative-update diagnostic (comera/training/relative_updates.py): it measures what one
optimizer step did to every weight and core, by hand-checkable numbers; the log measures every
k-th step of a loop it does not own, and stops when its context closes; the names before 0.2.0
warn."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import comera
from comera.training.relative_updates import RelativeUpdateLog, relative_updates

F64 = torch.float64


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(comera.TTLinear(16, 16, (4, 4), (4, 4), ranks=3, dtype=F64),
                         nn.Tanh(), nn.Linear(16, 4, dtype=F64))


def test_a_dense_step_is_the_relative_change_of_its_weight():
    model = _model()
    before = model[2].weight.detach().clone()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.randn(8, 16, dtype=F64)).square().sum().backward()
    step = relative_updates(model, opt.step)
    want = float((model[2].weight.detach() - before).norm() / before.norm())
    assert step.layers["2"].kind == "dense"
    assert step.layers["2"].weight == pytest.approx(want, rel=1e-12)
    assert step.layers["2"].cores == (step.layers["2"].weight,)


def test_a_gated_step_measures_the_product_weight_and_every_core():
    model = _model()
    layer = model[0]
    w0 = layer.to_dense().detach().clone()
    cores0 = [c.detach().clone() for c in layer.cores]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(8, 16, dtype=F64)).square().sum().backward()
    update = relative_updates(model, opt.step).layers["0"]
    assert update.kind == "tt" and len(update.cores) == len(layer.cores)
    assert update.weight == pytest.approx(float((layer.to_dense() - w0).norm() / w0.norm()))
    for got, c0, c1 in zip(update.cores, cores0, layer.cores, strict=True):
        assert got == pytest.approx(float((c1.detach() - c0).norm() / c0.norm()))
    assert update.imbalance == max(update.cores) / min(update.cores) >= 1.0


def test_the_log_measures_every_kth_step_and_stops_with_its_context():
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with RelativeUpdateLog(model, every=3) as log:
        for _ in range(7):
            model(torch.randn(8, 16, dtype=F64)).square().sum().backward()
            opt.step()
            opt.zero_grad()
    assert [s for s, _ in log.steps] == [0, 3, 6]
    assert all(u.weight > 0 for _, sizes in log.steps for u in sizes.layers.values())
    opt.step()  # after the context: not measured
    assert len(log.steps) == 3


@pytest.mark.parametrize(("call", "match"), [
    (lambda: relative_updates("model", lambda: None), "nn.Module"),
    (lambda: relative_updates(nn.Linear(2, 2), None), "not callable"),
    (lambda: relative_updates(nn.Tanh(), lambda: None), "nothing|no gated layer"),
    (lambda: RelativeUpdateLog(nn.Linear(2, 2), every=0), "every=0"),
    (lambda: RelativeUpdateLog(nn.Linear(2, 2), every=True), "every=True"),
])
def test_bad_arguments_are_config_errors(call, match):
    with pytest.raises(comera.ConfigError, match=match):
        call()


@pytest.mark.parametrize(("old", "new"), [("update_sizes", "relative_updates"),
                                          ("UpdateSizes", "RelativeUpdates"),
                                          ("UpdateSizeLog", "RelativeUpdateLog")])
def test_the_names_before_the_rename_warn_and_give_the_new_object(old, new):
    import comera.training.relative_updates as home

    for where in (comera, home):
        with pytest.warns(DeprecationWarning, match=rf"{old} is deprecated: use .*\.{new}; "
                                                    r"the old name goes in 0\.3\.0"):
            assert getattr(where, old) is getattr(home, new)
        # RelativeUpdates left comera's face in 0.2.0 (its home keeps it public)
        assert old not in where.__all__ and (new in where.__all__ or (
            where is comera and new == "RelativeUpdates"))
    with pytest.raises(AttributeError, match="has no attribute 'update_size'"):
        home.update_size  # noqa: B018 (a typo is still an AttributeError)
