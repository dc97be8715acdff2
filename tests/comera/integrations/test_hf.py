"""CoMERACallback in a real HuggingFace Trainer on a tiny GPT-2 built from a config (random
weights, no downloads): both stages to a compression target, logs, checkpoints that resume
exactly, and HF's own from_pretrained refusing a checkpoint instead of re-initialising."""

from __future__ import annotations

import pytest
import torch

import comera

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")  # Trainer needs it (the hf extra installs it)
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments  # noqa: E402

from comera.integrations.hf import CoMERACallback  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")
TARGET, LATE_START, STEPS = 4.0, 3, 8


def _model(seed: int = 0) -> GPT2LMHeadModel:
    torch.manual_seed(seed)
    config = GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=16,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                        bos_token_id=0, eos_token_id=0)
    model = GPT2LMHeadModel(config)
    with pytest.warns(UserWarning, match="save_pretrained"):
        comera.convert_(model, ranks=8)
    with torch.no_grad():  # a rank per layer already pruned, as an early stage would
        for _, layer in comera.gated_layers(model):
            layer.gates[1][:1] = 0.0
    return model


class _Tokens(torch.utils.data.Dataset):
    def __init__(self, n: int = 64):
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, 64, (n, 16), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def _trainer(model, out, steps: int = STEPS, **callback) -> Trainer:
    args = TrainingArguments(output_dir=str(out), max_steps=steps, per_device_train_batch_size=8,
                             learning_rate=1e-3, logging_steps=2, save_steps=4, report_to=[],
                             use_cpu=True, disable_tqdm=True, seed=0, save_total_limit=None)
    callback = {"target_compression": TARGET, "late_start": LATE_START, "lam": 0.01, **callback}
    cb = CoMERACallback(**callback)
    return Trainer(model=model, args=args, train_dataset=_Tokens(), callbacks=[cb])


def _tt_compression(model) -> float:
    return comera.compression_ratio(model, only=comera.GatedLayer)


@pytest.fixture(scope="module")
def run(tmp_path_factory, one_thread):
    out = tmp_path_factory.mktemp("hf")
    model = _model()
    trainer = _trainer(model, out)
    trainer.train()
    return {"model": model, "trainer": trainer, "out": out}


def test_both_stages_reach_the_compression_target(run):
    model, trainer = run["model"], run["trainer"]
    callback = next(c for c in trainer.callback_handler.callbacks
                    if isinstance(c, CoMERACallback))
    assert callback.driver.controller.stage == "late"
    assert callback.driver.controller.steps == STEPS
    assert 0.95 * TARGET <= _tt_compression(model) <= 1.6 * TARGET
    bonds = [sum(m.bonds) for _, m in comera.gated_layers(model)]
    fresh = [sum(m.bonds) for _, m in comera.gated_layers(_model())]
    assert sum(bonds) < sum(fresh)  # truncated physically


def test_logs_hold_the_plain_loss_next_to_the_objective_ranks_and_compression(run):
    logs = [h for h in run["trainer"].state.log_history if "loss" in h]
    assert logs
    for entry in logs:
        assert {"objective", "size", "compression", "rank_total", "late_stage"} <= set(entry)
        assert entry["objective"] >= entry["loss"]
    assert logs[0]["late_stage"] == 0.0 and logs[-1]["late_stage"] == 1.0
    assert logs[-1]["compression"] > logs[0]["compression"]


def test_the_logged_compression_is_the_one_the_target_refers_to(run):
    """Issue 34, item 1: ``compression`` is the TT layers' (what target_compression means), so a
    run that met its target logs it; the whole model's has its own name."""
    model = run["model"]
    last = [h for h in run["trainer"].state.log_history if "loss" in h][-1]
    assert last["compression"] == pytest.approx(_tt_compression(model), rel=1e-6)
    assert last["compression"] >= 0.95 * TARGET
    assert last["model_compression"] == pytest.approx(comera.compression_ratio(model), rel=1e-6)
    assert last["model_compression"] < last["compression"]  # the dense embeddings count there


def test_save_model_writes_what_comera_reads_and_hf_refuses(run, tmp_path):
    """Issue 34, item 5: ``trainer.save_model()`` of a converted model is read back by
    comera.from_pretrained as it was, and refused by HuggingFace's own from_pretrained (which
    would otherwise build dense layers with fresh random weights)."""
    model, folder = run["model"], tmp_path / "final"
    run["trainer"].save_model(str(folder))
    loaded = comera.from_pretrained(folder, GPT2LMHeadModel)
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    model.eval()
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)
    with pytest.raises(RuntimeError, match="mismatch"):
        GPT2LMHeadModel.from_pretrained(folder)


def test_a_late_start_at_max_steps_is_a_warning_when_training_begins(tmp_path):
    """Issue 34, item 6: the late stage cannot run; the callback says so up front (and again at
    the end), and training ends without starting a stage that has no steps."""
    trainer = _trainer(_model(), tmp_path, steps=2, late_start=2)
    with pytest.warns(UserWarning, match="late_start=2 is at or past the trainer's max_steps=2"):
        trainer.train()


def test_resuming_with_another_target_after_the_late_stage_began_is_refused(run, tmp_path):
    """Issue 34, item 7: checkpoint-4 was saved in the late stage, aimed at 4x; a callback asking
    for 8x cannot change that stage's target, so the resume is refused, naming both values."""
    trainer = _trainer(_model(seed=1), tmp_path, target_compression=8.0)
    with pytest.raises(comera.ConfigError, match=r"target_compression 4\.0 -> 8\.0"):
        trainer.train(resume_from_checkpoint=str(run["out"] / "checkpoint-4"))


