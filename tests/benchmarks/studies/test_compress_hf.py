"""benchmarks/studies/compress_hf.py: the HuggingFace GPT-2 and Llama runs on a tiny corpus and
config (dict calibration batches, peak RSS recorded, --model)."""

from __future__ import annotations

import json

import pytest
import torch

import comera
from benchmarks.studies import compress_hf
from tests.helpers.tiny_corpus import write_tiny_corpus

pytest.importorskip("transformers")


@pytest.mark.slow
@pytest.mark.parametrize(("model", "name"), [("gpt2", "hf_small"), ("llama", "hf_llama_small")])
def test_small_model_converts_with_dict_batches(tmp_path, model, name):
    write_tiny_corpus(tmp_path / "corpus")
    argv = ["small", "--model", model, "--smoke", "--root", str(tmp_path / "corpus"), "--steps",
            "3", "--seeds", "0", "1", "--calib-rows", "16", "--out", str(tmp_path)]
    assert compress_hf.main(argv) == 0
    result = json.loads((tmp_path / f"{name}.json").read_text())
    arms = [(r["format"], r["arm"], r["seed"]) for r in result["rows"]]
    assert arms == [(f, a, s) for f in ("tt", "lowrank") for a, s in
                    (("uniform/plain", 0), ("global/calibrated", 0), ("global/calibrated", 1))]
    for row in result["rows"]:
        assert row["val"]["perplexity"] > 1 and row["compression"] > 1.5
        assert row["batches"] == (1 if row["arm"] == "global/calibrated" else 0)


@pytest.mark.slow
def test_124m_command_records_peak_memory(tmp_path):
    argv = ["124m", "--tiny", "--batches", "2", "--batch", "2", "--tokens", "8", "--out",
            str(tmp_path)]
    assert compress_hf.main(argv) == 0
    result = json.loads((tmp_path / "gpt2_124m_2.json").read_text())
    assert result["batches"] == 2 and result["layers"] == 8
    assert result["statistics_mib"] > 0 and result["peak_rss_mib"]["converted"] > 0
    assert result["compression"] > 1.5


@pytest.mark.slow
def test_floor_command_measures_every_arm(tmp_path):
    write_tiny_corpus(tmp_path / "corpus")
    argv = ["floor", "--smoke", "--root", str(tmp_path / "corpus"), "--steps", "3", "--targets",
            "2", "--formats", "lowrank", "--calib-rows", "16", "--cache", str(tmp_path / "c"),
            "--out", str(tmp_path), "--seeds", "0", "1"]
    assert compress_hf.main(argv) == 0
    result = json.loads((tmp_path / "hf_floor.json").read_text())
    arms = list(compress_hf.FLOOR_ARMS)
    assert [r["arm"] for r in result["rows"]] == arms + arms[1:]  # plain: once, no seed
    assert [r["seed"] for r in result["rows"]] == [0] * len(arms) + [1] * (len(arms) - 1)
    for row in result["rows"]:
        assert row["val"]["perplexity"] > 1 and row["compression"] > 1.5
        if "+measured" in row["arm"] or row["arm"].startswith("sensitivity"):
            other = "global" if "+measured" in row["arm"] else "sensitivity"
            assert set(row["losses"]) == {"dense", "uniform", other}
            assert row["kept"] in ("uniform", other)
            assert row["losses"][row["kept"]] <= min(row["losses"]["uniform"],
                                                     row["losses"][other])
        else:
            assert row["losses"] == {}
    table = (tmp_path / "hf_floor.md").read_text()
    assert "| lowrank | 2x |" in table and " ± " in table and "compress_hf" in table
    assert (tmp_path / "c").is_dir()  # the trained model is kept for the next run


