"""Whole-step capture (comera.training.capture): the captured step trains as the eager trainer
does, and re-captures exactly when the step's signature changes (truncation, batch shape,
stage), never for in-place gate changes (pruning)."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import comera
from comera.errors import ConfigError
from comera.training.capture import CapturedStep, StepSignature

F64 = torch.float64


def _model(dtype=torch.float32) -> tuple[nn.Module, comera.CoMERATrainer]:
    torch.manual_seed(0)
    model = nn.Sequential(comera.TTLinear(64, 64, (4, 4, 4), (4, 4, 4), ranks=8, dtype=dtype),
                          nn.ReLU(),
                          comera.TTLinear(64, 16, (4, 4, 4), (2, 2, 4), ranks=6, dtype=dtype))
    with torch.no_grad():
        model[0].gates[0][-2:] = 0.0  # two pruned slices: the masks must keep them at zero
    opt = comera.make_optimizer(model, comera.OptimizerConfig(lr_cores=1e-2, lr_gates=2e-2))
    return model, comera.CoMERATrainer(model, opt, lam=0.1)


def _loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(model(x), y)


def _data(dtype=torch.float32, rows: int = 32):
    gen = torch.Generator().manual_seed(1)
    return (torch.randn(rows, 64, generator=gen, dtype=dtype),
            torch.randn(rows, 16, generator=gen, dtype=dtype))


def _run_both(mode: str, dtype, early: int, late: int, **options):
    """Eager trainer vs captured step on the same batches, through truncation: both losses."""
    x, y = _data(dtype)
    (m1, t1), (m2, t2) = _model(dtype), _model(dtype)
    step = CapturedStep(t2, _loss, mode=mode, **options)
    eager, captured = [], []
    for k in range(early + late):
        if k == early:
            for model, trainer in ((m1, t1), (m2, t2)):
                trainer.start_late_stage(comera.LateStage(
                    target_size=0.8 * comera.model_size(model), steps=late))
        eager.append(t1.step(_loss(m1, x, y)).loss)
        captured.append(float(step(x, y)))
    return (m1, t1), (m2, t2), step, eager, captured


def test_the_uncaptured_body_trains_exactly_as_the_trainer_through_both_stages():
    (m1, t1), (m2, t2), step, eager, captured = _run_both("eager", F64, early=4, late=4)
    assert captured == pytest.approx(eager, rel=1e-12, abs=0)
    for p, q in zip(m1.parameters(), m2.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-10, atol=1e-12)
    assert [m.ranks for _, m in comera.gated_layers(m1)] == [
        m.ranks for _, m in comera.gated_layers(m2)]
    assert t2.steps == t1.steps == 8
    # one capture per signature: the first call, then the stage boundary's truncation
    assert step.captures == 2 and step.reasons[0] == "first call"


def test_a_non_chain_format_trains_captured_as_the_trainer_through_truncation():
    """The toy format (a hyperedge bond, a ring-like link): the on-device size of the late
    stage is the layout's size formula, as model_size counts it."""
    from tests.comera.layers.toy_formats import TOY

    def toy_model():
        torch.manual_seed(0)
        model = nn.Sequential(comera.GatedLinear(64, 64, "tt", ranks=6, in_modes=(8, 8),
                                                 out_modes=(8, 8), dtype=F64), nn.Tanh(),
                              comera.GatedLinear(64, 16, TOY, ranks=(4, 3, 4), in_modes=(8, 8),
                                                 out_modes=(4, 4), dtype=F64))
        opt = comera.make_optimizer(model, comera.OptimizerConfig(lr_cores=1e-2,
                                                                  lr_gates=2e-2))
        return model, comera.CoMERATrainer(model, opt, lam=0.1)

    x, y = _data(F64)
    (m1, t1), (m2, t2) = toy_model(), toy_model()
    step = CapturedStep(t2, _loss, mode="eager")
    eager, captured = [], []
    for k in range(6):
        if k == 3:
            for model, trainer in ((m1, t1), (m2, t2)):
                trainer.start_late_stage(comera.LateStage(
                    target_size=0.7 * comera.model_size(model), steps=3))
        eager.append(t1.step(_loss(m1, x, y)).loss)
        captured.append(float(step(x, y)))
    assert captured == pytest.approx(eager, rel=1e-12, abs=0)
    assert [m.ranks for _, m in comera.gated_layers(m1)] == [
        m.ranks for _, m in comera.gated_layers(m2)]
    assert comera.model_size(m2) <= t2.late.target_size  # landed: pruned, truncated
    assert step.captures == 2


def test_torch_compile_of_the_whole_step_matches_eager():
    """The compile path on the CPU (aot_eager: dynamo and AOT autograd, no code generation)."""
    (m1, _), (m2, _), step, eager, captured = _run_both("compile", torch.float32, early=2,
                                                        late=0, backend="aot_eager")
    assert captured == pytest.approx(eager, rel=1e-5)
    for p, q in zip(m1.parameters(), m2.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-5)
    assert step.captures == 1


