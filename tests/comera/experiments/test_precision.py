"""The engine's --precision (torch.autocast; fp16 with a GradScaler, CUDA only) and --compile
(torch.compile of the training forward), and the trainers' GradScaler step."""

from __future__ import annotations

import copy
import json
from dataclasses import replace

import pytest
import torch
from torch import nn

import comera
from comera.experiments.distributed import current_world
from comera.experiments.engine import EngineConfig, _Run, train_model
from comera.experiments.results import run_experiment
from tests.helpers.toy_task import ToyTask


class Toy32(ToyTask):
    """The toy task in float32: autocast, like torch, leaves float64 tensors alone."""

    def __init__(self):
        super().__init__()
        self.x, self.y = self.x.float(), self.y.float()

    def build_model(self, format: str = "tt") -> nn.Module:
        return super().build_model(format).float()

    def evaluate(self, model: nn.Module, split: str) -> dict[str, float]:
        device = next(model.parameters()).device
        part = self.val if split == "val" else slice(64, 128)
        loss = nn.functional.mse_loss(model(self.x[part].to(device)), self.y[part].to(device))
        return {"loss": float(loss), "rmse": float(loss) ** 0.5}


CFG = EngineConfig(steps_early=10, steps_late=0, stage="early", batch_size=16, lr=1e-2,
                   lr_gates=0.1, lam=0.0, eval_every=5)

pytestmark = pytest.mark.usefixtures("one_thread")


def test_bf16_run_trains_close_to_fp32_and_records_the_precision(tmp_path):
    _, fp32 = train_model(Toy32(), "comera", CFG, tmp_path / "a")
    summary = run_experiment(Toy32(), replace(CFG, precision="bf16"), tmp_path / "b",
                             ("comera",))
    saved = json.loads((tmp_path / "b" / "toy.json").read_text())
    assert summary["config"]["precision"] == saved["config"]["precision"] == "bf16"
    assert saved["config"]["compile"] is False
    bf16 = [loss for _, loss, _, _ in saved["runs"][0]["train_curve"]]
    losses32 = [loss for _, loss, _, _ in fp32.train_curve]
    assert losses32[-1] < losses32[0] and bf16[-1] < bf16[0]
    assert bf16 == pytest.approx(losses32, rel=0.1)  # the curves agree to bf16's precision


def test_bf16_step_runs_under_autocast_and_keeps_parameters_in_their_dtype(tmp_path):
    run = _Run(Toy32(), "comera", replace(CFG, precision="bf16"), tmp_path,
               current_world(), None)
    seen = []
    run.model[0].register_forward_hook(lambda m, i, out: seen.append(out.dtype))
    run.train_step()
    assert seen == [torch.bfloat16]
    assert all(p.dtype == torch.float32 for p in run.model.parameters())
    assert run.record.train_curve and run.scaler is None


def test_compile_wraps_the_training_forward_only(tmp_path):
    run = _Run(Toy32(), "comera", replace(CFG, compile=True), tmp_path,
               current_world(), None)
    assert isinstance(run.forward_model, torch._dynamo.eval_frame.OptimizedModule)
    assert run.forward_model._orig_mod is run.model  # checkpoints keep the model's own names


def test_fp16_needs_cuda():
    with pytest.raises(comera.ConfigError, match="bf16"):
        EngineConfig(precision="fp16")
    with pytest.raises(comera.ConfigError, match="precision"):
        EngineConfig(precision="fp8")


def test_cli_refuses_fp16_on_cpu_in_one_line(tmp_path, capsys):
    from comera.cli import main

    code = main(["train", "transformer", "--quick", "--precision", "fp16",
                 "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert code == 2 and "fp16" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "out").exists()


def _toy():
    torch.manual_seed(0)
    return nn.Sequential(comera.TTLinear(16, 16, ranks=4), nn.Tanh(),
                         nn.Linear(16, 2))


def test_grad_scaler_step_equals_the_unscaled_step_and_backs_off_on_overflow():
    x = torch.randn(8, 16) * 100
    plain, scaled = _toy(), _toy()
    a = comera.CoMERATrainer(plain, comera.make_optimizer(plain), lam=0.1)
    b = comera.CoMERATrainer(scaled, comera.make_optimizer(scaled), lam=0.1)
    b.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    a.step(plain(x).square().mean())
    b.step(scaled(x).square().mean())
    for p, q in zip(plain.parameters(), scaled.parameters(), strict=True):
        torch.testing.assert_close(q, p, rtol=1e-6, atol=1e-7)
    before = copy.deepcopy(scaled.state_dict())
    b.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**127)  # the scaled gradients overflow
    with pytest.raises(comera.NonFiniteGradientError):
        b.step(scaled(x).square().mean() * 1e4)
    assert b.scaler.get_scale() < 2.0**127
    for k, v in scaled.state_dict().items():
        assert torch.equal(v, before[k]), k


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_low_precision_run_on_cuda_learns_like_fp32(tmp_path, precision):
    cfg = replace(CFG, device="cuda")
    _, fp32 = train_model(Toy32(), "comera", cfg, tmp_path / "a")
    _, low = train_model(Toy32(), "comera", replace(cfg, precision=precision),
                         tmp_path / "b")
    want = [loss for _, loss, _, _ in fp32.train_curve]
    got = [loss for _, loss, _, _ in low.train_curve]
    assert got[-1] < got[0] and low.skipped <= 2  # fp16: the scaler may back off at the start
    assert got[-1] == pytest.approx(want[-1], rel=0.2)
