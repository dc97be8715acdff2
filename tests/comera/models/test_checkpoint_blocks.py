"""Activation checkpointing of the encoder blocks: the same losses, gradients and RNG stream as
without (dropout on, float64, every TT memory mode, stacked q/k/v), far fewer saved bytes, and
the engine / CLI switch (resume across it, a clear refusal for models without blocks)."""

from __future__ import annotations

import copy
from dataclasses import replace

import pytest
import torch
from torch import nn

import comera
from comera.cli import _engine_config, build_parser
from comera.errors import ConfigError
from comera.experiments.engine import EngineConfig, train_model
from comera.experiments.registry import experiment
from comera.models import MaskedLM, PairClassifier, TransformerConfig
from tests.helpers.saved import saved_by_autograd

pytestmark = pytest.mark.usefixtures("one_thread")

CFG = TransformerConfig.small(64, d_model=32, n_heads=2, d_ff=64, n_layers=2, rank=4,
                              embedding_rank=4, max_len=16, dropout=0.2,
                              attn_modes=((2, 4, 4), (4, 4, 2)),
                              ffn_in_modes=((2, 4, 4), (4, 4, 4)),
                              ffn_out_modes=((4, 4, 4), (4, 4, 2)))


def _step(model: nn.Module, ids: torch.Tensor, checkpoint: bool):
    """Loss, gradients and the RNG state after one training forward + backward from seed 0."""
    model = copy.deepcopy(model).train()
    model.checkpoint_blocks = checkpoint
    torch.manual_seed(0)
    loss = model(ids).square().mean()
    loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), grads, torch.get_rng_state()


@pytest.mark.parametrize("kind, memory", [
    ("tt", "fast"), pytest.param("tt", "balanced", marks=pytest.mark.slow), ("tt", "min"),
    ("dense", None)])
def test_checkpointed_blocks_give_the_same_loss_gradients_and_rng(kind, memory):
    torch.manual_seed(1)
    model = PairClassifier(replace(CFG, linear_format=kind)).double()
    for _, layer in comera.gated_layers(model):
        layer.memory = memory
    ids = torch.randint(1, 64, (3, 16))
    ids[0, 10:] = 0  # padding: the attention mask goes through the checkpoint too
    loss, grads, rng = _step(model, ids, checkpoint=False)
    loss_c, grads_c, rng_c = _step(model, ids, checkpoint=True)
    assert torch.equal(loss, loss_c)
    assert grads.keys() == grads_c.keys() and len(grads) == len(list(model.parameters()))
    for name in grads:
        assert torch.equal(grads[name], grads_c[name]), name
    assert torch.equal(rng, rng_c)  # the recomputation replays the RNG, it does not advance it
    if kind != "dense":  # the stacked q/k/v path ran (and was recomputed)
        assert model.blocks[0].attn._siblings.stacked is not None
    # dropout is live: another seed gives another loss (the equality above is not vacuous)
    torch.manual_seed(5)
    assert not torch.equal(copy.deepcopy(model).train()(ids).square().mean().detach(), loss)


def _saved_bytes(model: nn.Module, ids: torch.Tensor) -> int:
    """Bytes autograd keeps for the backward: saved tensors, plus the inputs each checkpointed
    block holds for its recomputation."""
    _, total = saved_by_autograd(model, ids)
    if model.checkpoint_blocks:
        b, s = ids.shape
        total += len(model.blocks) * b * s * (model.cfg.d_model * 4 + 1)  # x (fp32), pad_mask
    return total


@pytest.mark.parametrize("kind", ["tt", "dense"])
def test_checkpointed_blocks_save_a_fraction_of_the_bytes(kind):
    model = PairClassifier(replace(CFG, linear_format=kind, n_layers=4)).train()
    ids = torch.randint(1, 64, (4, 16))
    plain = _saved_bytes(model, ids)
    model.checkpoint_blocks = True
    kept = _saved_bytes(model, ids)
    assert kept * 4 < plain, (kept, plain)
    model.eval()  # evaluation saves nothing for a backward either way: no checkpoint there
    with torch.no_grad():
        torch.testing.assert_close(model(ids), model(ids))


def test_masked_lm_checkpoints_its_blocks_exactly():
    torch.manual_seed(2)
    model = MaskedLM(CFG).double()  # TT layers
    ids = torch.randint(1, 64, (2, 16))
    loss, grads, _ = _step(model, ids, checkpoint=False)
    loss_c, grads_c, _ = _step(model, ids, checkpoint=True)
    assert torch.equal(loss, loss_c)
    assert all(torch.equal(grads[n], grads_c[n]) for n in grads) and grads.keys() == grads_c.keys()


def test_train_flag_reaches_the_engine_config():
    args = build_parser().parse_args(["train", "transformer", "--quick", "--checkpoint-blocks"])
    assert _engine_config(args, experiment("transformer")).checkpoint_blocks is True
    args = build_parser().parse_args(["train", "mlm", "--quick"])
    assert _engine_config(args, experiment("mlm")).checkpoint_blocks is False


def test_engine_refuses_checkpoint_blocks_for_a_model_without_blocks(tmp_path):
    from tests.helpers.toy_task import ToyTask

    cfg = EngineConfig(steps_early=1, steps_late=0, batch_size=4, stage="early",
                       checkpoint_blocks=True)
    with pytest.raises(ConfigError, match=r"checkpoint_blocks=True.*no encoder blocks"):
        train_model(ToyTask(), "comera", cfg, tmp_path)


SOURCE = '''def area(width, height):
    """Area of a rectangle."""
    return width * height
'''


def test_engine_trains_and_resumes_bit_identically_with_checkpointed_blocks(tmp_path):
    from comera.experiments.mlm_task import MLMTask, MLMTaskConfig

    root = tmp_path / "src"
    root.mkdir()
    for i in range(20):
        (root / f"mod{i}.py").write_text(SOURCE.replace("area", f"area{i}") * 3)
    task = MLMTask(MLMTaskConfig(seq_len=16, vocab_size=64, d_model=32, n_heads=2, d_ff=64,
                                 n_layers=1, rank=4, embedding_rank=4, eval_limit=4,
                                 eval_batch_size=4), root=root, use_cache=False)
    cfg = EngineConfig(steps_early=4, steps_late=0, batch_size=4, eval_every=2, stage="early")
    whole, _ = train_model(task, "comera", cfg, tmp_path / "whole")
    ckpt, _ = train_model(task, "comera", replace(cfg, checkpoint_blocks=True),
                          tmp_path / "ckpt")
    assert ckpt.checkpoint_blocks and not whole.checkpoint_blocks
    # a run may resume with the option switched: it leaves the results unchanged
    train_model(task, "comera", cfg, tmp_path / "mixed", stop_after=2)
    mixed, _ = train_model(task, "comera", replace(cfg, checkpoint_blocks=True),
                           tmp_path / "mixed", resume=True)
    for other in (ckpt, mixed):
        for (name, a), b in zip(whole.state_dict().items(), other.state_dict().values(),
                                strict=True):
            assert torch.equal(a, b), name