def test_floor_table_shows_spread_kept_ranks_and_an_unspent_budget():
    def row(arm, seed, ppl, compression=2.0, kept="", losses=None):
        return {"format": "tt", "target": 2.0, "arm": arm, "seed": seed, "kept": kept,
                "compression": compression, "losses": losses or {},
                "val": {"perplexity": ppl}}

    measured = {"dense": 1.0, "uniform": 1.2, "sensitivity": 1.1}
    result = {"dense": {"perplexity": 9.0}, "rows": [
        row("uniform/plain", 0, 12.0),
        row("sensitivity/calibrated", 0, 10.0, 2.6, "sensitivity", measured),
        row("sensitivity/calibrated", 1, 11.0, 2.6, "uniform", measured)]}
    table = compress_hf.floor_table(result)
    assert "| tt | 2x | 12.00 | 10.50 ± 0.71 (sensitivity/uniform, 2.60x) |" in table


def test_finetune_command_fine_tunes_every_arm_at_every_rate(tmp_path):
    write_tiny_corpus(tmp_path / "corpus")
    argv = ["finetune", "--smoke", "--root", str(tmp_path / "corpus"), "--steps", "3",
            "--target", "2", "--format", "lowrank", "--calib-rows", "16", "--ft-steps", "2",
            "--lrs", "1e-4", "1e-2", "--cache", str(tmp_path / "c"), "--out", str(tmp_path),
            "--seeds", "0", "1"]
    assert compress_hf.main(argv) == 0
    result = json.loads((tmp_path / "hf_finetune.json").read_text())
    arms = list(compress_hf.FINETUNE_ARMS)
    assert [(r["seed"], r["arm"], r["lr"]) for r in result["rows"]] == [
        (s, a, lr) for s in (0, 1) for a in arms for lr in (1e-4, 1e-2)]
    dense = [r for r in result["rows"] if r["arm"] == "dense"]
    assert all(r["before"] == pytest.approx(result["dense"]["perplexity"]) for r in dense)
    for row in result["rows"]:
        assert row["after"] > 1 and row["after"] != row["before"]  # the fine-tune moved it
    for row in result["rows"]:  # the size each converted arm reached is recorded
        assert ("compression" not in row if row["arm"] == "dense"
                else row["compression"] >= 1.9)
    table = (tmp_path / "hf_finetune.md").read_text()
    assert "| sensitivity/calibrated |" in table and "**" in table and " ± " in table
    assert "Compression reached: uniform/plain " in table and "dense " not in table.split(
        "Compression reached:")[1].splitlines()[0]


def test_the_narrow_control_is_the_widest_model_within_the_converted_size(tmp_path):
    write_tiny_corpus(tmp_path / "corpus")
    argv = ["finetune", "--smoke", "--root", str(tmp_path / "corpus"), "--steps", "3",
            "--target", "4", "--format", "lowrank", "--ft-steps", "2", "--lrs", "1e-3",
            "--arms", "narrow", "--cache", str(tmp_path / "c"), "--out", str(tmp_path)]
    assert compress_hf.main(argv) == 0
    (row,) = json.loads((tmp_path / "hf_finetune.json").read_text())["rows"]
    task = compress_hf.make_task("lm", True, tmp_path / "corpus")
    build = compress_hf.MODELS["gpt2"].build
    count = lambda w: sum(p.numel() for p in build(task.vocab, task.config.seq_len, w)  # noqa: E731
                          .parameters())
    assert row["width"] < 128 and row["parameters"] == count(row["width"])
    assert count(row["width"]) <= row["budget"] < count(row["width"] + 4)  # the widest that fits
    assert row["after"] < row["before"]  # trained from scratch: 3 + 2 steps moved it
    assert "narrow: the model at width" in (tmp_path / "hf_finetune.md").read_text()


def test_finetune_table_marks_each_arms_best_rate():
    rows = [{"arm": "a", "seed": s, "lr": lr, "before": 50.0 + s, "after": after + s}
            for s in (0, 1) for lr, after in ((1e-4, 40.0), (3e-4, 30.0), (1e-3, 35.0))]
    table = compress_hf.finetune_table({"rows": rows})
    assert "| a | 50.50 ± 0.71 | 40.50 ± 0.71 | **30.50 ± 0.71** | 35.50 ± 0.71 |" in table


