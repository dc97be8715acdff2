"""benchmarks/studies/lm_frontier.py (on the harness's frontier): each format's model at its
uniform rank within the budget, the flags checked before any work, and a --smoke run on a tiny
corpus."""

from __future__ import annotations

import dataclasses
import json

import pytest

from benchmarks.studies import lm_frontier
from benchmarks.studies.harness.frontier import _clocked, clock_key, label, parse, summarise
from benchmarks.studies.harness.methods import Study, build, check_method
from benchmarks.studies.harness.runs import layer_sizes
from comera.errors import ConfigError
from comera.experiments.engine import EngineConfig
from comera.experiments.lm_task import LMTask, LMTaskConfig
from comera.surgery.records import KINDS
from tests.helpers.tiny_corpus import write_tiny_corpus


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_stdlib")
    write_tiny_corpus(path)
    return path


@pytest.mark.parametrize("target", [2.0, 4.0, 8.0])
def test_each_format_is_at_the_largest_uniform_rank_within_the_budget(root, target, tmp_path):
    task = LMTask(LMTaskConfig(seq_len=16, vocab_size=64, d_model=32, n_heads=2, d_ff=64,
                               n_layers=1), root=root, use_cache=False)
    study = Study(task, EngineConfig(), tmp_path, steps=2)
    dense = layer_sizes(task.block_linears(task.build()))[0]
    assert study.budget(target) == dense / target
    for fmt in ("tt", "lowrank", "btt"):
        r = study.uniform_rank(fmt, target)
        if r == 0:
            assert layer_sizes(task.block_linears(task.build(fmt, 1)))[0] > dense / target
            continue
        assert layer_sizes(task.block_linears(task.build(fmt, r)))[0] <= dense / target
        bigger = layer_sizes(task.block_linears(task.build(fmt, r + 1)))[0]
        assert bigger > dense / target or bigger == layer_sizes(
            task.block_linears(task.build(fmt, r)))[0], fmt  # or every bond at its cap


@pytest.mark.parametrize("flags", [["--methods", "einsum"], ["--lrs", "0"], ["--targets", "1"],
                                   ["--eval-every", "0"], ["--decide", "0"],
                                   ["--late-landing", "0"], ["--late-allocation", "grow"]])
