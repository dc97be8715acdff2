"""HuggingFace transformers (the optional ``hf`` extra): convert_ on BERT, GPT-2 (Conv1D layers,
weights stored transposed) and a Llama-style model, each built from a tiny config with random
weights (no downloads). At full rank the logits equal the original's; a training step reaches
every core and lowers the loss; save_pretrained / from_pretrained round-trips a converted and
truncated model exactly, and HuggingFace's own loader refuses comera's folder."""

import copy
import warnings

import pytest
import torch

import comera

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

VOCAB, FULL = 64, 64  # FULL: above every TT-SVD bond bound here, the conversion is exact


def _bert():
    config = transformers.BertConfig(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=1,
                                     num_attention_heads=2, intermediate_size=16,
                                     max_position_embeddings=16, num_labels=3)
    return transformers.BertForSequenceClassification(config)


def _gpt2():
    config = transformers.GPT2Config(vocab_size=VOCAB, n_positions=16, n_embd=16, n_layer=1,
                                     n_head=2, n_inner=16, bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(config)


def _llama():
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=16,
                                      num_hidden_layers=1, num_attention_heads=2,
                                      num_key_value_heads=2, max_position_embeddings=16)
    return transformers.LlamaForCausalLM(config)


MODELS = {"bert": _bert, "gpt2": _gpt2, "llama": _llama}


def _loss(model, ids):
    if isinstance(model, transformers.BertForSequenceClassification):
        return model(ids, labels=torch.tensor([0, 2])).loss
    return model(ids, labels=ids).loss


@pytest.mark.parametrize("name", sorted(MODELS))
def test_convert_train_and_round_trip(name, tmp_path):
    torch.manual_seed(0)
    model = MODELS[name]().eval()
    dense = copy.deepcopy(model)
    ids = torch.randint(0, VOCAB, (2, 8))
    with pytest.warns(UserWarning, match=r"comera\.save_pretrained"):  # HF's own would lose it
        report = comera.convert_(model, ranks=FULL)
    kinds = {type(model.get_submodule(r.name)).__name__ for r in report.layers}
    assert kinds == {"TTLinear"} and len(report.layers) >= 4
    with torch.no_grad():  # full rank: what the original computed
        torch.testing.assert_close(model(ids).logits, dense(ids).logits, rtol=1e-4, atol=1e-5)
    if name == "gpt2":  # Conv1D weights are (in, out): a transposed conversion would differ
        assert "transformer.h.0.attn.c_attn" in {r.name for r in report.layers}
        assert report.skipped == ("lm_head",)  # tied to wte: left dense

    model.train()
    opt = comera.make_optimizer(model, comera.OptimizerConfig(1e-2, 1e-2, 1e-2))
    loss = _loss(model, ids)
    loss.backward()
    cores = [c for _, m in comera.gated_layers(model) for c in m.cores]
    assert all(c.grad is not None and c.grad.abs().sum() > 0 for c in cores)
    opt.step()
    with torch.no_grad():
        assert _loss(model, ids) < loss

    # prune a rank slice of every layer, truncate, save, load: exactly the same model
    for _, layer in comera.gated_layers(model):
        with torch.no_grad():
            layer.gates[0][0] = 0.0
    comera.truncate_(model)
    model.eval()
    want = model(ids).logits
    comera.save_pretrained(model, tmp_path)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="converted a HuggingFace")  # not on load
        loaded = comera.from_pretrained(tmp_path, type(model))
    assert {n: m.bonds for n, m in comera.gated_layers(loaded)} == \
        {n: m.bonds for n, m in comera.gated_layers(model)}
    assert torch.equal(loaded(ids).logits, want)
    # HuggingFace's loader refuses the folder instead of returning random dense layers
    with pytest.raises(OSError, match=r"model\.safetensors"):
        transformers.AutoModel.from_pretrained(tmp_path)


def test_from_pretrained_into_a_built_model_and_refusals(tmp_path):
    torch.manual_seed(0)
    model = _gpt2().eval()
    fresh = copy.deepcopy(model)  # the unconverted architecture, other weights
    comera.convert_(model, ranks=4, embedding=True, exclude=["lm_head", "transformer.wte"])
    comera.save_pretrained(model, tmp_path / "tt")
    ids = torch.randint(0, VOCAB, (2, 8))
    loaded = comera.from_pretrained(tmp_path / "tt", fresh)
    assert loaded is fresh
    assert type(loaded.transformer.wpe).__name__ == "TTEmbedding"
    assert torch.equal(loaded(ids).logits, model(ids).logits)
    # the files of HuggingFace's own save_pretrained do not hold the TT layers: say so
    model.save_pretrained(tmp_path / "hf")
    with pytest.raises(comera.CheckpointError, match="HuggingFace's save_pretrained"):
        comera.from_pretrained(tmp_path / "hf", _gpt2())
    # a changed tensor fails the checksum before the model is touched
    st = pytest.importorskip("safetensors.torch")
    tensors = st.load_file(tmp_path / "tt" / "comera_model.safetensors")
    tensors["transformer.h.0.attn.c_attn.cores.0"] += 1
    st.save_file(tensors, tmp_path / "tt" / "comera_model.safetensors")
    target = _gpt2()
    with pytest.raises(comera.CheckpointError, match="checksum"):
        comera.from_pretrained(tmp_path / "tt", target)
    assert not any(True for _ in comera.gated_layers(target))


