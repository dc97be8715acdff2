"""docs/api.md is what docs/gen_api.py writes from the docstrings, and public names have docstrings.

The generator itself is checked against independent facts: every name of ``tncomp.__all__`` and
``comera.__all__`` has an entry, signatures read as ``inspect`` reports them, and the file holds
no ``python`` code fence (tests/test_docs.py would execute it).
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib.util
import inspect
import sys

import pytest

import comera
import tncomp
from tests.helpers import ROOT

API_MD = ROOT / "docs" / "api.md"


@pytest.fixture(scope="module")
def gen():
    """docs/gen_api.py, imported by path (docs/ is not a package)."""
    spec = importlib.util.spec_from_file_location("gen_api", ROOT / "docs" / "gen_api.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["gen_api"] = module  # dataclasses look their module up while the file runs
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop("gen_api", None)


@pytest.fixture(scope="module")
def rendered(gen) -> str:
    return gen.render()


def test_api_md_is_up_to_date(rendered):
    current = API_MD.read_text() if API_MD.is_file() else ""
    if current != rendered:
        diff = difflib.unified_diff(current.splitlines(), rendered.splitlines(),
                                    "docs/api.md (committed)", "docs/api.md (from docstrings)",
                                    lineterm="", n=1)
        shown = "\n".join(list(diff)[:40])
        pytest.fail(f"docs/api.md is out of date: run python docs/gen_api.py\n{shown}")


def test_every_exported_name_has_an_entry(rendered):
    for package in (tncomp, comera):
        missing = [name for name in package.__all__
                   if f'<a id="{package.__name__}.{name}"></a>' not in rendered]
        assert not missing, f"{package.__name__}.__all__ names without an entry: {missing}"
    for qualname in ("comera.experiments.engine.train_model",
                     "comera.experiments.engine.EngineConfig", "comera.experiments.task.Task",
                     "comera.experiments.results.run_experiment",
                     "comera.surgery.report.checkpoint_report", "tncomp.errors.IRError",
                     "comera.integrations.hf.CoMERACallback",  # issue 34, item 13
                     "comera.integrations.lightning.CoMERACallback"):
        assert f'<a id="{qualname}"></a>' in rendered, qualname
    # private helpers and names imported from elsewhere are not public names of a module
    assert 'id="comera.experiments.engine._Run"' not in rendered
    assert 'id="comera.experiments.engine.Task"' not in rendered


def test_signatures_read_as_inspect_reports_them(gen, rendered):
    text = gen.signature_text("compile", tncomp.compile)
    for name, parameter in inspect.signature(tncomp.compile).parameters.items():
        default = "" if parameter.default is inspect.Parameter.empty else repr(parameter.default)
        assert f"    {name}: " in text and default in text, name
    assert "    *,\n    optimize: str = 'auto'," in text  # keyword-only marker kept
    assert text.endswith(") -> CompiledNetwork") and text in rendered
    short = gen.signature_text("clear_cache", tncomp.clear_cache)
    assert short == "clear_cache(disk: bool = False, calibration: bool = False) -> None"
    # a method is shown without self; a class with the arguments of its constructor
    assert gen.signature_text("step", comera.CoMERATrainer.step, drop_first=True) == (
        "step(loss: Tensor, decision_loss: float | None = None) -> StepStats")
    assert ("LateStage(\n    target_size: float,\n    target_loss: float = 0.0,\n"
            "    size_weight: float = 1.0,\n    steps: int | None = None,") in rendered


def test_no_executable_code_fence(rendered):
    assert "```python" not in rendered  # tests/test_docs.py runs every python fence in docs/


def test_docstrings_become_markdown(gen):
    doc = ("See :class:`~tncomp.compiler.ir.Network` and :func:`tncomp.compile`; x * y, a_b, "
           "<task>.\n")
    doc += "\n    code_line = a * b  # kept as code\n"
    text = gen.markdown_doc(doc)
    assert text.splitlines()[0] == r"See `Network` and `tncomp.compile`; x \* y, a\_b, \<task>."
    assert "    code_line = a * b  # kept as code" in text.splitlines()
    assert gen.markdown_doc("``a_b * c``") == "``a_b * c``"  # code spans stay untouched


def test_own_doc_ignores_what_dataclasses_and_bases_fill_in(gen):
    @dataclasses.dataclass(frozen=True)
    class Undocumented:
        x: int = 0

    @dataclasses.dataclass(frozen=True)
    class Documented:
        """A documented config."""

        x: int = 0

    assert inspect.getdoc(Undocumented)  # dataclasses write "Undocumented(x: int = 0)"
    assert gen.own_doc(Undocumented) == ""
    assert gen.own_doc(Documented) == "A documented config."
    assert gen.own_doc(comera.errors.ConfigError).startswith("A bad setting")
    # an undocumented override of a documented method takes the base's docstring; a torch
    # method's docstring is never borrowed
    assert gen.member_doc(comera.TTLinear, "from_linear").startswith("A layer initialised")
    assert gen.member_doc(comera.TTLinear, "compiled").startswith("The compiled contraction")
    assert inspect.getdoc(comera.TTLinear.train)  # nn.Module.train is documented by torch
    assert gen.member_doc(comera.TTLinear, "train") == ""


def test_the_check_mode_reports_a_stale_file(gen, tmp_path, monkeypatch, capsys):
    target = tmp_path / "api.md"
    monkeypatch.setattr(gen, "OUTPUT", target)
    monkeypatch.setattr(gen, "ROOT", tmp_path)
    target.write_text("stale\n")
    assert gen.main(["--check"]) == 1
    assert "run python docs/gen_api.py" in capsys.readouterr().err
    assert gen.main([]) == 0
    assert gen.main(["--check"]) == 0
    assert target.read_text().startswith("<!-- Generated by docs/gen_api.py")


def test_every_public_name_has_a_docstring(gen):
    missing = gen.missing_docstrings()
    assert not missing, f"public names without a docstring: {', '.join(missing)}"


def test_every_public_method_has_a_docstring(gen):
    missing = gen.missing_member_docstrings()
    assert not missing, f"public methods and properties without a docstring: {', '.join(missing)}"