def test_bad_flags_exit_2_before_any_work(flags, tmp_path):
    with pytest.raises(SystemExit) as exit_info:
        lm_frontier.main([*flags, "--out", str(tmp_path / "out")])
    assert exit_info.value.code == 2
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(("flags", "says"), [
    (["--methods", "comera@bogus"], "'bogus' is not a registered format"),
    (["--methods", "comera@dense"], "dense layers have no ranks to prune"),
    (["--methods", "comera@btt", "--late-allocation", "spectrum"],
     "--late-allocation prune runs on every format"),
    (["--methods", "dense", "--widths", "64"], "add narrow to --methods"),
    (["--methods", "narrow", "--widths", "0"], "each a d_model of at least 1"),
    (["--methods", "tt", "--comera-start", "2"], "add comera or comera@<format>"),
    (["--methods", "comera@btt", "--targets", "8", "--comera-start", "8"],
     "below every target"),
])
def test_comera_on_a_format_and_widths_flags_exit_2_naming_the_fix(flags, says, tmp_path,
                                                                   capsys):
    with pytest.raises(SystemExit) as exit_info:
        lm_frontier.main([*flags, "--out", str(tmp_path / "out")])
    assert exit_info.value.code == 2 and says in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(("flags", "says"), [
    (["--methods", "narrow", "--widths", "8", "15"], "width 15: a d_model is a positive "
                                                      "multiple of the 2 heads (e.g. 16)"),
    (["--methods", "narrow", "--widths", "16"], "the task's own d_model"),
    (["--methods", "comera@btt", "--targets", "4"], "at 4x: the btt model's block layers"),
])
def test_what_the_model_refuses_exits_2_before_training(root, flags, says, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        lm_frontier.main(["--smoke", "--root", str(root), "--seeds", "0", *flags, "--out",
                          str(tmp_path / "out"), "--work", str(tmp_path / "w")])
    assert exit_info.value.code == 2 and says in capsys.readouterr().err
    assert not (tmp_path / "out").exists() and not (tmp_path / "w").exists()


def test_comera_on_a_format_and_widths_are_named_in_the_report():
    from benchmarks.studies.harness.frontier import label

    assert label("comera@btt:balanced") == ("CoMERA (early + late) on block tensor train "
                                            "(balanced parametrization)")
    assert label("comera@btt early") == "CoMERA early stage on block tensor train"
    assert label("comera:plain early") == "CoMERA early stage (plain parametrization)"
    assert label("dense@96") == "dense, d_model 96"
    assert clock_key("dense@96", None) == "dense@96"
    ranks = {"blocks.0.ffn_in": [2, 1]}  # BTT's bonds, no chain ends
    rows = [_row("comera@btt:balanced", 8.0, 0, 3.5, ranks=ranks, format="btt"),
            _row("btt:balanced", 8.0, 0, 3.6, rank=1),
            _row("dense@64", None, 0, 3.4, d_model=64, d_ff=256)]
    text = summarise(lm_frontier.SPEC, {"data": {}, "runs": [], "rows": rows})
    assert "uniform block tensor train rank 1): blocks.0.ffn_in: [2, 1]" in text
    assert "| - | dense, d_model 64 |" in text and "d 64, ff 256" in text


def test_fixed_is_the_tt_method_and_the_grid_defaults_to_lr():
    args = parse(lm_frontier.SPEC, ["--methods", "dense", "fixed", "tt", "narrow"])
    assert args.methods == ["dense", "tt", "narrow"] and args.lrs == [2e-3]


def test_the_late_stage_flags_reach_the_engine(root):
    from benchmarks.studies.harness.frontier import study

    args = parse(lm_frontier.SPEC, ["--late-allocation", "spectrum", "--late-landing", "0.5"])
    task = LMTask(LMTaskConfig(seq_len=16, vocab_size=64, d_model=32, n_heads=2, d_ff=64,
                               n_layers=1), root=root, use_cache=False)
    config = study(lm_frontier.SPEC, args, task).config
    assert (config.late_allocation, config.late_landing) == ("spectrum", 0.5)
    defaults = study(lm_frontier.SPEC, parse(lm_frontier.SPEC, []), task).config
    assert (defaults.late_allocation, defaults.late_landing) == ("prune", 0.75)


@pytest.mark.slow
def test_smoke_run_writes_every_method(root, tmp_path):
    out = tmp_path / "out"
    common = ["--smoke", "--root", str(root), "--seeds", "0", "--targets", "4", "--out",
              str(out), "--work", str(tmp_path / "work"), "--max-rank", "4"]
    argv = [*common, "--tag", "smoke", "--lrs", "2e-3", "4e-3", "--methods", "dense", "narrow",
            "tt", "lowrank", "comera"]
    assert lm_frontier.main(argv) == 0
    result = json.loads((out / "frontier.json").read_text())
    assert '"curves"' not in (out / "frontier.json").read_text()  # the summary: no curves
    runs = json.loads((out / "curves" / "runs" / "smoke.json").read_text())
    assert all(row["curves"]["val"][-1][1] > 0 for row in runs["rows"])  # wall-clock, kept
    methods = {r["method"] for r in result["rows"]}
    assert methods == {"dense", "narrow", "comera early", "comera", "tt", "lowrank"}
    assert {r["lr"] for r in result["rows"]} == {2e-3, 4e-3}
    for row in result["rows"]:
        assert row["val"]["perplexity"] > 1 and row["test"]["loss"] > 0
        if row["method"] in ("tt", "lowrank"):
            assert row["compression"] >= 4.0
        if row["method"] == "comera":  # how its late stage ran
            assert (row["late_allocation"], row["late_landing"]) == ("prune", 0.75)
        if row["method"] == "narrow":  # the whole model matches: its block layers get more
            assert 1.0 < row["compression"] < 4.0
    assert result["runs"][0]["command"].startswith(
        "python -m benchmarks.studies.lm_frontier --smoke")
    text = (out / "frontier.md").read_text()
    assert "TT at a uniform rank" in text and "narrower dense" in text and "CoMERA" in text
    assert (out / "frontier.png").is_file() and (out / "frontier_curves.png").is_file()
    # a second call with --resume reads the early model back and adds its rows
    assert lm_frontier.main([*common, "--tag", "more", "--resume", "--lrs", "2e-3",
                             "--methods", "comera"]) == 0
    merged = json.loads((out / "frontier.json").read_text())
    assert len(merged["rows"]) == len(result["rows"]) + 2


def test_the_clock_names_each_method_as_lm_clock_does():
    assert clock_key("dense", None) == "dense"
    assert clock_key("narrow", 8.0) == "narrow 8x"
    assert clock_key("tt:balanced", 8.0) == clock_key("tt", 8.0) == "tt 8x"
    assert clock_key("btt:plain", 16.0) == "btt 16x"
    assert clock_key("comera:plain early", None) == ""  # untargeted: no clock


def test_clocked_curves_are_the_steps_times_the_step_time():
    row = {"curves": {"val": [[0, 0.0, {"loss": 7.0}], [100, 55.0, {"loss": 4.0}]]}}
    (out,) = _clocked([row], 250.0)
    assert out["curves"]["val"] == [[0, 0.0, {"loss": 7.0}], [100, 25.0, {"loss": 4.0}]]
    assert row["curves"]["val"][1][1] == 55.0  # the run's own row is left as it was


def test_a_missing_clock_file_exits_2_before_any_work(tmp_path):
    with pytest.raises(SystemExit) as exit_info:
        lm_frontier.main(["--clock", str(tmp_path / "none.json"), "--out", str(tmp_path / "o")])
    assert exit_info.value.code == 2
    assert not (tmp_path / "o").exists()


def test_tt_order_sets_the_modes_per_side_of_the_block_layers():
    from benchmarks.studies.harness.frontier import task_config

    args = parse(lm_frontier.SPEC, ["--d-model", "64", "--tt-order", "2"])
    config = task_config(LMTaskConfig, args)
    assert config.tt_order == 2 and config.model_config(100, "tt").tt_order == 2
    assert task_config(LMTaskConfig, parse(lm_frontier.SPEC, [])).tt_order == 3


def test_tt_order_is_refused_early_where_wrong(capsys):
    from benchmarks.studies.harness.frontier import task_config

    with pytest.raises(SystemExit) as e:
        parse(lm_frontier.SPEC, ["--tt-order", "0"])
    assert e.value.code == 2 and "--tt-order 0" in capsys.readouterr().err

    @dataclasses.dataclass(frozen=True)
    class NoOrder:
        rank: int = 1

    with pytest.raises(SystemExit) as e:
        task_config(NoOrder, parse(lm_frontier.SPEC, ["--tt-order", "2"]))
    assert e.value.code == 2 and "no modes per side" in capsys.readouterr().err


def _row(method, target, seed, loss, **extra):
    return {"method": method, "target": target, "seed": seed, "lr": 3e-3, "compression": 8.0,
            "val": {"loss": loss, "perplexity": 2.0 ** loss}, "test": {"loss": loss}, **extra}


def test_a_study_without_dense_says_so_and_lists_comeras_ranks_by_parametrization():
    ranks = {"blocks.0.ffn_in": [1, 4, 9, 1]}
    rows = [_row("comera:plain", 8.0, s, 3.5 + s / 10, ranks=ranks) for s in (0, 1)]
    rows += [_row("comera:plain early", None, 0, 3.4), _row("tt:plain", 8.0, 0, 3.6, rank=7)]
    result = {"data": {}, "runs": [], "rows": rows}
    text = summarise(lm_frontier.SPEC, result)
    row = next(line for line in text.splitlines() if line.startswith("| 8x | CoMERA"))
    assert "3.5500 ± 0.0707" in row and "| - |" in row and "nan%" not in text
    assert "uniform TT rank 7): blocks.0.ffn_in: [4, 9]" in text


def test_cola_is_a_method_at_the_largest_rank_within_the_budget(root, tmp_path):
    """CoLA (not a weight format) trains on the engine like the formats: at the largest rank
    whose block layers hold at most dense / target, its rows named and titled by its kind."""
    task = LMTask(LMTaskConfig(seq_len=16, vocab_size=64, d_model=32, n_heads=2, d_ff=64,
                               n_layers=1, eval_limit=8), root=root, use_cache=False)
    study = Study(task, EngineConfig(batch_size=4, eval_every=2, threads=1), tmp_path, steps=4)
    dense = layer_sizes(task.block_linears(task.build()))[0]
    rank = study.uniform_rank("cola", 4.0)
    assert rank == study.uniform_rank("lowrank", 4.0) and rank >= 1  # r (in + out) each
    sizes = [layer_sizes(task.block_linears(build(task, "cola", r)))[0] for r in (rank, rank + 1)]
    assert sizes[0] <= dense / 4.0 < sizes[1]
    assert label("cola:balanced") == "CoLA (B silu(A x)) at a uniform rank (balanced " \
        "parametrization)"
    with pytest.raises(ConfigError, match="method 'cola@tt'"):
        check_method("cola@tt")


@pytest.mark.skipif("ColaLinear" not in KINDS, reason="the engine's checkpoints need the "
                    "ColaLinear record kind (comera/surgery/records.py)")
def test_cola_trains_on_the_engine_as_a_format_does(root, tmp_path):
    task = LMTask(LMTaskConfig(seq_len=16, vocab_size=64, d_model=32, n_heads=2, d_ff=64,
                               n_layers=1, eval_limit=8), root=root, use_cache=False)
    study = Study(task, EngineConfig(batch_size=4, eval_every=2, threads=1), tmp_path, steps=4)
    (row,) = study.method("cola:balanced", [4.0], seed=0, lr=3e-3)
    rank = study.uniform_rank("cola", 4.0)
    assert (row["method"], row["format"], row["rank"]) == ("cola:balanced", "cola", rank)
    assert row["compression"] >= 4.0 and row["steps"] == 4 and row["val"]["loss"] > 0


# -- method options: +zero, +rms<F>, +cores<D> ---------------------------------------------------
def test_method_options_parse_and_name_their_rows():
    from benchmarks.studies.harness.methods import kind_title
    from benchmarks.studies.harness.options import split_options

    assert split_options("btt+zero+rms2") == ("btt", {"zero": True, "rms": 2.0})
    assert split_options("btt+rms") == ("btt", {"rms": 1.0})
    assert split_options("btt+cores2") == ("btt", {"cores": 2})
    assert split_options("btt") == ("btt", {})
    for name in ("btt+zero:balanced", "btt+zero+rms1.5:plain", "ttm+cores2", "lowrank+rms"):
        assert check_method(name) == name
    assert kind_title("btt+zero+rms2") == ("block tensor train + zero-init outputs + core RMS "
                                           "<= 2x init")
    assert label("btt+zero:balanced") != label("btt:balanced")
    assert clock_key("btt+rms:balanced", 8.0) == "btt+rms 8x"  # a step of its own


@pytest.mark.parametrize(("name", "says"), [
    ("btt+bogus", "method option 'bogus'"), ("btt+rms0", "method option 'rms0'"),
    ("btt+rmsx", "method option 'rmsx'"), ("btt+cores1", "method option 'cores1'"),
    ("btt+zero+zero", "given twice"), ("dense+zero", "go on a layer format"),
    ("comera@btt+zero", "go on a layer format"), ("narrow+rms", "go on a layer format"),
    ("lowrank+cores2", "uses no modes")])
def test_bad_method_options_are_refused_naming_the_choices(name, says, tmp_path):
    with pytest.raises(ConfigError, match=says):
        check_method(name)
    with pytest.raises(SystemExit) as exit_info:
        lm_frontier.main(["--methods", name, "--out", str(tmp_path / "out")])
    assert exit_info.value.code == 2 and not (tmp_path / "out").exists()


def _tiny(root):
    return LMTask(LMTaskConfig(seq_len=16, vocab_size=64, d_model=32, n_heads=2, d_ff=64,
                               n_layers=1), root=root, use_cache=False)


def test_zero_starts_each_residual_output_at_zero_and_rms_bounds_the_cores(root, tmp_path):
    import torch

    from benchmarks.studies.harness.options import RESIDUAL_OUTPUTS
    from comera.training.core_rms import core_rms_bounds

    task = _tiny(root)
    study = Study(task, EngineConfig(), tmp_path, steps=2)
    torch.manual_seed(0)
    model = study.with_options(build(task, "btt", 1), {"zero": True, "rms": 1.0})
    layers = dict(task.block_linears(model))
    ends = [n for n in layers if n.endswith(RESIDUAL_OUTPUTS)]
    assert len(ends) == 2 * task.config.n_layers
    for name, layer in layers.items():
        y = layer(torch.randn(3, layer.in_features))
        zero = torch.equal(y, torch.zeros(3, layer.out_features))
        assert zero == (name in ends), name
    q = layers["blocks.0.attn.q"]
    with torch.no_grad():
        q.cores[0].mul_(10.0)
    model.train()
    model(torch.zeros(1, 4, dtype=torch.long))  # the bound runs before a training forward
    rms = float(q.cores[0].detach().pow(2).mean().sqrt())
    assert rms == pytest.approx(core_rms_bounds(q)[0], rel=1e-5)


def test_cores_option_builds_and_sizes_the_model_at_that_order(root, tmp_path):
    task = _tiny(root)
    study = Study(task, EngineConfig(), tmp_path, steps=2)
    rank = study.uniform_rank("btt+cores2", 2.0)
    assert rank >= 1
    model = build(task, "btt", rank, **study.option_sizes("btt+cores2"))
    assert all(len(m.in_modes) == 2 for _, m in task.block_linears(model))
    assert layer_sizes(task.block_linears(model))[0] <= study.budget(2.0)
    assert layer_sizes(task.block_linears(build(task, "btt", rank + 1, tt_order=2)))[0] > (
        study.budget(2.0))


def test_an_option_row_trains_on_the_engine_and_records_its_options(root, tmp_path):
    task = _tiny(root)
    study = Study(task, EngineConfig(batch_size=4, eval_every=1, threads=1), tmp_path, steps=2)
    rows = study.method("btt+zero+rms2:balanced", [2.0], seed=0, lr=1e-3)
    assert [(r["method"], r["format"], r["options"]) for r in rows] == [
        ("btt+zero+rms2:balanced", "btt", {"zero": True, "rms": 2.0})]
    assert rows[0]["val"]["loss"] > 0


def test_cbs_keeps_the_weights_and_reads_the_cores_under_the_structure_aware_multipliers(
        root, tmp_path):
    import torch

    from comera.formats.scaling import structure_aware_multipliers

    task = _tiny(root)
    study = Study(task, EngineConfig(), tmp_path, steps=2)
    torch.manual_seed(0)
    model = build(task, "btt", 1)
    before = {n: m.to_dense().detach().clone() for n, m in task.block_linears(model)}
    study.with_options(model, {"cbs": True})
    for name, layer in task.block_linears(model):
        assert layer.core_scale_values == structure_aware_multipliers(layer.layout)
        torch.testing.assert_close(layer.to_dense(), before[name], rtol=1e-6, atol=1e-7)
