"""DLRM: shapes, the interaction against a hand loop, the whole forward against a hand-written
reference, dense -> TT conversion at full rank, id checks, AUC against a brute-force pair count,
and the Task protocol driving a few optimizer steps."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import comera
from comera import LookupIndexError, TTEmbedding
from comera.data.criteo import CRITEO_KAGGLE_CARDINALITIES
from comera.errors import ConfigError, NonFiniteLossError
from comera.experiments.dlrm_task import DLRMTask, DLRMTaskConfig, binary_auc
from comera.experiments.task import IndexStream
from comera.models.dlrm import DLRM, DLRMConfig

F64 = torch.float64


pytestmark = pytest.mark.usefixtures("one_thread")

TINY = dict(num_dense=5, cardinalities=(60, 7, 300, 1000), embedding_dim=4,
            bottom_mlp=(8, 4), top_mlp=(6, 1), tt_min_rows=100, tt_ranks=4)


def _inputs(cfg: DLRMConfig, batch: int, seed: int = 0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    dense = torch.rand(batch, cfg.num_dense, generator=g, dtype=dtype) * 3  # (B, J)
    sparse = torch.stack([torch.randint(0, rows, (batch,), generator=g)
                          for rows in cfg.table_sizes], dim=1)  # (B, T)
    return dense, sparse


def _reference_forward(model: DLRM, dense, sparse):
    """DLRM written out by hand: MLPs layer by layer, rows read from the tables, a pair loop."""
    x = dense
    for layer in model.bottom:
        x = torch.relu(x @ layer.weight.T + layer.bias) if isinstance(layer, nn.Linear) else x
    tables = [t.to_dense() if isinstance(t, TTEmbedding) else t.weight for t in model.embeddings]
    out = []
    for b in range(dense.shape[0]):
        vecs = [x[b]] + [tables[k][sparse[b, k]] for k in range(len(tables))]
        dots = [vecs[i] @ vecs[j] for i in range(len(vecs)) for j in range(i + 1, len(vecs))]
        z = torch.cat([x[b], torch.stack(dots)])
        linears = [m for m in model.top if isinstance(m, nn.Linear)]
        for k, layer in enumerate(linears):
            z = z @ layer.weight.T + layer.bias
            z = torch.relu(z) if k < len(linears) - 1 else z
        out.append(z[0])
    return torch.stack(out)


def test_default_config_is_the_criteo_kaggle_model():
    cfg = DLRMConfig()
    assert len(cfg.cardinalities) == 26 and sum(cfg.cardinalities) == 33_762_577
    assert cfg.cardinalities == CRITEO_KAGGLE_CARDINALITIES
    assert (cfg.num_dense, cfg.embedding_dim) == (13, 16)
    assert cfg.bottom_mlp == (512, 256, 64, 16) and cfg.top_mlp == (512, 256, 1)
    assert cfg.num_interactions == 27 * 26 // 2


@pytest.mark.parametrize("kind", ["dense", "ttm"])
def test_forward_shapes_and_table_types(kind):
    cfg = DLRMConfig(**TINY, table_format=kind)
    model = DLRM(cfg)
    dense, sparse = _inputs(cfg, 9)
    logits = model(dense, sparse)
    assert logits.shape == (9,) and logits.dtype == torch.float32
    kinds = [type(t) for t in model.embeddings]
    expect_tt = [kind != "dense" and rows >= 100 for rows in cfg.table_sizes]
    assert kinds == [TTEmbedding if e else nn.Embedding for e in expect_tt]
    assert model.top[0].in_features == 4 + 5 * 4 // 2  # D + F(F-1)/2 with F = 1 + 4 tables
    logits.sum().backward()
    assert all(p.grad is not None for p in model.parameters())


def test_interaction_equals_a_hand_loop():
    model = DLRM(DLRMConfig(**TINY)).to(F64)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3, 4, generator=g, dtype=F64)
    embedded = [torch.randn(3, 4, generator=g, dtype=F64) for _ in range(4)]
    out = model.interact(x, embedded)
    vecs = [x, *embedded]
    expect = torch.stack([torch.stack([(vecs[i][b] * vecs[j][b]).sum()
                                       for i in range(5) for j in range(i + 1, 5)])
                          for b in range(3)])
    assert out.shape == (3, 4 + 10)
    torch.testing.assert_close(out[:, :4], x, rtol=0, atol=0)
    torch.testing.assert_close(out[:, 4:], expect, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("kind", ["dense", "ttm"])
def test_forward_equals_a_hand_written_reference(kind):
    torch.manual_seed(0)
    model = DLRM(DLRMConfig(**TINY, table_format=kind)).to(F64)
    dense, sparse = _inputs(model.cfg, 6, dtype=F64)
    torch.testing.assert_close(model(dense, sparse), _reference_forward(model, dense, sparse),
                               rtol=1e-10, atol=1e-12)


def test_tt_model_converted_at_full_rank_equals_the_dense_model():
    torch.manual_seed(0)
    dense_model = DLRM(DLRMConfig(**TINY)).to(F64)
    with torch.no_grad():  # rows of realistic size, so a lost row would show
        for table in dense_model.embeddings:
            table.weight.normal_()
    tt_model = DLRM.from_dense(dense_model, tt_ranks=10_000)
    assert [isinstance(t, TTEmbedding) for t in tt_model.embeddings] == [False, False, True,
                                                                           True]
    dense, sparse = _inputs(dense_model.cfg, 32, dtype=F64)
    torch.testing.assert_close(tt_model(dense, sparse), dense_model(dense, sparse),
                               rtol=1e-9, atol=1e-10)
    assert tt_model.cfg.table_format == "ttm" and dense_model.cfg.table_format == "dense"
    with pytest.raises(ConfigError, match="already has compressed tables"):
        DLRM.from_dense(tt_model)
    with pytest.raises(ConfigError, match="format='dense'"):
        DLRM.from_dense(dense_model, format="dense")


def test_low_rank_conversion_shrinks_the_tables():
    dense_model = DLRM(DLRMConfig(**TINY))
    tt_model = DLRM.from_dense(dense_model, tt_ranks=2)
    assert tt_model.dense_table_parameters() == dense_model.table_parameters() == 1367 * 4
    assert tt_model.table_parameters() < dense_model.table_parameters() / 3
    assert comera.model_size(tt_model, only=TTEmbedding) == sum(
        t.num_parameters() for t in tt_model.embeddings if isinstance(t, TTEmbedding))


def test_max_rows_caps_dense_and_tt_tables_alike():
    base = dict(TINY, max_rows=200)
    dense, tt = DLRM(DLRMConfig(**base)), DLRM(DLRMConfig(**base, table_format="ttm"))
    assert dense.cfg.table_sizes == tt.cfg.table_sizes == (60, 7, 200, 200)
    assert [t.num_embeddings for t in dense.embeddings] == [60, 7, 200, 200]
    assert [t.num_embeddings for t in tt.embeddings] == [60, 7, 200, 200]
    assert dense.dense_table_parameters() == tt.dense_table_parameters() == 467 * 4


@pytest.mark.parametrize("kind", ["dense", "ttm"])
@pytest.mark.parametrize(("table", "bad"), [(1, 7), (1, -1), (3, 1000)])
def test_out_of_range_ids_raise_lookup_index_error(kind, table, bad):
    cfg = DLRMConfig(**TINY, table_format=kind)
    model = DLRM(cfg)
    dense, sparse = _inputs(cfg, 4)
    sparse[2, table] = bad
    with pytest.raises(LookupIndexError, match=f"id {bad} of example 2 .* table {table}") as err:
        model(dense, sparse)
    assert isinstance(err.value, IndexError)


def test_capped_table_error_says_how_to_fix_it():
    cfg = DLRMConfig(**TINY, max_rows=50)
    dense, sparse = _inputs(cfg, 2)
    sparse[0, 2] = 50
    with pytest.raises(LookupIndexError, match="capped by max_rows=50 from 300"):
        DLRM(cfg)(dense, sparse)


def test_bad_inputs_and_configs_are_refused():
    cfg = DLRMConfig(**TINY)
    model = DLRM(cfg)
    dense, sparse = _inputs(cfg, 3)
    with pytest.raises(ConfigError, match=r"\(batch, 5\) float"):
        model(dense[:, :4], sparse)
    with pytest.raises(ConfigError, match="int64/int32"):
        model(dense, sparse.float())
    with pytest.raises(ConfigError, match="3 rows but sparse ids 2"):
        model(dense, sparse[:2])
    with pytest.raises(ConfigError, match="must end at embedding_dim=4"):
        DLRMConfig(**dict(TINY, bottom_mlp=(8, 5)))
    with pytest.raises(ConfigError, match="must end at 1"):
        DLRMConfig(**dict(TINY, top_mlp=(6, 2)))
    with pytest.raises(ConfigError, match="cardinalities"):
        DLRMConfig(**dict(TINY, cardinalities=(10, 0)))
    with pytest.raises(ConfigError, match="max_rows"):
        DLRMConfig(**TINY, max_rows=0)
    with pytest.raises(ConfigError, match="tau"):
        DLRMConfig(**TINY, tau=-1.0)


@pytest.mark.slow
def test_the_full_kaggle_tt_model_tables_are_over_99x_smaller():
    model = DLRM(DLRMConfig(table_format="ttm"))
    assert model.dense_table_parameters() == 33_762_577 * 16
    assert model.dense_table_parameters() / model.table_parameters() > 99


# -- AUC ----------------------------------------------------------------------------------------
def _brute_force_auc(scores, labels):
    pos = [s for s, y in zip(scores.tolist(), labels.tolist(), strict=True) if y == 1]
    neg = [s for s, y in zip(scores.tolist(), labels.tolist(), strict=True) if y == 0]
    wins = sum(1.0 if p > n else 0.5 if p == n else 0.0 for p in pos for n in neg)
    return wins / (len(pos) * len(neg))


@pytest.mark.parametrize("seed", range(4))
def test_auc_equals_a_brute_force_pair_count(seed):
    g = torch.Generator().manual_seed(seed)
    n = 150
    labels = (torch.rand(n, generator=g) < 0.3).float()
    scores = torch.randint(0, 12, (n,), generator=g).float() + labels  # many ties
    assert binary_auc(scores, labels) == pytest.approx(_brute_force_auc(scores, labels),
                                                       abs=1e-12)
    continuous = torch.randn(n, generator=g, dtype=F64)
    assert binary_auc(continuous, labels) == pytest.approx(
        _brute_force_auc(continuous, labels), abs=1e-12)


def test_auc_extremes_and_errors():
    labels = torch.tensor([0.0, 0.0, 1.0, 1.0])
    assert binary_auc(torch.tensor([0.1, 0.2, 0.3, 0.4]), labels) == 1.0
    assert binary_auc(torch.tensor([0.4, 0.3, 0.2, 0.1]), labels) == 0.0
    assert binary_auc(torch.zeros(4), labels) == 0.5
    with pytest.raises(ConfigError, match="both classes"):
        binary_auc(torch.rand(3), torch.ones(3))
    with pytest.raises(ConfigError, match="3 scores and 4 labels"):
        binary_auc(torch.rand(3), labels)
    with pytest.raises(NonFiniteLossError):
        binary_auc(torch.tensor([0.0, math.nan, 1.0, 2.0]), labels)


# -- the Task -----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_task(tmp_path_factory):
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("COMERA_CACHE_DIR", str(tmp_path_factory.mktemp("comera-cache")))
        cfg = DLRMTaskConfig(cardinalities=(40, 7, 300, 1500), max_rows=1000, n_train=2048,
                             n_val=1024, n_test=512, embedding_dim=4, bottom_mlp=(16, 4),
                             top_mlp=(16, 1), tt_min_rows=100, tt_ranks=4, eval_batch_size=300,
                             tt_cache_rows=0)  # plain TT tables; the cache has its own tests
        return DLRMTask(cfg)


@pytest.mark.parametrize("tt", [False, True])
def test_task_trains_with_index_stream(tiny_task, tt):
    task = tiny_task
    assert task.train_size() == 2048 and task.metric == "auc"
    torch.manual_seed(0)
    model = task.build_model("tt" if tt else "dense")
    assert model.cfg.table_sizes == (40, 7, 300, 1000)
    assert any(isinstance(t, TTEmbedding) for t in model.embeddings) == tt
    stream = IndexStream(task.train_size(), batch_size=256, seed=0)
    probe = task.batch(torch.arange(512))
    with torch.no_grad():
        before = float(task.loss(model, probe))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(40):
        loss = task.loss(model, task.batch(stream.indices(step)))
        opt.zero_grad()
        loss.backward()
        opt.step()
    with torch.no_grad():
        after = float(task.loss(model, probe))
    assert after < before - 0.02
    model.eval()
    scores = task.evaluate(model, "val")
    assert set(scores) == {"loss", "accuracy", "auc"}
    assert 0 <= scores["accuracy"] <= 1 and 0 <= scores["auc"] <= 1 and scores["loss"] > 0
    val = task.data.val
    with torch.no_grad():
        logits = model(val.dense, val.sparse.long())
    assert scores["auc"] == pytest.approx(binary_auc(logits, val.labels), abs=1e-6)
    expect_loss = nn.functional.binary_cross_entropy_with_logits(logits, val.labels)
    assert scores["loss"] == pytest.approx(float(expect_loss), rel=1e-5)
    with pytest.raises(ConfigError, match="unknown split"):
        task.evaluate(model, "dev")


def test_task_configs():
    quick, full = DLRMTaskConfig.quick(), DLRMTaskConfig.full()
    assert quick == DLRMTaskConfig(tt_cache_rows=112)
    assert max(quick.model_config("dense").table_sizes) == 20_000
    paper = full.model_config("tt")
    assert paper.table_format == "ttm"  # TT holds TT-matrix tables
    assert paper.table_sizes == CRITEO_KAGGLE_CARDINALITIES and paper.tt_ranks == 32
    assert (paper.bottom_mlp, paper.top_mlp) == ((512, 256, 64, 16), (512, 256, 1))
    assert DLRMTaskConfig.full(n_train=10).n_train == 10
    with pytest.raises(ConfigError, match="n_val=0"):
        DLRMTaskConfig(n_val=0)
    with pytest.raises(ConfigError, match="must end at embedding_dim"):
        DLRMTaskConfig(embedding_dim=8)


def test_task_refuses_data_of_other_table_sizes(tiny_task):
    with pytest.raises(ConfigError, match="max_rows"):
        DLRMTask(DLRMTaskConfig(cardinalities=(40, 7, 300, 1500), max_rows=500,
                                embedding_dim=4, bottom_mlp=(16, 4)), tiny_task.data)
    described = tiny_task.describe()
    assert described["train"] == 2048 and described["table_sizes"] == [40, 7, 300, 1000]