@pytest.mark.slow
def test_torch_compile_of_the_whole_step_matches_eager_through_truncation():
    (m1, _), (m2, _), step, eager, captured = _run_both("compile", torch.float32, early=3,
                                                        late=2, backend="aot_eager")
    assert captured == pytest.approx(eager, rel=1e-5)
    for p, q in zip(m1.parameters(), m2.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-5)
    assert step.captures == 2


@pytest.mark.slow
def test_reduce_overhead_inductor_step_matches_eager_on_the_cpu():
    """torch.compile(mode="reduce-overhead") with inductor (CUDA graphs only on CUDA)."""
    _, _, step, eager, captured = _run_both(
        "compile", torch.float32, early=3, late=0, compile_mode="reduce-overhead")
    assert captured == pytest.approx(eager, rel=1e-5)
    assert step.captures == 1


def test_recapture_count_follows_the_shape_change_rules():
    x, y = _data(F64)
    model, trainer = _model(F64)
    step = CapturedStep(trainer, _loss, mode="eager")
    for _ in range(3):
        step(x, y)
    assert step.captures == 1
    with torch.no_grad():  # pruning is a mask: same tensors, no re-capture
        model[2].gates[1][0] = 0.0
    step(x, y)
    assert step.captures == 1
    report = trainer.truncate()  # physical truncation: new, smaller parameters
    assert report.changed
    step(x, y)
    assert step.captures == 2 and step.reasons[-1].startswith("parameter shapes changed")
    trainer.truncate()  # nothing left to cut: same shapes, but new parameter objects
    step(x, y)
    assert step.captures == 3 and step.reasons[-1] == "parameters replaced (same shapes)"
    step(*_data(F64, rows=8))  # a partial batch
    assert step.captures == 4 and step.reasons[-1].startswith("batch")
    step(*_data(F64, rows=8))
    assert step.captures == 4


def test_signature_reasons():
    model, _ = _model()
    batch = _data()
    a = StepSignature.of(model, batch, "early")
    assert a.change_from(None) == "first call"
    assert a.change_from(a) == ""
    assert StepSignature.of(model, batch, "late").change_from(a) == "stage early -> late"


def test_bad_settings_are_refused():
    model, trainer = _model()
    with pytest.raises(ConfigError, match="mode 'fast'"):
        CapturedStep(trainer, _loss, mode="fast")
    with pytest.raises(ConfigError, match="check_every"):
        CapturedStep(trainer, _loss, mode="eager", check_every=0)
    with pytest.raises(ConfigError, match="CoMERATrainer"):
        CapturedStep(comera.DenseTrainer(model), _loss)
    hooked = comera.CoMERATrainer(model, trainer.optimizer, grad_hook=lambda m: None)
    with pytest.raises(ConfigError, match="grad_hook"):
        CapturedStep(hooked, _loss, mode="eager")
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="CUDA"):
            CapturedStep(trainer, _loss, mode="graphs")


def _raising_from(filename: str):
    """A stand-in for ``torch.compile`` whose compiled step raises from code in ``filename``:
    torch's CUDA-graph trees cannot run without a GPU, so where the error comes from is what the
    test controls."""
    source = ("def run(*batch):\n"
              "    raise RuntimeError('storage data ptrs are not allocated in pool')\n")
    scope: dict = {}
    exec(compile(source, filename, "exec"), scope)
    return lambda fn, **options: scope["run"]


def test_a_failure_inside_torchs_cuda_graphs_names_the_capture_that_works(monkeypatch):
    _, trainer = _model()
    monkeypatch.setattr(torch, "compile", _raising_from("torch/_inductor/cudagraph_trees.py"))
    step = CapturedStep(trainer, _loss, mode="compile")
    with pytest.raises(comera.CaptureError, match="mode='graphs'") as info:
        step(*_data())
    assert "allocated in pool" in str(info.value)
    assert isinstance(info.value.__cause__, RuntimeError)
    # the same error from anywhere else is not torch's capture failing: it passes unchanged
    monkeypatch.setattr(torch, "compile", _raising_from("my_model.py"))
    with pytest.raises(RuntimeError, match="allocated in pool") as info:
        CapturedStep(trainer, _loss, mode="compile")(*_data())
    assert not isinstance(info.value, comera.CaptureError)


