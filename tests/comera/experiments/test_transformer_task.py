"""The transformer tasks: reviews (the default) on a tiny table, the majority baseline next to
accuracy, and ``--init-from`` a masked-LM checkpoint (TT at its saved ranks, or dense)."""

from __future__ import annotations

import shutil

import pytest
import torch

import comera
from comera.experiments.engine import EngineConfig, train_model
from comera.experiments.init_from import classifier_config, load_encoder_, read_pretrained
from comera.experiments.mlm_task import MLMTask, MLMTaskConfig
from comera.experiments.pair_task import CodePairTask
from comera.models import PairClassifier
from tests.helpers.checkpoints_before import write_engine_state_as_before_formats
from tests.helpers.toy_task import ToyTask

pytestmark = pytest.mark.usefixtures("one_thread")

TINY_MLM = MLMTaskConfig(seq_len=16, vocab_size=64, d_model=32, n_heads=2, d_ff=64, n_layers=1,
                         rank=4, embedding_rank=4, eval_limit=4, eval_batch_size=4)
SOURCE = '''def area(width, height):
    """Area of a rectangle."""
    return width * height


class Shape:
    def scale(self, factor):
        return [side * factor for side in self.sides]
'''


@pytest.fixture
def corpus(tmp_path):
    root = tmp_path / "src"
    root.mkdir()
    for i in range(40):
        (root / f"mod{i}.py").write_text(SOURCE.replace("area", f"area{i}") * 3)
    return root


def test_reviews_task_scores_accuracy_next_to_the_majority_baseline(tmp_path, monkeypatch):
    pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    from comera.experiments.transformer_task import ReviewsTask, ReviewsTaskConfig
    from tests.comera.data.test_reviews import _table

    monkeypatch.setenv("COMERA_CACHE_DIR", str(tmp_path / "cache"))
    pq.write_table(_table(200), tmp_path / "r.parquet")
    task = ReviewsTask(ReviewsTaskConfig(max_len=16, vocab_size=40,
                                         source=str(tmp_path / "r.parquet")))
    assert task.name == "transformer"
    scores = task.evaluate(task.build_model("dense").eval(), "val")
    assert set(scores) == {"accuracy", "loss", "majority"}
    assert scores["majority"] == pytest.approx(task.majority("val"))
    assert task.describe()["majority_test"] == pytest.approx(task.majority("test"))
    model = task.build_model("tt")
    assert any(True for _ in comera.gated_layers(model))


def test_the_registry_names_agree():
    from comera.experiments.registry import EXPERIMENTS

    assert {"transformer", "transformer-code"} <= set(EXPERIMENTS)
    from comera.experiments import pair_task
    from comera.experiments.pair_task import CodePairTask

    with pytest.warns(DeprecationWarning, match="PairTask is deprecated: use .*CodePairTask"):
        assert pair_task.PairTask is CodePairTask
    assert CodePairTask.name == "transformer-code"


@pytest.mark.parametrize("format", [pytest.param("tt", marks=pytest.mark.slow), "ttm", "dense"])
def test_init_from_an_mlm_checkpoint_loads_the_encoder_as_saved(tmp_path, corpus, format):
    task = MLMTask(TINY_MLM, root=corpus, use_cache=False)
    cfg = EngineConfig(steps_early=4, steps_late=2, batch_size=4, lam=1.0, lr_gates=0.2,
                       target_compression=3.0, eval_every=10, format=format)
    name = "dense" if format == "dense" else "comera"
    mlm, _ = train_model(task, name, cfg, tmp_path / "run")
    path = tmp_path / "run" / "checkpoints" / f"{name}.pt"
    pretrained = read_pretrained(path, TINY_MLM, root=corpus, use_cache=False)
    assert pretrained.tokenizer == task.tokenizer and pretrained.max_len == 16
    classifier = PairClassifier(classifier_config(pretrained, n_classes=2, dropout=0.0))
    load_encoder_(classifier, pretrained)
    for part in ("tokens", "positions", "ln", "blocks"):
        mine = getattr(classifier, part).state_dict()
        saved = getattr(mlm, part).state_dict()
        assert mine.keys() == saved.keys()
        for key in mine:
            assert torch.equal(mine[key], saved[key]), (part, key)
    if format != "dense":  # TT layers at the ranks the late stage left them
        saved = {n: m.bonds for n, m in comera.gated_layers(mlm) if not n.startswith(("transform",
                                                                                  "decoder"))}
        mine = {n: m.bonds for n, m in comera.gated_layers(classifier)}
        assert mine == saved
        assert format != "tt" or any(b < 4 for bonds in saved.values() for b in bonds[1:-1])
    assert not classifier.segments.weight.any()
    ids = torch.randint(5, 64, (3, 16))
    classifier.eval()
    mlm.eval()
    hidden = mlm.encode(ids)  # segments at zero: the classifier sees the pretrained features
    assert torch.allclose(classifier.head(hidden[:, 0]),
                          classifier(ids, torch.zeros_like(ids)), atol=1e-5)
    # a classifier started from it trains the compressed encoder's format when none is named
    task = CodePairTask.__new__(CodePairTask)  # its data is not needed to choose
    assert task.recommended_format == "tt"  # the classifiers' results' format
    task.pretrained = pretrained
    assert task.recommended_format == (format if format != "dense" else "tt")
    if format == "ttm":
        return  # the tt flag's era had TT only
    # a checkpoint of before: the tt flag; without config_format, of before EngineConfig had a
    # format (its config names none, so TT, not today's default)
    for config_format in (True, False):
        before = tmp_path / f"before_{config_format}.pt"
        shutil.copy(path, before)
        write_engine_state_as_before_formats(before, config_format)
        assert read_pretrained(before, TINY_MLM, root=corpus,
                               use_cache=False).config.linear_format == format


def test_init_from_refuses_a_checkpoint_of_another_task(tmp_path):
    train_model(ToyTask(), "dense", EngineConfig(steps_early=2, steps_late=0, eval_every=5,
                                                 format="dense"), tmp_path)
    with pytest.raises(comera.CheckpointError, match="task 'toy'"):
        read_pretrained(tmp_path / "checkpoints" / "dense.pt")
    with pytest.raises(comera.CheckpointError, match="no such file"):
        read_pretrained(tmp_path / "nothing.pt")


def test_cli_init_from_errors_exit_2_in_one_line(tmp_path, capsys):
    from comera.cli import main

    code = main(["train", "dlrm", "--quick", "--init-from", str(tmp_path / "x.pt"),
                 "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert code == 2 and "cannot start from a checkpoint" in err and len(err.splitlines()) == 1
    assert not (tmp_path / "out").exists()