def _smoke_finetune(tmp_path, *extra: str) -> list[str]:
    """``finetune`` on a tiny corpus written under ``tmp_path``: a smoke model pretrained 3
    steps, lowrank at 2x, 16 calibration rows, 2 fine-tune steps; then ``extra``."""
    write_tiny_corpus(tmp_path / "corpus")
    return ["finetune", "--smoke", "--root", str(tmp_path / "corpus"), "--steps", "3",
            "--target", "2", "--format", "lowrank", "--calib-rows", "16", "--ft-steps", "2",
            "--cache", str(tmp_path / "c"), "--out", str(tmp_path), *extra]


def test_finetune_extend_measures_only_missing_cells_and_each_parametrization(tmp_path):
    common = _smoke_finetune(tmp_path, "--seeds", "0", "--arms", "dense", "uniform/plain")
    assert compress_hf.main([*common, "--lrs", "1e-4"]) == 0
    first = json.loads((tmp_path / "hf_finetune.json").read_text())["rows"]
    assert compress_hf.main([*common, "--lrs", "1e-4", "1e-2", "--extend",
                             "--parametrizations", "plain", "balanced"]) == 0
    result = json.loads((tmp_path / "hf_finetune.json").read_text())
    assert result["rows"][:2] == first  # kept, not measured again
    assert [(r["arm"], r["parametrization"], r["lr"]) for r in result["rows"][2:]] == [
        ("dense", None, 1e-2), ("uniform/plain", "plain", 1e-2),
        ("uniform/plain", "balanced", 1e-4), ("uniform/plain", "balanced", 1e-2)]
    plain, balanced = (r for r in result["rows"][2:] if r["lr"] == 1e-2 and r["parametrization"])
    assert plain["before"] == pytest.approx(balanced["before"], rel=1e-4)  # same product
    assert plain["after"] != balanced["after"]  # trained differently
    assert len(result["commands"]) == 2
    table = (tmp_path / "hf_finetune.md").read_text()
    assert "| uniform/plain | balanced |" in table and "| dense | - |" in table
    with pytest.raises(SystemExit, match=r"target: 2\.0 there, 4\.0 here"):
        compress_hf.main([*common[:-3], "--lrs", "1e-4", "--extend", "--target", "4"])


def test_finetune_extend_reads_the_settings_of_an_older_file_from_its_command(tmp_path):
    old = {"command": "python -m benchmarks.studies.compress_hf finetune --format tt "
                      "--target 4 --seeds 0 1 2", "rows": []}
    (tmp_path / "hf_finetune.json").write_text(json.dumps(old))
    args = compress_hf.parser().parse_args(["finetune", "--format", "tt", "--target", "2",
                                            "--extend", "--out", str(tmp_path)])
    with pytest.raises(SystemExit, match=r"target: 4\.0 there, 2\.0 here"):
        compress_hf._kept_rows(args, tmp_path / "hf_finetune.json")
    args.target = 4.0
    assert compress_hf._kept_rows(args, tmp_path / "hf_finetune.json") == ([], [old["command"]])


