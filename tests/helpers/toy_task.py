"""A small, fast Task for engine tests: regression onto a planted low-rank teacher.

The model is TTLinear(32, 32) -> tanh -> Linear(32, 4) (or the dense equivalent). Example
indices listed in ``poison`` have a NaN target, to exercise the non-finite policies.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

import comera
from comera.experiments.task import Task, model_format


class ToyTask(Task):
    name = "toy"
    metric = "loss"
    higher_is_better = False

    def __init__(self, n: int = 256, seed: int = 0, poison: tuple[int, ...] = (),
                 dropout: float = 0.0, delay: float = 0.0):
        gen = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, 32, generator=gen, dtype=torch.float64)  # (n, 32)
        teacher = torch.randn(32, 3, generator=gen, dtype=torch.float64) @ torch.randn(
            3, 4, generator=gen, dtype=torch.float64)  # (32, 4), rank 3
        self.y = torch.tanh(self.x) @ teacher  # (n, 4)
        for i in poison:
            self.y[i] = float("nan")
        self.dropout = dropout
        self.delay = delay
        self.val = slice(0, 64)

    def build_model(self, format: str = "tt") -> nn.Module:
        format = model_format(format)
        if format == "tt":
            first = comera.TTLinear(32, 32, (4, 8), (8, 4), 6, dtype=torch.float64)
        elif format == "dense":
            first = nn.Linear(32, 32, dtype=torch.float64)
        else:
            first = comera.GatedLinear(32, 32, format, 6, d=2, dtype=torch.float64)
        return nn.Sequential(first, nn.Tanh(), nn.Dropout(self.dropout),
                             nn.Linear(32, 4, dtype=torch.float64))

    def train_size(self) -> int:
        return self.x.shape[0]

    def batch(self, indices: Tensor):
        if self.delay:
            import time

            time.sleep(self.delay)
        return self.x[indices], self.y[indices]

    def loss(self, model: nn.Module, batch) -> Tensor:
        x, y = batch
        return nn.functional.mse_loss(model(x), y)

    def evaluate(self, model: nn.Module, split: str) -> dict[str, float]:
        part = self.val if split == "val" else slice(64, 128)
        loss = nn.functional.mse_loss(model(self.x[part]), self.y[part])
        return {"loss": float(loss), "rmse": float(loss) ** 0.5}
