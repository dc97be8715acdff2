"""`comera train` lists the models of the experiment registry: one list, read where it lives."""

from __future__ import annotations

import pytest

from comera import cli
from comera.experiments import registry


def _train_help() -> str:
    parser = cli.build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    return sub.choices["train"].format_help()


def test_train_help_names_every_registered_experiment(monkeypatch):
    extra = registry.Experiment("toy", "a registered experiment", lambda quick: None,
                                registry.EXPERIMENTS["mlm"].quick,
                                registry.EXPERIMENTS["mlm"].full)
    monkeypatch.setitem(registry.EXPERIMENTS, "toy", extra)
    text = " ".join(_train_help().split())
    assert "one of: " + ", ".join(registry.EXPERIMENTS) in text


def test_an_unknown_model_names_the_registered_ones():
    with pytest.raises(cli.ConfigError, match="choose one of " + ", ".join(registry.EXPERIMENTS)):
        registry.experiment("resnet")