def test_resume_from_a_truncated_checkpoint_is_exact(run):
    """A fresh model (other random weights, untruncated) resumes from checkpoint-4 (after the
    truncation at step 3) and ends where the first run ended, bit for bit."""
    fresh = _model(seed=1)
    trainer = _trainer(fresh, run["out"] / "again")
    trainer.train(resume_from_checkpoint=str(run["out"] / "checkpoint-4"))
    ref = run["model"].state_dict()
    got = fresh.state_dict()
    assert ref.keys() == got.keys()
    for key in ref:
        assert torch.equal(ref[key], got[key]), key


def test_hf_from_pretrained_refuses_a_checkpoint(run):
    with pytest.raises(RuntimeError, match="mismatch"):
        GPT2LMHeadModel.from_pretrained(run["out"] / "checkpoint-8")


def test_a_model_without_tt_layers_is_refused(tmp_path):
    torch.manual_seed(0)
    dense = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64,
                                       n_positions=16, bos_token_id=0, eos_token_id=0))
    with pytest.raises(comera.ConfigError, match="no TT layers"):
        _trainer(dense, tmp_path)


@pytest.mark.parametrize("kwargs", [{"target_compression": 0.5, "late_start": 3},
                                    {"target_compression": 10}, {"late_start": 3},
                                    {"lam": -1}, {"late_steps": 0, "target_compression": 4,
                                                  "late_start": 1}])
def test_bad_schedules_are_refused(kwargs):
    with pytest.raises(comera.ConfigError):
        CoMERACallback(**kwargs)


# -- weights HuggingFace writes under other names: .bin (transformers 4.x with
# save_safetensors=False / safe_serialization=False) and variants (model.<variant>.safetensors)
def _as_bin(folder) -> None:
    """Rewrite a checkpoint folder's weights as transformers 4.x writes them with
    ``save_safetensors=False`` (transformers 5, installed here, writes safetensors only):
    ``pytorch_model.bin``, a torch.save of the state dict, in place of ``model.safetensors``."""
    from safetensors.torch import load_file

    tensors = load_file(folder / "model.safetensors")
    torch.save({k: v for k, v in tensors.items() if v.numel()}, folder / "pytorch_model.bin")
    (folder / "model.safetensors").unlink()


def test_a_checkpoint_saved_as_bin_is_marked_refused_by_hf_and_resumes_exactly(run, tmp_path):
    """A Trainer checkpoint whose weights are a .bin gets the markers too (on_save): HF's own
    from_pretrained refuses it instead of re-initialising the TT layers densely, and
    resume_from_checkpoint still resumes the truncated model exactly."""
    import shutil

    folder = tmp_path / "checkpoint-4"
    shutil.copytree(run["out"] / "checkpoint-4", folder)
    _as_bin(folder)
    callback = next(c for c in run["trainer"].callback_handler.callbacks
                    if isinstance(c, CoMERACallback))
    state = transformers.TrainerState(global_step=4)
    callback.on_save(TrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True),
                     state, None, model=run["model"])
    saved = torch.load(folder / "pytorch_model.bin", weights_only=True)
    names = [name for name, _ in comera.gated_layers(run["model"])]
    assert all(saved[f"{n}.weight"].numel() == 0 for n in names)
    with pytest.raises(RuntimeError, match="mismatch"):
        GPT2LMHeadModel.from_pretrained(folder)
    fresh = _model(seed=1)
    _trainer(fresh, tmp_path / "again").train(resume_from_checkpoint=str(folder))
    ref, got = run["model"].state_dict(), fresh.state_dict()
    assert ref.keys() == got.keys() and all(torch.equal(ref[k], got[k]) for k in ref)


def test_save_pretrained_of_a_variant_is_marked(run, tmp_path):
    """``model.save_pretrained(folder, variant=...)`` writes model.<variant>.safetensors: marked
    as model.safetensors is, so HF's from_pretrained(folder, variant=...) refuses it."""
    model = run["model"]
    model.save_pretrained(tmp_path, variant="v2")
    assert (tmp_path / "model.v2.safetensors").is_file()
    with pytest.raises(RuntimeError, match="mismatch"):
        GPT2LMHeadModel.from_pretrained(tmp_path, variant="v2")
    loaded = comera.from_pretrained(tmp_path, GPT2LMHeadModel)
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model.eval()(ids).logits)


def test_a_target_the_converted_model_is_past_already_says_so(tmp_path, caplog):
    """Issue 42, item 3: with nothing pruned and the conversion ranks already past the target,
    the callback's late stage said "the early stage pruned past it; lower lam or the early
    steps". It says the model was under the target before training."""
    model = _model()
    assert _tt_compression(model) > 1.2
    trainer = _trainer(model, tmp_path, steps=3, target_compression=1.05, late_start=1, lam=0.0)
    with caplog.at_level("WARNING", logger="comera.training.controller"):
        trainer.train()
    callback = next(c for c in trainer.callback_handler.callbacks
                    if isinstance(c, CoMERACallback))
    note = callback.driver.controller.late_note
    assert note.startswith("below:") and "under it before training" in note, note
    assert "nothing was pruned" in note and "lower lam" not in note
    assert "under it before training" in caplog.text