def test_a_bert_with_tables_of_another_format_round_trips(tmp_path):
    """BERT's embedding tables converted to Tucker tables (GatedEmbedding records) load back
    from the folder by the class alone, logits equal."""
    torch.manual_seed(0)
    model = _bert().eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        comera.convert_(model, comera.ConvertConfig(format="tucker", ranks=4, embedding=True,
                                                    exclude=("classifier",)))
    tables = [m for m in model.modules() if isinstance(m, comera.GatedEmbedding)]
    assert len(tables) == 3 and all(t.format.name == "tucker" for t in tables)
    comera.save_pretrained(model, tmp_path)
    loaded = comera.from_pretrained(tmp_path, transformers.BertForSequenceClassification)
    assert type(loaded.bert.embeddings.word_embeddings) is comera.GatedEmbedding
    ids = torch.randint(0, VOCAB, (2, 8))
    assert torch.equal(loaded(ids).logits, model(ids).logits)


def _same_model(model, reference) -> bool:
    """The same module types in the same places and the same tensors (values and names)."""
    kinds = [(n, type(m)) for n, m in model.named_modules()]
    if kinds != [(n, type(m)) for n, m in reference.named_modules()]:
        return False
    mine, theirs = model.state_dict(), reference.state_dict()
    return mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)


def test_a_failing_from_pretrained_leaves_the_callers_model_untouched(tmp_path):
    """Issue 42, item 1: a GPT-2 of other n_positions fails (wpe differs) after its Conv1D
    layers were swapped for rank-1 TT layers: the caller's dense weights were gone."""
    torch.manual_seed(0)
    model = _gpt2().eval()
    with pytest.warns(UserWarning, match=r"comera\.save_pretrained"):
        comera.convert_(model, ranks=4)
    comera.save_pretrained(model, tmp_path)
    config = transformers.GPT2Config(vocab_size=VOCAB, n_positions=32, n_embd=16, n_layer=1,
                                     n_head=2, n_inner=16, bos_token_id=0, eos_token_id=0)
    other = transformers.GPT2LMHeadModel(config).eval()
    before = copy.deepcopy(other)
    with pytest.raises(comera.CheckpointError, match=r"transformer\.wpe\.weight: \(16, 16\)"):
        comera.from_pretrained(tmp_path, other)
    assert _same_model(other, before)
    assert not any(True for _ in comera.gated_layers(other))
    ids = torch.randint(0, VOCAB, (2, 8))
    assert torch.equal(other(ids).logits, before(ids).logits)


def test_load_checkpoint_takes_the_unconverted_gpt2_the_cli_hints_at(tmp_path):
    """Issue 42, item 9: `comera convert` hints comera.load_checkpoint(path, model) into the
    original architecture; for a GPT-2 (Conv1D layers) that raised a 1,600-character error
    naming each layer. The Conv1D layers are converted as the records say, then loaded."""
    torch.manual_seed(0)
    model = _gpt2().eval()
    original = copy.deepcopy(model)
    with pytest.warns(UserWarning, match=r"comera\.save_pretrained"):
        comera.convert_(model, ranks=4)
    comera.save_checkpoint(tmp_path / "tt.pt", model)
    comera.load_checkpoint(tmp_path / "tt.pt", original)
    assert {n: m.bonds for n, m in comera.gated_layers(original)} == \
        {n: m.bonds for n, m in comera.gated_layers(model)}
    ids = torch.randint(0, VOCAB, (2, 8))
    assert torch.equal(original(ids).logits, model(ids).logits)


def test_report_counts_a_tied_weight_once_as_model_size_does(tmp_path):
    """Issue 42, item 2: `comera report` counted GPT-2's lm_head.weight (tied to wte, one
    storage in the file) twice: 272,708 against model_size's 239,940."""
    from comera.surgery.report import checkpoint_report

    torch.manual_seed(0)
    model = _gpt2()
    with pytest.warns(UserWarning, match=r"comera\.save_pretrained"):
        comera.convert_(model, ranks=4)
    assert model.lm_head.weight is model.transformer.wte.weight
    comera.save_checkpoint(tmp_path / "tt.pt", model)
    report = checkpoint_report(tmp_path / "tt.pt")
    assert report.tt_params + report.other_params == comera.model_size(model)
    assert report.tt_params == comera.model_size(model, only=comera.GatedLayer)
    assert report.compression == pytest.approx(comera.compression_ratio(
        model, only=comera.GatedLayer))
    assert f"whole model: {comera.model_size(model):,} parameters" in str(report)
