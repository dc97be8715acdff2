"""Data-parallel CoMERA on 2 CPU processes (gloo): workers stay bit-identical (parameters, ranks,
optimizer state, through pruning and truncation), and match a single-process run on the same
global batches."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from comera.experiments.engine import EngineConfig, train_model

CFG = EngineConfig(steps_early=10, steps_late=6, batch_size=16, lr=1e-2, lr_gates=0.1, lam=5.0,
                   target_compression=3.0, eval_every=4)


def _worker(rank: int, world: int, init: str, out: str) -> None:
    from tests.helpers.toy_task import ToyTask

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        model, record = train_model(ToyTask(), "comera", CFG, Path(out) / "run")
        torch.save({"params": {k: v.detach() for k, v in model.named_parameters()},
                    "ranks": [m.ranks for m in model.modules() if hasattr(m, "gates")],
                    "curve": record.train_curve}, Path(out) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def two_workers(tmp_path_factory):
    out = tmp_path_factory.mktemp("ddp")
    init = f"file://{out / 'rendezvous'}"
    mp.start_processes(_worker, args=(2, init, str(out)), nprocs=2, join=True,
                       start_method="spawn")
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(2)], out


def test_workers_hold_bit_identical_parameters_and_ranks(two_workers):
    (a, b), _ = two_workers
    assert a["params"].keys() == b["params"].keys()
    for name in a["params"]:
        assert torch.equal(a["params"][name], b["params"][name]), name
    assert a["ranks"] == b["ranks"]
    assert a["ranks"][0] != (1, 4, 6, 4, 1), "the run should have pruned ranks"
    # the same global loss and the same loss / size choice at every step
    assert [(s, loss, w) for s, loss, _, w in a["curve"]] == \
        [(s, loss, w) for s, loss, _, w in b["curve"]]


def test_checkpoint_holds_worker_zero_optimizer_state_equal_to_a_single_process_run(
        two_workers, tmp_path):
    from tests.helpers.toy_task import ToyTask

    (a, _), out = two_workers
    torch.set_num_threads(1)
    model, record = train_model(ToyTask(), "comera", CFG, tmp_path / "single")
    single = dict(model.named_parameters())
    for name, value in a["params"].items():
        torch.testing.assert_close(value, single[name].detach(), rtol=1e-9, atol=1e-9)
    losses_ddp = torch.tensor([c[1] for c in a["curve"]])
    losses_one = torch.tensor([c[1] for c in record.train_curve])
    torch.testing.assert_close(losses_ddp, losses_one, rtol=1e-9, atol=1e-12)
    ddp_opt = torch.load(out / "run" / "checkpoints" / "comera.pt", weights_only=True)
    one_opt = torch.load(tmp_path / "single" / "checkpoints" / "comera.pt", weights_only=True)
    for k, state in one_opt["optimizer"]["state"].items():
        for key, value in state.items():
            torch.testing.assert_close(ddp_opt["optimizer"]["state"][k][key], value,
                                       rtol=1e-8, atol=1e-12)


def test_run_checkpoint_entries_without_fsdp_round_trip_alone(tmp_path):
    """The engine's entries (prepare_model_, save/load_run_checkpoint) on one process: plain
    replication, comera's own checkpoint format; --fsdp alone is refused (2 workers:
    tests/comera/integrations/test_fsdp.py)."""
    from comera import CoMERATrainer, TTLinear, make_optimizer
    from comera.errors import ConfigError
    from comera.experiments.distributed import (
        average_gradients,
        load_run_checkpoint,
        prepare_model_,
        save_run_checkpoint,
    )

    torch.manual_seed(0)
    model = torch.nn.Sequential(TTLinear(16, 16, (4, 4), (4, 4), ranks=4))
    assert prepare_model_(model, max_grad_norm=1.0) == (average_gradients, 1.0)
    with pytest.raises(ConfigError, match="--nproc"):
        prepare_model_(model, fsdp=True)
    trainer = CoMERATrainer(model, make_optimizer(model))
    trainer.step(model(torch.randn(8, 16)).square().mean())
    save_run_checkpoint(tmp_path / "ck.pt", model, trainer.optimizer, step=1)
    fresh = torch.nn.Sequential(TTLinear(16, 16, (4, 4), (4, 4), ranks=4))
    opt = make_optimizer(fresh)
    assert load_run_checkpoint(tmp_path / "ck.pt", fresh, opt) == {"step": 1}
    for p, q in zip(model.parameters(), fresh.parameters(), strict=True):
        assert torch.equal(p, q)
    assert opt.state_dict()["state"].keys() == trainer.optimizer.state_dict()["state"].keys()


def _fsdp_worker(rank: int, world: int, init: str, out: str) -> None:
    import math
    from dataclasses import replace

    from tests.helpers.toy_task import ToyTask

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        cfg = replace(CFG, fsdp=True, checkpoint_every=5)
        model, record = train_model(ToyTask(), "comera", cfg, Path(out) / "full")
        train_model(ToyTask(), "comera", cfg, Path(out) / "cut", stop_after=7)
        resumed, again = train_model(ToyTask(), "comera", cfg, Path(out) / "cut",
                                     resume=True)
        same = len(again.train_curve) == len(record.train_curve) and all(
            math.isclose(a[1], b[1], rel_tol=1e-12) and a[3] == b[3]
            for a, b in zip(again.train_curve, record.train_curve, strict=True))
        if rank == 0:
            torch.save({"curve": record.train_curve, "resumed_same": same,
                        "ranks": [m.ranks for m in model.modules() if hasattr(m, "gates")],
                        "resumed_ranks": [m.ranks for m in resumed.modules()
                                          if hasattr(m, "gates")]}, Path(out) / "fsdp.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.skipif(not hasattr(EngineConfig(), "fsdp"),
                    reason="the engine's --fsdp wiring (EngineConfig.fsdp) is not applied yet")
def test_engine_fsdp_run_matches_replicated_data_parallel_and_resumes(two_workers, tmp_path):
    """``comera train ... --nproc 2 --fsdp``'s engine path: the same losses, loss/size choices
    and ranks as the replicated run, and a run stopped after 7 steps resumes to the same end."""
    (a, _), _ = two_workers
    mp.start_processes(_fsdp_worker, args=(2, f"file://{tmp_path / 'rdv'}", str(tmp_path)),
                       nprocs=2, join=True, start_method="spawn")
    fsdp = torch.load(tmp_path / "fsdp.pt", weights_only=False)
    torch.testing.assert_close(torch.tensor([c[1] for c in fsdp["curve"]]),
                               torch.tensor([c[1] for c in a["curve"]]), rtol=1e-9, atol=1e-12)
    assert [c[3] for c in fsdp["curve"]] == [c[3] for c in a["curve"]]
    assert fsdp["ranks"] == a["ranks"] == fsdp["resumed_ranks"]
    assert fsdp["resumed_same"]