def test_a_non_finite_loss_is_refused_after_the_step():
    _, trainer = _model()
    x, y = _data()
    step = CapturedStep(trainer, _loss, mode="eager")
    with pytest.raises(comera.NonFiniteLossError, match="step 0"):
        step(x, y * float("nan"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("mode", ["graphs", "compile"])
def test_cuda_whole_step_capture_matches_eager(mode):
    """On CUDA: make_graphed_callables and reduce-overhead (CUDA graphs) against eager."""
    x, y = (t.cuda() for t in _data())
    (m1, t1), (m2, t2) = _model(), _model()
    m1.cuda(), m2.cuda()
    for trainer in (t1, t2):  # the optimizers were built on CPU tensors: rebuild on the device
        trainer.optimizer = comera.make_optimizer(trainer.model, comera.OptimizerConfig(
            lr_cores=1e-2, lr_gates=2e-2))
    step = CapturedStep(t2, _loss, mode=mode)
    eager, captured = [], []
    for k in range(8):
        if k == 5:
            for model, trainer in ((m1, t1), (m2, t2)):
                trainer.start_late_stage(comera.LateStage(
                    target_size=0.8 * comera.model_size(model), steps=3))
        eager.append(t1.step(_loss(m1, x, y)).loss)
        captured.append(float(step(x, y)))
    assert captured == pytest.approx(eager, rel=1e-4)
    assert step.captures == 2


def _paper_transformer(device: str = "cpu"):
    """The paper's pair classifier at smoke size (TT layers and TT embeddings), its trainer and
    one batch, on ``device``."""
    from benchmarks.speed.bench_transformer import make_batch, smoke_config
    from comera.models.transformer import PairClassifier

    torch.manual_seed(0)
    cfg = smoke_config()
    model = PairClassifier(cfg).to(device)
    trainer = comera.CoMERATrainer(model, comera.make_optimizer(model), lam=0.1)
    batch = tuple(t.to(device) for t in make_batch(cfg, 4, cfg.max_len).tensors())
    return model, trainer, batch


def _pair_loss(model, ids, segments, labels):
    return F.cross_entropy(model(ids, segments), labels)


@pytest.mark.parametrize("stage", ["early", "late"])
def test_the_captured_region_of_the_paper_transformer_reads_nothing_back(stage, monkeypatch):
    """What mode="graphs" captures (the objective, forward and backward) runs no op that reads
    the device back to the host while a capture is in progress: such an op (the TT embedding's
    unique ids) failed the capture on an H200. Checked on the CPU with the capture flag set."""
    from tests.helpers.host_reads import HostReads

    model, trainer, batch = _paper_transformer()
    if stage == "late":
        trainer.start_late_stage(comera.LateStage(target_size=0.8 * comera.model_size(model)))
    step = CapturedStep(trainer, _pair_loss, mode="eager", autocast=torch.bfloat16)
    step(*batch)  # the first call sets up the body's constants, as a capture does
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    with HostReads() as seen:
        total, _ = step._objective(*batch)
        total.backward()
    assert [name for name, _ in seen.reads] == [], seen.reads[:1]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_graphs_capture_the_paper_transformer_step_and_match_eager():
    """The step `make gpu` measures, smoke-sized: TT embeddings in a CUDA graph, both stages."""
    (m1, t1, batch), (m2, t2, _) = _paper_transformer("cuda"), _paper_transformer("cuda")
    step = CapturedStep(t2, _pair_loss, mode="graphs")
    eager, captured = [], []
    for k in range(6):
        if k == 3:
            for model, trainer in ((m1, t1), (m2, t2)):
                trainer.start_late_stage(comera.LateStage(
                    target_size=0.8 * comera.model_size(model), steps=3))
        m1.eval(), m2.eval()  # no dropout: the two runs draw different masks
        eager.append(t1.step(_pair_loss(m1, *batch)).loss)
        captured.append(float(step(*batch)))
    assert captured == pytest.approx(eager, rel=1e-3)
    assert step.captures == 2


def _near_tau(min_rank: int, dtype=F64):
    """A trainer whose second layer's gates sit just above tau, with a gate rate that prunes them
    all in one step: only the ``min_rank`` floor keeps entries alive."""
    model, _ = _model(dtype)
    with torch.no_grad():
        for gate in model[2].gates:
            gate.fill_(model[2].tau * 1.001)
    opt = comera.make_optimizer(model, comera.OptimizerConfig(lr_cores=1e-2, lr_gates=1e-2))
    return model, comera.CoMERATrainer(model, opt, lam=10.0, min_rank=min_rank)


def test_the_min_rank_floor_holds_between_captured_steps_as_in_the_trainer():
    """The floor runs between captured steps through the controller's public hold_floor_."""
    x, y = _data(F64)
    (m1, t1), (m2, t2) = _near_tau(2), _near_tau(2)
    step = CapturedStep(t2, _loss, mode="eager")
    for _ in range(2):
        t1.step(_loss(m1, x, y))
        step(x, y)
    assert [list(m.ranks) for _, m in comera.gated_layers(m2)] == [
        list(m.ranks) for _, m in comera.gated_layers(m1)]
    assert min(m2[2].ranks[1:-1]) == 2  # held at the floor, not pruned to nothing
    for p, q in zip(m1.parameters(), m2.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-10, atol=1e-12)
    bare, trainer = _near_tau(0)  # without a floor the same step prunes the bonds away
    CapturedStep(trainer, _loss, mode="eager")(x, y)
    assert min(bare[2].ranks[1:-1]) < 2


def test_hold_floor_refuses_a_snapshot_of_other_gates():
    model, trainer = _model()
    with pytest.raises(ConfigError, match="gate snapshots"):
        trainer.controller.hold_floor_([g.detach().clone() for g in model[0].gates])
