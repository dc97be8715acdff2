"""The masked-LM pieces: BERT masking, the stdlib corpus, MaskedLM, and the MLM task."""

from __future__ import annotations

import hashlib
import math
import string

import pytest
import torch
from torch import nn

import comera
from comera.data import stdlib_corpus as sc
from comera.data.stdlib_pairs import CLS, PAD, SEP, SPECIALS, UNK, tokenize
from comera.errors import ConfigError
from comera.experiments.mlm_task import MLMTask, MLMTaskConfig, step_epochs
from comera.experiments.task import IndexStream
from comera.formats.factorize import suggest_padded_size
from comera.models.mlm import MaskedLM
from comera.models.transformer import TransformerConfig

V = 64


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(autouse=True)
def _private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("COMERA_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("COMERA_NO_PROGRESS", "1")


# -- masking ---------------------------------------------------------------------------------------
def _rows(b: int, s: int, seed: int = 0) -> torch.Tensor:
    """[CLS] words [SEP] [PAD]... rows with a few [UNK]s: words drawn from [5, V)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(sc.FIRST_WORD, V, (b, s), generator=g)
    ids[:, 0] = CLS
    lengths = torch.randint(s // 2, s, (b,), generator=g)
    for k, n in enumerate(lengths.tolist()):
        ids[k, n] = SEP
        ids[k, n + 1:] = PAD
    ids[torch.rand(b, s, generator=g) < 0.02] = UNK
    return ids


def test_masking_follows_bert_proportions():
    ids = _rows(600, 64)
    masking = sc.BertMasking(V)
    inputs, labels = masking(ids, torch.arange(600), 0, seed=3)
    chosen = labels != -100
    maskable = ids >= sc.FIRST_WORD
    assert not (chosen & ~maskable).any()  # specials and [UNK] are never predicted
    assert torch.equal(inputs[~chosen], ids[~chosen])  # unchosen positions are untouched
    assert torch.equal(labels[chosen], ids[chosen])  # labels are the original tokens
    n = int(chosen.sum())
    assert abs(n / int(maskable.sum()) - 0.15) < 0.01  # ~23k maskable tokens: 4 sigma
    masked = inputs[chosen] == sc.MASK
    kept = inputs[chosen] == ids[chosen]
    replaced = ~masked & ~kept
    assert abs(float(masked.float().mean()) - 0.8) < 0.025
    assert abs(float(kept.float().mean()) - 0.1) < 0.02
    assert abs(float(replaced.float().mean()) - 0.1) < 0.02
    drawn = inputs[chosen][replaced]
    assert bool(((drawn >= sc.FIRST_WORD) & (drawn < V)).all())


def test_masking_is_a_function_of_seed_example_and_epoch():
    ids = _rows(6, 32)
    masking = sc.BertMasking(V)
    idx = torch.tensor([10, 11, 12, 13, 14, 15])
    first = masking(ids, idx, 2, seed=1)
    again = masking(ids, idx, torch.full((6,), 2), seed=1)
    assert all(torch.equal(a, b) for a, b in zip(first, again, strict=True))
    # a row's masks do not depend on the rest of the batch or its position in it
    order = torch.tensor([4, 2, 0])
    part = masking(ids[order], idx[order], 2, seed=1)
    assert torch.equal(part[0], first[0][order]) and torch.equal(part[1], first[1][order])
    other_epoch = masking(ids, idx, 3, seed=1)[1]
    other_seed = masking(ids, idx, 2, seed=2)[1]
    assert not torch.equal(other_epoch, first[1]) and not torch.equal(other_seed, first[1])


def test_masking_predicts_at_least_one_token_per_row():
    ids = torch.tensor([[CLS, 7, 9, SEP, PAD, PAD]] * 200)
    _, labels = sc.BertMasking(V)(ids, torch.arange(200), 0)
    assert bool(((labels != -100).sum(1) >= 1).all())
    only_specials = torch.tensor([[CLS, UNK, SEP, PAD]])
    _, labels = sc.BertMasking(V)(only_specials, torch.tensor([0]), 0)
    assert bool((labels == -100).all())


def test_masking_rejects_bad_settings_and_inputs():
    with pytest.raises(ConfigError, match="prob"):
        sc.BertMasking(V, prob=0.0)
    with pytest.raises(ConfigError, match="mask_share"):
        sc.BertMasking(V, mask_share=0.9, random_share=0.2)
    with pytest.raises(ConfigError, match="indices"):
        sc.BertMasking(V)(_rows(3, 8), torch.arange(2), 0)
    with pytest.raises(ConfigError, match="epochs"):
        sc.BertMasking(V)(_rows(3, 8), torch.arange(3), torch.arange(2))


# -- the corpus ------------------------------------------------------------------------------------
def _word(k: int) -> str:
    """A letters-only word unique to module k (the tokenizer keeps it whole)."""
    letters = string.ascii_lowercase
    return "zq" + letters[k % 26] + letters[(k // 26) % 26]


def _source(k: int) -> str:
    return (f'"""Helpers for {_word(k)} values."""\n\n\n'
            f"def add_{_word(k)}(left, right):\n"
            '    """Add two numbers and scale the total."""\n'
            "    total = left + right\n"
            f"    return total * {k}\n\n\n"
            "class Box:\n"
            "    def __init__(self, value):\n"
            "        self.value = value\n\n"
            "    def get(self):\n"
            "        return self.value\n")


def _hash_split(module: str) -> str:
    h = int(hashlib.sha256(module.encode()).hexdigest()[:8], 16) % 100
    return "test" if h < 10 else "val" if h < 20 else "train"


def _write_tree(root, want: int = 3) -> dict[str, list[str]]:
    """Modules pkg/mod_k.py until every split has ``want`` of them, plus files to skip."""
    by_split: dict[str, list[str]] = {"train": [], "val": [], "test": []}
    (root / "pkg").mkdir(parents=True)
    k = 0
    while min(len(v) for v in by_split.values()) < want:
        module = f"pkg/mod_{k}.py"
        (root / module).write_text(_source(k))
        by_split[_hash_split(module)].append(module)
        k += 1
    skipped = {
        "tests/test_thing.py": _source(1000),
        "pkg/test_mod.py": _source(1001),
        "pkg/_stuff_data.py": _source(1002),
        "pkg/gen.py": "# Auto-generated by a tool. DO NOT EDIT.\n" + _source(1003),
        "pkg/long.py": "x = 1  # " + "y" * 1200 + "\n" + _source(1004),
        "pkg/broken.py": "def broken(:\n    pass\n",
        "pkg/table.py": "TABLE = {\n" + "".join(f"    {i}: 'v{i}',\n" for i in range(40))
                        + "}\n\n\ndef get(key):\n    return TABLE[key]\n",
    }
    for module, text in skipped.items():
        (root / module).parent.mkdir(parents=True, exist_ok=True)
        (root / module).write_text(text)
    return by_split


def test_skip_rules_name_each_reason():
    assert "folder" in sc.skip_reason("tests/a.py", "x = 1\n")
    assert "test_*" in sc.skip_reason("pkg/test_a.py", "x = 1\n")
    assert "generated" in sc.skip_reason("a.py", "# Generated by mkfoo.py\nx = 1\n")
    assert "data-only" in sc.skip_reason("a.py", "T = [\n" + "  1,\n" * 30 + "]\nx = f(T)\n")
    assert sc.skip_reason("a.py", "def f(x):\n    '''Doc\n    more doc.\n    '''\n"
                                  "    return x\n") is None  # docstrings are not data
    assert sc.skip_reason("a.py", None) == "not UTF-8"


def test_corpus_splits_by_module_and_frames_each_file(tmp_path):
    expected = _write_tree(tmp_path / "lib")
    train, val, test, tok = sc.load_stdlib_corpus(seq_len=16, vocab_size=500, min_tokens=4,
                                                  root=tmp_path / "lib")
    got = {"train": train, "val": val, "test": test}
    for split, data in got.items():
        assert sorted(data.modules) == sorted(expected[split])  # the sha256 rule, nothing else
    assert not set(train.modules) & set(val.modules)
    assert not set(train.modules) & set(test.modules)
    assert not set(val.modules) & set(test.modules)
    assert tok.vocab[:5] == (*SPECIALS, "[MASK]")
    # the vocabulary comes from the training split alone
    assert all(_word(int(m[8:-3])) in tok.vocab for m in expected["train"])
    assert not any(_word(int(m[8:-3])) in tok.vocab for m in expected["val"] + expected["test"])
    # each file's rows are [CLS] piece [SEP] [PAD]..., and the pieces are its token ids in order
    index = {w: k for k, w in enumerate(tok.vocab)}
    for data in got.values():
        for k, module in enumerate(data.modules):
            want = [index.get(t, UNK) for t in tokenize((tmp_path / "lib" / module).read_text())]
            rows = data.ids[data.source == k]
            pieces = []
            for row in rows.tolist():
                assert row[0] == CLS
                body = row[1:row.index(SEP)]
                assert all(t == PAD for t in row[row.index(SEP) + 1:])
                pieces += body
            keep = len(want) - (len(want) % 14 if len(want) % 14 < 4 else 0)
            assert pieces == want[:keep]


def test_corpus_is_cached_under_a_key_of_every_parameter(tmp_path, monkeypatch):
    _write_tree(tmp_path / "lib")
    first = sc.load_stdlib_corpus(seq_len=16, vocab_size=500, root=tmp_path / "lib")

    def no_rebuild(*args):
        raise AssertionError("rebuilt although cached")

    monkeypatch.setattr(sc, "_build", no_rebuild)
    again = sc.load_stdlib_corpus(seq_len=16, vocab_size=500, root=tmp_path / "lib")
    assert torch.equal(first[0].ids, again[0].ids) and first[3] == again[3]
    with pytest.raises(AssertionError, match="rebuilt"):
        sc.load_stdlib_corpus(seq_len=20, vocab_size=500, root=tmp_path / "lib")
    (tmp_path / "lib" / "pkg" / "new.py").write_text(_source(77))  # the sources changed
    with pytest.raises(AssertionError, match="rebuilt"):
        sc.load_stdlib_corpus(seq_len=16, vocab_size=500, root=tmp_path / "lib")


def test_corpus_rejects_bad_parameters(tmp_path):
    with pytest.raises(ConfigError, match="seq_len"):
        sc.load_stdlib_corpus(seq_len=2, root=tmp_path)
    with pytest.raises(ConfigError, match="not a directory"):
        sc.load_stdlib_corpus(root=tmp_path / "missing")
    with pytest.raises(ConfigError, match="training split"):
        sc.load_stdlib_corpus(root=tmp_path)  # an empty folder
    with pytest.raises(ConfigError, match="vocab_size"):
        sc.build_mlm_tokenizer(["a b"], 5)


@pytest.mark.slow
def test_real_stdlib_corpus():
    train, val, test, tok = sc.load_stdlib_corpus(seq_len=64, vocab_size=8192)
    assert len(train) > 10_000 and len(val) > 500 and len(test) > 500
    assert len(tok.vocab) == 8192 and tok.vocab[sc.MASK] == "[MASK]"
    for a, b in ((train, val), (train, test), (val, test)):
        assert not set(a.modules) & set(b.modules)
    modules = set(train.modules) | set(val.modules) | set(test.modules)
    assert not any(m.startswith(("encodings/", "test/", "idlelib/")) for m in modules)
    assert "html/entities.py" not in modules and "json/decoder.py" in modules


# -- the model -------------------------------------------------------------------------------------
def _cfg(tt: bool, **kw) -> TransformerConfig:
    """The small MLM's config: TT layers and table (``tt``), or dense."""
    base = dict(vocab_size=V, d_model=16, n_heads=2, d_ff=32, n_layers=2, max_len=12,
                dropout=0.0, linear_format="tt" if tt else "dense", tt_embedding=tt, rank=4,
                embedding_rank=4, attn_modes=None,
                ffn_in_modes=None, ffn_out_modes=None, embedding_modes=None)
    base.update(kw)
    return TransformerConfig(**base)


@pytest.mark.parametrize("tt", [False, True])
def test_masked_lm_shapes(tt):
    torch.manual_seed(0)
    model = MaskedLM(_cfg(tt, vocab_size=61))  # 61 is prime: the TT projection is padded
    ids = torch.randint(1, 61, (3, 10))
    assert model(ids).shape == (3, 10, 61)
    select = torch.zeros(3, 10, dtype=torch.bool)
    select[0, 2] = select[2, 5] = select[2, 7] = True
    selected = model.eval()(ids, select)
    assert selected.shape == (3, 61)
    torch.testing.assert_close(selected, model(ids)[select])
    if tt:
        assert isinstance(model.tokens, comera.TTEmbedding)
        assert model.decoder.out_features == suggest_padded_size(61, 3) > 61
    with pytest.raises(ConfigError, match="max_len"):
        model(torch.ones(1, 13, dtype=torch.long))
    with pytest.raises(ConfigError, match="select"):
        model(ids, select.long())


@pytest.mark.parametrize("tt", [False, True])
def test_embeddings_start_at_bert_scale(tt):
    """Token and position tables both start at std 0.02: a TT table left at its default std
    (about 1/sqrt(V + d)) next to unit-std positions is drowned out by the LayerNorm."""
    torch.manual_seed(4)
    model = MaskedLM(_cfg(tt, vocab_size=512, d_model=32))
    table = (model.tokens.to_dense() if tt else model.tokens.weight).detach()
    assert float(table.std()) == pytest.approx(0.02, rel=0.05 if tt else 0.1)
    assert float(model.positions.weight.detach().std()) == pytest.approx(0.02, rel=0.3)
    assert not table[PAD].any()


def _reference_logits(model: MaskedLM, ids: torch.Tensor) -> torch.Tensor:
    """The dense model's logits written out with plain torch ops (post-LN BERT encoder)."""
    emb = model.tokens.weight[ids] + model.positions.weight[: ids.shape[1]][None]
    x = nn.functional.layer_norm(emb, (emb.shape[-1],), model.ln.weight, model.ln.bias)
    keep = ids != model.pad_id
    b, s, d = x.shape
    for block in model.blocks:
        h = block.attn.n_heads
        q, k, v = (lin(x).view(b, s, h, d // h).transpose(1, 2)
                   for lin in (block.attn.q, block.attn.k, block.attn.v))
        scores = q @ k.transpose(-1, -2) / math.sqrt(d // h)
        scores = scores.masked_fill(~keep[:, None, None, :], -math.inf)
        att = (scores.softmax(-1) @ v).transpose(1, 2).reshape(b, s, d)
        x = block.ln1(x + block.attn.o(att))
        x = block.ln2(x + block.ffn_out(nn.functional.gelu(block.ffn_in(x))))
    hidden = model.head_ln(nn.functional.gelu(model.transform(x)))
    return hidden @ model.decoder.weight.T + model.decoder.bias


def test_dense_masked_lm_matches_a_plain_torch_reference():
    torch.manual_seed(1)
    model = MaskedLM(_cfg(False)).double().eval()
    ids = torch.randint(1, V, (2, 9))
    ids[1, 6:] = PAD
    torch.testing.assert_close(model(ids), _reference_logits(model, ids), rtol=1e-10, atol=1e-10)


def test_tt_masked_lm_converted_at_full_rank_matches_dense():
    torch.manual_seed(2)
    dense = MaskedLM(_cfg(False)).double().eval()
    ids = torch.randint(1, V, (3, 11))
    ids[0, 8:] = PAD
    want = dense(ids)
    report = comera.convert_(dense, include=["tokens", "blocks.*", "transform", "decoder"],
                             embedding=True, ranks=10_000)
    assert {r.name for r in report.layers} >= {"tokens", "decoder", "blocks.1.ffn_out"}
    assert isinstance(dense.tokens, comera.TTEmbedding)
    assert isinstance(dense.decoder, comera.TTLinear)
    torch.testing.assert_close(dense(ids), want, rtol=1e-9, atol=1e-9)


def test_masked_lm_loss_ignores_unlabelled_positions():
    torch.manual_seed(3)
    model = MaskedLM(_cfg(False)).eval()
    ids = torch.randint(5, V, (2, 8))
    labels = torch.full_like(ids, -100)
    labels[0, 3], labels[1, 6] = 9, 17
    logits = model(ids)
    want = -(logits[0, 3].log_softmax(-1)[9] + logits[1, 6].log_softmax(-1)[17]) / 2
    torch.testing.assert_close(model.loss(ids, labels), want)
    with pytest.raises(ConfigError, match="no position"):
        model.loss(ids, torch.full_like(ids, -100))


# -- the task --------------------------------------------------------------------------------------
def _task(tmp_path, **kw) -> MLMTask:
    _write_tree(tmp_path / "lib", want=4)
    cfg = MLMTaskConfig(seq_len=16, vocab_size=500, d_model=16, n_heads=2, d_ff=32,
                        n_layers=1, rank=4, embedding_rank=8, dropout=0.0, **kw)
    return MLMTask(cfg, root=tmp_path / "lib")


@pytest.mark.parametrize("tt", [False, True])
def test_a_few_steps_reduce_the_mlm_loss(tmp_path, tt):
    task = _task(tmp_path)
    torch.manual_seed(0)
    model = task.build_model("tt" if tt else "dense")
    assert any(True for _ in comera.gated_layers(model)) == tt
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    batch = task.batch(torch.arange(min(16, task.train_size())), epochs=0)
    before = float(task.loss(model, batch).detach())
    for _ in range(25):
        loss = task.loss(model, batch)
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert float(task.loss(model, batch).detach()) < 0.7 * before


def test_task_masks_by_epoch_and_resumes(tmp_path):
    task = _task(tmp_path)
    idx = torch.tensor([3, 1, 4])
    first = task.batch(idx)  # counted: epoch 0
    second = task.batch(idx)  # epoch 1
    assert torch.equal(first[1], task.batch(idx, epochs=0)[1])
    assert torch.equal(second[1], task.batch(idx, epochs=1)[1])
    assert not torch.equal(first[1], second[1])
    state = task.state_dict()
    fresh = _task(tmp_path / "again")
    fresh.load_state_dict(state)
    assert torch.equal(fresh.batch(idx)[1], task.batch(idx)[1])  # both at epoch 2
    with pytest.raises(ConfigError, match="indices"):
        task.batch(torch.tensor([task.train_size()]))


def test_step_epochs_follow_the_index_stream():
    stream = IndexStream(size=10, batch_size=4, seed=0)
    assert step_epochs(stream, 2).tolist() == [0, 0, 1, 1]  # positions 8..11 of 0,1,2,...
    assert step_epochs(stream, 4).tolist() == [1, 1, 1, 1]  # positions 16..19
    assert step_epochs(stream, 2, rank=1, world=2).tolist() == [1, 1]
    # every index occurs once per epoch, so the epochs count each index's previous occurrences
    seen: dict[int, int] = {}
    for step in range(12):
        for i, e in zip(stream.indices(step).tolist(), step_epochs(stream, step).tolist(),
                        strict=True):
            assert e == seen.get(i, 0)
            seen[i] = e + 1


def test_evaluate_scores_fixed_masks_against_full_logits(tmp_path):
    task = _task(tmp_path, eval_limit=5, eval_batch_size=2)
    torch.manual_seed(0)
    model = task.build_model("dense").eval()
    with torch.no_grad():
        scores = task.evaluate(model, "val")
        inputs, labels = task.eval_batch("val")
        assert inputs.shape[0] == 5
        logits = model(inputs)  # (b, s, V): every position, then pick the labelled ones
        sel = labels != -100
        want = nn.functional.cross_entropy(logits[sel], labels[sel])
        acc = (logits[sel].argmax(-1) == labels[sel]).float().mean()
    assert scores["loss"] == pytest.approx(float(want), rel=1e-5)
    assert scores["accuracy"] == pytest.approx(float(acc))
    assert scores["tokens"] == int(sel.sum())
    assert task.evaluate(model, "val") == scores  # the same masks every time
    assert task.metric == "loss" and not task.higher_is_better
    with pytest.raises(ConfigError, match="split"):
        task.evaluate(model, "train")