def test_finetune_table_bolds_the_best_cell_across_parametrizations_and_flags_an_edge():
    rows = [{"arm": "a", "seed": s, "parametrization": p, "lr": lr, "before": 50.0,
             "after": after + s}
            for s in (0, 1) for p, lr, after in (
                ("plain", 3e-4, 40.0), ("plain", 1e-3, 35.0), ("plain", 3e-3, 33.0),
                ("balanced", 3e-4, 38.0), ("balanced", 1e-3, 31.0), ("balanced", 3e-3, 32.0))]
    rows += [{"arm": "b", "seed": 0, "parametrization": "plain", "lr": lr, "before": 50.0,
              "after": after} for lr, after in ((3e-4, 30.0), (1e-3, 31.0), (3e-3, 32.0))]
    table = compress_hf.finetune_table({"rows": rows, "pretrain_lr": 1e-3})
    assert ("| a | balanced | 50.00 ± 0.00 | 38.50 ± 0.71 (2) | **31.50 ± 0.71 (2)** | "
            "32.50 ± 0.71 (2) | 0.001 (1x) |") in table
    assert ("| a | plain | 50.00 ± 0.00 | 40.50 ± 0.71 (2) | 35.50 ± 0.71 (2) | "
            "33.50 ± 0.71 (2) |  |") in table
    assert "**30.00 (1)** | 31.00 (1) | 32.00 (1) | 0.0003 (0.3x, edge) |" in table



def test_finetune_at_best_adds_seeds_at_each_arms_best_cell(tmp_path):
    common = _smoke_finetune(tmp_path, "--arms", "dense", "uniform/plain")
    with pytest.raises(SystemExit, match="pass --extend"):
        compress_hf.main([*common, "--seeds", "1", "--at-best"])
    with pytest.raises(SystemExit, match="screen the grid first"):
        compress_hf.main([*common, "--seeds", "1", "--at-best", "--extend"])
    assert compress_hf.main([*common, "--seeds", "0", "--lrs", "1e-4", "1e-2",
                             "--parametrizations", "plain", "balanced"]) == 0
    grid = json.loads((tmp_path / "hf_finetune.json").read_text())["rows"]
    best = {arm: min((r for r in grid if r["arm"] == arm), key=lambda r: r["after"])
            for arm in ("dense", "uniform/plain")}
    assert compress_hf.main([*common, "--seeds", "1", "--at-best", "--extend"]) == 0
    added = json.loads((tmp_path / "hf_finetune.json").read_text())["rows"][len(grid):]
    assert [(r["seed"], r["arm"], r["parametrization"], r["lr"]) for r in added] == [
        (1, arm, best[arm]["parametrization"], best[arm]["lr"]) for arm in best]


# -- --model llama --------------------------------------------------------------------------------
LLAMA_LINEARS = {f"hf.model.layers.{i}.{name}" for i in range(2) for name in (
    "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
    "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")}


def test_llama_converts_its_decoder_linears_and_nothing_else():
    torch.manual_seed(0)
    model = compress_hf.small_llama(64, 16)
    converted, report = compress_hf.floor_arm(model, "lowrank", 2.0, "uniform/plain", [],
                                              include=compress_hf.MODELS["llama"].include)
    assert {name for name, _ in comera.gated_layers(converted)} == LLAMA_LINEARS
    assert len(report.layers) == len(LLAMA_LINEARS)
    assert type(converted.hf.lm_head) is torch.nn.Linear  # the head and embeddings stay dense
    assert type(converted.hf.model.embed_tokens) is torch.nn.Embedding
    assert not list(comera.gated_layers(model))  # a copy was converted, not the model
    ids = torch.randint(0, 64, (2, 16))
    assert converted(ids).shape == (2, 16, 64)


@pytest.mark.parametrize("arms", [
    ("uniform/plain", "global/calibrated"),
    pytest.param(("sensitivity/calibrated",), marks=pytest.mark.slow)])  # ~20 s, loaded
