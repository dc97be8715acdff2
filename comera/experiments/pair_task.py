"""Train the pair classifier dense and with CoMERA side by side on the stdlib pair task.

Per model: time per training step, validation accuracy during training, test accuracy at the
end, compression of the linear layers and the ranks per layer over time. CoMERA runs the early
stage (loss + lam * R), truncates, then the late stage toward a target compression.
"""

from __future__ import annotations

import json
import logging
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch import nn

import comera
from comera.data import load_stdlib_pairs
from comera.models import PairClassifier, TransformerConfig

log = logging.getLogger("comera.experiments")


@dataclass(frozen=True)
class PairTaskConfig:
    quick: bool = True
    steps_early: int = 300
    steps_late: int = 150
    batch_size: int = 32
    max_len: int = 64
    vocab_size: int = 8000
    limit: int | None = 2000
    target_compression: float = 2.0  # late stage: shrink the TT linear layers by this factor
    lam: float = 0.05
    lr: float = 1e-3
    lr_gates: float = 1e-2
    eval_every: int = 50
    seed: int = 0
    stage: str = "both"  # early | late | both

    @classmethod
    def full(cls) -> PairTaskConfig:
        return cls(quick=False, steps_early=3000, steps_late=1500, max_len=128, limit=None)


@dataclass
class RunResult:
    name: str
    step_ms: float = 0.0
    val_curve: list = field(default_factory=list)  # (step, accuracy, loss)
    ranks: dict = field(default_factory=dict)  # layer -> list of (step, ranks)
    test_accuracy: float = 0.0
    linear_params: int = 0
    linear_dense_params: int = 0
    model_params: int = 0

    @property
    def linear_compression(self) -> float:
        return self.linear_dense_params / max(self.linear_params, 1)


def evaluate(model: nn.Module, data, batch_size: int = 128) -> tuple[float, float]:
    model.eval()
    correct, total, loss_sum = 0, 0, 0.0
    with torch.no_grad():
        for ids, seg, labels in data.batches(batch_size, shuffle=False):
            logits = model(ids, seg)
            loss_sum += float(nn.functional.cross_entropy(logits, labels, reduction="sum"))
            correct += int((logits.argmax(1) == labels).sum())
            total += labels.numel()
    model.train()
    return correct / max(total, 1), loss_sum / max(total, 1)


def _batches(data, batch_size: int, seed: int):
    epoch = 0
    while True:
        yield from data.batches(batch_size, shuffle=True, seed=seed + epoch)
        epoch += 1


def _model_config(cfg: PairTaskConfig, vocab: int, tt: bool) -> TransformerConfig:
    return TransformerConfig.small(vocab, max_len=cfg.max_len, n_classes=2, tt=tt,
                                   tt_embedding=tt)


def train_one(name: str, model: nn.Module, cfg: PairTaskConfig, train, val, progress=None
              ) -> RunResult:
    """Train ``model`` (dense, or with CoMERA when it has TT layers); record the run."""
    result = RunResult(name)
    is_tt = any(True for _ in comera.tt_modules(model))
    stream = _batches(train, cfg.batch_size, cfg.seed)
    times = []
    if is_tt:
        opt = comera.make_optimizer(model, comera.OptimizerConfig(cfg.lr, cfg.lr_gates, cfg.lr))
        trainer = comera.CoMERATrainer(model, opt, lam=cfg.lam if cfg.stage != "late" else 0.0)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.0)
    stages = [("early", cfg.steps_early)] + ([("late", cfg.steps_late)]
                                              if is_tt and cfg.stage != "early" else [])
    if not is_tt:
        stages = [("dense", cfg.steps_early + cfg.steps_late)]
    step = 0
    for stage, n_steps in stages:
        if stage == "late":
            target = comera.LateStage.from_ratio(model, cfg.target_compression,
                                                 target_loss=0.0)
            trainer.start_late_stage(target)
        for _ in range(n_steps):
            ids, seg, labels = next(stream)
            start = time.perf_counter()
            loss = nn.functional.cross_entropy(model(ids, seg), labels)
            if is_tt:
                trainer.step(loss)
            else:
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
            times.append(time.perf_counter() - start)
            step += 1
            if step % cfg.eval_every == 0 or step == 1:
                acc, vloss = evaluate(model, val)
                result.val_curve.append((step, acc, vloss))
                for lname, layer in comera.tt_modules(model):
                    result.ranks.setdefault(lname, []).append((step, list(layer.ranks)))
                if progress:
                    progress(name, stage, step, float(loss), acc)
    result.step_ms = statistics.median(times) * 1e3
    only = comera.TTLinear if is_tt else None
    if is_tt:
        result.linear_params = comera.model_size(model, only=only)
        result.linear_dense_params = comera.dense_size(model, only=only)
    else:
        linears = [m for m in model.modules() if isinstance(m, nn.Linear)][:-1]  # not the head
        result.linear_params = result.linear_dense_params = sum(
            sum(p.numel() for p in m.parameters()) for m in linears)
    result.model_params = comera.model_size(model)
    return result


def run(cfg: PairTaskConfig, out: Path, progress=None) -> dict:
    """Dense and CoMERA on the same data; returns and writes the summary."""
    torch.manual_seed(cfg.seed)
    train, val, test, tok = load_stdlib_pairs(cfg.max_len, cfg.vocab_size, cfg.limit, cfg.seed)
    results = []
    for name, tt in (("dense", False), ("comera", True)):
        torch.manual_seed(cfg.seed)
        model = PairClassifier(_model_config(cfg, len(tok.vocab), tt))
        r = train_one(name, model, cfg, train, val, progress)
        r.test_accuracy = evaluate(model, test)[0]
        results.append(r)
    summary = {"config": asdict(cfg), "data": {"train": len(train), "val": len(val),
                                               "test": len(test), "vocab": len(tok.vocab)},
               "runs": [{**asdict(r), "linear_compression": r.linear_compression}
                        for r in results]}
    out.mkdir(parents=True, exist_ok=True)
    (out / "pair_task.json").write_text(json.dumps(summary, indent=2))
    (out / "pair_task.md").write_text(summary_table(summary) + "\n")
    return summary


def summary_table(summary: dict) -> str:
    runs = {r["name"]: r for r in summary["runs"]}
    dense = runs.get("dense")
    lines = ["| model | ms/step | speedup | test acc | linear params | linear compression |"
             " model params |", "|---|---|---|---|---|---|---|"]
    for r in summary["runs"]:
        speed = dense["step_ms"] / r["step_ms"] if dense else 1.0
        lines.append(f"| {r['name']} | {r['step_ms']:.1f} | {speed:.2f}x | "
                     f"{r['test_accuracy']:.3f} | {r['linear_params']:,} | "
                     f"{r['linear_compression']:.1f}x | {r['model_params']:,} |")
    return "\n".join(lines)
