"""The experiments `comera train` knows: what each task's builder takes."""

from __future__ import annotations


def test_the_lm_and_mlm_tasks_take_the_cores_parametrization():
    from comera.experiments.registry import EXPERIMENTS

    assert {n for n, e in EXPERIMENTS.items() if e.parametrization} == {"lm", "mlm"}
    for name in ("lm", "mlm"):
        default = EXPERIMENTS[name].make_task(True)
        plain = EXPERIMENTS[name].make_task(True, parametrization="plain")
        assert default.config.parametrization == "balanced"  # formats.scaling.FRESH
        assert plain.config.parametrization == "plain"
        assert plain.config.model.parametrization == "plain"  # the held model config's