def test_floor_runs_the_llama_end_to_end(tmp_path, arms):
    write_tiny_corpus(tmp_path / "corpus")
    argv = ["floor", "--model", "llama", "--smoke", "--root", str(tmp_path / "corpus"),
            "--steps", "3", "--targets", "2", "--formats", "lowrank", "--arms", *arms,
            "--calib-rows", "16", "--cache", str(tmp_path / "c"), "--out", str(tmp_path)]
    assert compress_hf.main(argv) == 0
    result = json.loads((tmp_path / "hf_llama_floor.json").read_text())
    assert result["model"] == "llama"
    assert tuple(r["arm"] for r in result["rows"]) == arms
    for row in result["rows"]:
        assert set(row["ranks"]) == LLAMA_LINEARS
        assert row["val"]["perplexity"] > 1 and row["compression"] > 1.5
        if row["arm"].startswith("sensitivity"):  # measured on the Llama's own .loss
            assert set(row["losses"]) == {"dense", "uniform", "sensitivity"}
            assert row["kept"] in ("uniform", "sensitivity")
    assert "small Llama" in (tmp_path / "hf_llama_floor.md").read_text()
    assert [p.name for p in (tmp_path / "c").iterdir()] == ["llama-small-3-smoke.pt"]
    assert not (tmp_path / "hf_floor.json").exists()  # the GPT-2's name is left alone


def test_finetune_runs_the_llama_and_extend_refuses_to_mix_models(tmp_path):
    common = _smoke_finetune(tmp_path, "--seeds", "0", "--arms", "dense", "global/calibrated",
                             "--lrs", "1e-3")
    assert compress_hf.main([*common, "--model", "llama"]) == 0
    result = json.loads((tmp_path / "hf_llama_finetune.json").read_text())
    assert result["settings"]["model"] == "llama"
    # global/calibrated: not a default arm, but any floor arm is accepted
    assert [(r["arm"], r["lr"]) for r in result["rows"]] == [("dense", 1e-3),
                                                             ("global/calibrated", 1e-3)]
    assert all(r["after"] > 1 and r["after"] != r["before"] for r in result["rows"])
    assert "small Llama" in (tmp_path / "hf_llama_finetune.md").read_text()
    with pytest.raises(SystemExit, match="model: 'llama' there, 'gpt2' here"):
        compress_hf.main([*common, "--name", "hf_llama_finetune", "--extend"])


def test_extend_reads_a_file_written_before_model_as_the_gpt2s(tmp_path):
    settings = {"format": "tt", "target": 4.0, "steps": 600, "ft_steps": 150,
                "calib_rows": 256, "root": None, "smoke": False}
    (tmp_path / "hf_finetune.json").write_text(json.dumps(
        {"command": "python -m benchmarks.studies.compress_hf finetune", "settings": settings,
         "rows": []}))
    args = compress_hf.parser().parse_args(["finetune", "--extend", "--out", str(tmp_path)])
    assert compress_hf._kept_rows(args, tmp_path / "hf_finetune.json")[0] == []
    args.model = "llama"
    with pytest.raises(SystemExit, match="model: 'gpt2' there, 'llama' here"):
        compress_hf._kept_rows(args, tmp_path / "hf_finetune.json")


@pytest.mark.parametrize("command", ["small", "floor", "finetune"])
def test_an_unknown_model_is_refused_with_exit_2_and_nothing_written(command, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        compress_hf.main([command, "--model", "bert", "--out", str(tmp_path), *(
            ["--cache", str(tmp_path / "c")] if command != "small" else [])])
    assert exit_.value.code == 2
    assert "--model: invalid choice: 'bert'" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("argv, said", [
    (["finetune", "--format", "einsum"], "--format: invalid choice: 'einsum'"),
    (["floor", "--formats", "tt", "tm"], "--formats: invalid choice: 'tm'"),
    (["finetune", "--target", "1"], "--target: '1': a target is a compression ratio above 1"),
    (["floor", "--targets", "2", "-4"], "--targets: '-4': a target is a compression ratio"),
])
def test_a_format_or_target_convert_cannot_take_is_refused_before_any_work(argv, said, tmp_path,
                                                                         capsys):
    with pytest.raises(SystemExit) as exit_:
        compress_hf.main([*argv, "--out", str(tmp_path), "--cache", str(tmp_path / "c")])
    assert exit_.value.code == 2 and said in capsys.readouterr().err
    assert not any(tmp_path.iterdir())  # nothing trained, loaded or written
