"""FSDP2 with rank gates on 2 gloo CPU processes (comera.integrations.fsdp): a converted Llama-style
model (random init) trains through the early stage, truncation and the late stage's pruning
with the same losses and final ranks as one process on the same global batches, and its
checkpoint resumes (into a sharded model, and into an unsharded one) to the same next steps.
The parameters are float64; the tolerance is float32's, as the Llama loss is computed in
float32."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import comera
from comera.errors import ConfigError
from comera.experiments.distributed import (
    load_run_checkpoint,
    mean_over_workers,
    prepare_model_,
    save_run_checkpoint,
)
from comera.integrations import fsdp

pytest.importorskip("transformers")

EARLY, LATE, AFTER = 3, 3, 2
MAX_NORM = 0.5  # below the first steps' gradient norms: clipping is active
CONFIG = comera.OptimizerConfig(lr_cores=1e-2, lr_gates=5e-2, lr_other=1e-2)


def _llama() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    warnings.filterwarnings("ignore", "converted a HuggingFace model")
    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                      max_position_embeddings=64)
    model = LlamaForCausalLM(cfg).double()
    comera.convert_(model, exclude=("lm_head",), ranks=8)
    with torch.no_grad():  # pruned slices, so the stage boundary's truncation changes shapes
        for _, layer in comera.gated_layers(model):
            layer.gates[1][-3:] = 0.0
    return model


def _ids(rank: int, world: int) -> torch.Tensor:
    ids = torch.randint(0, 128, (4, 16), generator=torch.Generator().manual_seed(3))  # (B, T)
    return ids.chunk(world)[rank]


def _trainer(model, world: int) -> comera.CoMERATrainer:
    """Shard (with 2 workers; the engine's --fsdp entry), then the optimizer and trainer. The
    gradients are clipped (by the trainer alone, by the FSDP hook with 2 workers)."""
    hook, clip = prepare_model_(model, fsdp=world > 1, max_grad_norm=MAX_NORM)
    return comera.CoMERATrainer(model, comera.make_optimizer(model, CONFIG), lam=1.0,
                                grad_hook=hook, max_grad_norm=clip)


def _steps(model, trainer, ids, n: int) -> list[float]:
    losses = []
    for _ in range(n):
        loss = model(input_ids=ids, labels=ids).loss
        mean = mean_over_workers(float(loss.detach()))  # the global batch's loss
        trainer.step(loss, decision_loss=mean)
        losses.append(mean)
    return losses


def session(rank: int, world: int, out: Path) -> dict:
    """Train, truncate, prune, checkpoint; then resume a fresh model from the checkpoint."""
    ids = _ids(rank, world)
    model = _llama()
    trainer = _trainer(model, world)
    losses = _steps(model, trainer, ids, EARLY)
    report = trainer.start_late_stage(comera.LateStage.from_ratio(model, 1.3, steps=LATE))
    losses += _steps(model, trainer, ids, LATE)
    path = out / "ck.pt"
    save_run_checkpoint(path, model, trainer.optimizer, world > 1, trainer=trainer.state_dict())
    ranks = [layer.ranks for _, layer in comera.gated_layers(model)]
    size = comera.model_size(model)
    after = _steps(model, trainer, ids, AFTER)

    fresh = _llama()
    resumed = _trainer(fresh, world)
    extra = load_run_checkpoint(path, fresh, resumed.optimizer, world > 1)
    resumed.load_state_dict(extra["trainer"])
    return {"losses": losses, "ranks": ranks, "size": size, "truncated": report.changed,
            "after": after, "resumed": _steps(fresh, resumed, ids, AFTER),
            "resumed_ranks": [layer.ranks for _, layer in comera.gated_layers(fresh)]}


def _worker(rank: int, world: int, init: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        torch.save(session(rank, world, Path(out)), Path(out) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("fsdp")
    mp.start_processes(_worker, args=(2, f"file://{out / 'rendezvous'}", str(out)), nprocs=2,
                       join=True, start_method="spawn")
    two = [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(2)]
    torch.set_num_threads(1)
    one = session(0, 1, tmp_path_factory.mktemp("single"))
    return two, one, out


@pytest.mark.slow  # two spawned processes importing transformers: ~15 s on 2 quiet cores
def test_two_sharded_workers_train_as_one_process_through_truncation_and_pruning(runs):
    (a, b), one, _ = runs
    assert a["losses"] == b["losses"] and a["ranks"] == b["ranks"]
    torch.testing.assert_close(torch.tensor(a["losses"]), torch.tensor(one["losses"]),
                               rtol=1e-6, atol=0)
    assert a["truncated"] and one["truncated"]
    assert a["ranks"] == one["ranks"] and a["size"] == one["size"]
    # the late stage's schedule pruned below the truncated ranks
    assert any(r[2] < 5 for r in a["ranks"]), a["ranks"]


@pytest.mark.slow
def test_the_checkpoint_resumes_to_the_same_next_steps(runs):
    (a, b), one, out = runs
    torch.testing.assert_close(torch.tensor(a["resumed"]), torch.tensor(a["after"]),
                               rtol=1e-6, atol=0)
    torch.testing.assert_close(torch.tensor(a["after"]), torch.tensor(one["after"]),
                               rtol=1e-6, atol=0)
    assert a["resumed_ranks"] == a["ranks"] == b["resumed_ranks"]
    # the file is a plain comera checkpoint: it also loads into an unsharded model
    model = _llama()
    opt = comera.make_optimizer(model, CONFIG)
    extra = comera.load_checkpoint(out / "ck.pt", model, opt)
    assert [layer.ranks for _, layer in comera.gated_layers(model)] == a["ranks"]
    assert extra["trainer"]["stage"] == "late"


def test_sharding_needs_a_process_group():
    with pytest.raises(ConfigError, match="process group"):
        fsdp.shard_(_llama())
    with pytest.raises(ConfigError, match="--nproc"):
        prepare_model_(_llama(), fsdp=True)
