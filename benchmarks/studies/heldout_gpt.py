r"""A held-out check of the balanced parametrization (issue 30): a small GPT the project's
defaults were never tuned on, on text the project never reads, converted and trained the way a
new user would.

    python -m benchmarks.studies.heldout_gpt --lrs 1e-3 3e-3 1e-2 3e-2 --steps 600

Data: the reStructuredText of CMake's help (``<cmake>/Help/**/*.rst``, installed with cmake),
read as bytes (vocabulary 256), split by file (a hash of the file's path, 90 / 10). Model: a
nanoGPT-style decoder written here (fused q/k/v projection with biases, GELU MLP, learned
positions, tied head, normal(0, 0.02) initialisation, the residual projections scaled by
1 / sqrt(2 n_layer)), not comera's CausalLM. Methods, each at its best learning rate of
``--lrs`` (chosen on the validation split) and trained with plain ``torch.optim.AdamW`` over
``model.parameters()`` on the engine (warm-up, then cosine):

- ``dense``: the model as built;
- ``narrow``: a dense model of smaller width with at most the parameter count of the converted
  ones;
- ``<format>:<parametrization>``: the dense model, then ``comera.convert_(model,
  ConvertConfig(format=..., target_compression=--target, parametrization=...))`` of every
  linear layer (the user's recipe: decompose the freshly initialised weights, then train);
- ``<format>:fresh``: the same conversion (balanced), then every converted layer's cores drawn
  anew (``reset_cores_``), as a layer built at that rank starts: it separates what the
  decomposition of random weights does to training from what the parametrization does.

Writes ``benchmarks/results/heldout_gpt/heldout.{json,md}`` (the rows without their curves; the
whole payload to the git-ignored ``curves/heldout.json``).
"""

from __future__ import annotations

import argparse
import hashlib
import math
import shutil
import statistics
import sys
from pathlib import Path

import torch
from torch import Tensor, nn

import comera
from benchmarks.lib.measure import RESULTS
from benchmarks.studies.harness.results import mean_sd, write_summary
from benchmarks.studies.harness.runs import row, train
from comera.errors import ConfigError, TrainingStopped
from comera.experiments.engine import EngineConfig
from comera.experiments.results import machine
from comera.experiments.task import Task
from tncomp.files import atomic_write_text


# -- data ----------------------------------------------------------------------------------------
def cmake_help() -> Path:
    """The folder of CMake's reStructuredText help, else a ConfigError naming what to install."""
    cmake = shutil.which("cmake")
    roots = sorted(Path("/usr/share").glob("cmake*/Help"))
    if cmake is not None:
        roots += sorted((Path(cmake).resolve().parent.parent / "share").glob("cmake*/Help"))
    for root in roots:
        if any(root.rglob("*.rst")):
            return root
    raise ConfigError("no CMake help (<prefix>/share/cmake-*/Help/*.rst) on this machine; "
                      "install cmake (apt-get install cmake) or pass --root DIR of .rst files.")


def byte_splits(root: Path, block: int) -> dict[str, Tensor]:
    """Rows of ``block + 1`` bytes per split (train: 90% of the files by a hash of their
    path, val: the rest)."""
    parts: dict[str, list[bytes]] = {"train": [], "val": []}
    for path in sorted(root.rglob("*.rst")):
        digest = hashlib.sha256(str(path.relative_to(root)).encode()).digest()[0]
        parts["val" if digest < 26 else "train"].append(path.read_bytes())
    out = {}
    for split, texts in parts.items():
        data = torch.frombuffer(bytearray(b"\n".join(texts)), dtype=torch.uint8).long()
        rows = data.numel() // (block + 1)
        if rows < 2:
            raise ConfigError(f"{root}: the {split} split has {data.numel()} bytes, fewer than "
                              f"two rows of {block + 1}; give more text.")
        out[split] = data[:rows * (block + 1)].view(rows, block + 1)
    return out


# -- the model -----------------------------------------------------------------------------------
class Block(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln_1, self.ln_2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.c_attn = nn.Linear(d, 3 * d)
        self.attn_proj = nn.Linear(d, d)
        self.c_fc = nn.Linear(d, 4 * d)
        self.mlp_proj = nn.Linear(4 * d, d)

    def forward(self, x: Tensor) -> Tensor:
        b, t, d = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).split(d, dim=2)  # (b, t, d) each
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        y = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)  # (b, h, t, d/h)
        x = x + self.attn_proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp_proj(nn.functional.gelu(self.c_fc(self.ln_2(x))))


class TinyGPT(nn.Module):
    """nanoGPT's shape at a small size: bytes in, next-byte logits out."""

    def __init__(self, d: int = 128, layers: int = 4, heads: int = 4, block: int = 128):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(256, d), nn.Embedding(block, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        for name, p in self.named_parameters():
            if p.dim() == 2:
                std = 0.02 / math.sqrt(2 * layers) if name.endswith("proj.weight") else 0.02
                nn.init.normal_(p, 0.0, std)
            elif name.endswith(".bias") and "ln" not in name:
                nn.init.zeros_(p)

    def forward(self, ids: Tensor) -> Tensor:
        x = self.wte(ids) + self.wpe(torch.arange(ids.shape[1], device=ids.device))
        for block in self.blocks:
            x = block(x)
        return self.ln_f(x) @ self.wte.weight.T  # (b, t, 256)


class ByteTask(Task):
    """Next-byte prediction on CMake's help; metric: validation loss (nats per byte)."""

    name = "bytes"
    metric = "loss"
    higher_is_better = False

    def __init__(self, root: Path, block: int, d: int, layers: int, heads: int):
        self.splits = byte_splits(root, block)
        self.sizes = {"d": d, "layers": layers, "heads": heads, "block": block}

    def build_model(self, format: str = "dense") -> nn.Module:
        return TinyGPT(**self.sizes)

    def train_size(self) -> int:
        return self.splits["train"].shape[0]

    def batch(self, indices: Tensor) -> Tensor:
        return self.splits["train"][indices]

    def loss(self, model: nn.Module, batch: Tensor) -> Tensor:
        logits = model(batch[:, :-1])  # (b, block, 256)
        return nn.functional.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())

    @torch.no_grad()
    def evaluate(self, model: nn.Module, split: str) -> dict[str, float]:
        rows = self.splits["val"][:256]  # test: the same held-out files
        losses = [float(self.loss(model, rows[i:i + 64])) for i in range(0, len(rows), 64)]
        loss = statistics.fmean(losses)
        return {"loss": loss, "bits_per_byte": loss / math.log(2)}

    def block_linears(self, model: nn.Module) -> list[tuple[str, nn.Module]]:
        return [(n, m) for n, m in model.named_modules() if n.startswith("blocks.")
                and isinstance(m, nn.Linear | comera.GatedLayer)]


def narrow_width(task: ByteTask, budget: int) -> int:
    """The largest width (a multiple of the heads) whose dense model has at most ``budget``
    parameters."""
    heads = task.sizes["heads"]
    best = 0
    for d in range(heads, task.sizes["d"] + 1, heads):
        model = TinyGPT(d, task.sizes["layers"], heads, task.sizes["block"])
        if sum(p.numel() for p in model.parameters()) <= budget:
            best = d
    if best == 0:
        raise ConfigError(f"no dense width fits {budget} parameters")
    return best


FRESH = "fresh"  # the method suffix of converted layers whose cores are drawn anew


def converted(task: ByteTask, fmt: str, parametrization: str, target: float) -> nn.Module:
    """The dense model with its block layers converted; ``parametrization="fresh"``: balanced,
    then the cores drawn anew."""
    model = TinyGPT(**task.sizes)
    fresh = parametrization == FRESH
    comera.convert_(model, comera.ConvertConfig(
        include=["blocks.*"], format=fmt, target_compression=target,
        parametrization="balanced" if fresh else parametrization))
    if fresh:
        for _, layer in comera.gated_layers(model):
            layer.reset_cores_()
    return model


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--root", type=Path, default=None, help="a folder of .rst files")
    p.add_argument("--methods", nargs="+",
                   default=["dense", "narrow", "tt:plain", "tt:balanced", "lowrank:plain",
                            "lowrank:balanced"])
    p.add_argument("--lrs", type=float, nargs="+", default=[1e-3, 3e-3, 1e-2, 3e-2])
    p.add_argument("--seeds", type=int, nargs="+", default=[0])
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--warmup", type=int, default=60)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--target", type=float, default=8.0)
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--block", type=int, default=128)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", type=Path, default=RESULTS / "heldout_gpt")
    p.add_argument("--work", type=Path, default=Path("/tmp/heldout_gpt_work"))
    args = p.parse_args(argv)
    for method in args.methods:
        if method not in ("dense", "narrow"):
            fmt, _, par = method.partition(":")
            comera.ConvertConfig(format=fmt, parametrization="balanced" if par in (FRESH, "")
                                 else par)  # checked
    torch.set_num_threads(args.threads)
    task = ByteTask(args.root or cmake_help(), args.block, args.d_model, args.layers, 4)
    probe = converted(task, "tt", "balanced", args.target)
    budget = sum(p.numel() for p in probe.parameters())
    width = narrow_width(task, budget)
    rows = []
    for seed in args.seeds:
        for lr in args.lrs:
            config = EngineConfig(batch_size=args.batch, lr=lr, warmup=args.warmup,
                                  eval_every=100, max_grad_norm=1.0, threads=args.threads,
                                  optimizer="adamw", schedule="cosine", seed=seed,
                                  stage="early", steps_early=args.steps, steps_late=0, lam=0.0)
            for method in args.methods:
                if method == "dense":
                    build = lambda: TinyGPT(**task.sizes)  # noqa: E731
                elif method == "narrow":
                    build = lambda: TinyGPT(width, args.layers, 4, args.block)  # noqa: E731
                else:
                    fmt, _, par = method.partition(":")
                    build = lambda f=fmt, q=par or "balanced": converted(  # noqa: E731
                        task, f, q, args.target)
                try:
                    model, record = train(task, f"{method}-s{seed}-lr{lr:g}", "dense", config,
                                          args.work, build)
                except TrainingStopped as exc:  # a rate too high for the method: worst of all
                    rows.append({"seed": seed, "method": method, "lr": lr, "diverged": str(exc)})
                    print(f"seed {seed} lr {lr:g} {method}: diverged", flush=True)
                    continue
                params = sum(p.numel() for p in model.parameters())
                rows.append(row(task, model, record, seed=seed, method=method, lr=lr,
                                params=params))
                print(f"seed {seed} lr {lr:g} {method}: val {rows[-1]['val']['loss']:.4f} "
                      f"({params} parameters)", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    command = "python -m benchmarks.studies.heldout_gpt " + " ".join(
        sys.argv[1:] if argv is None else argv)
    payload = {"command": command, "machine": machine(), "narrow_width": width, "rows": rows}
    write_summary(args.out / "heldout.json", payload)  # the curves to curves/heldout.json
    atomic_write_text(args.out / "heldout.md", report(payload, args) + "\n")
    print(report(payload, args))
    return 0


def report(payload: dict, args) -> str:
    rows = payload["rows"]
    lines = [f"# Held-out GPT: byte-level CMake help, {args.steps} steps, plain AdamW",
             "", f"Each method at the learning rate of its best mean validation loss of "
             f"{', '.join(f'{x:g}' for x in args.lrs)}; the converted models at "
             f"target_compression={args.target:g} of the block linear layers; narrow: "
             f"d_model {payload['narrow_width']}.", "",
             "| method | parameters | best lr | val loss (mean ± sd over seeds) | per lr |",
             "|---|---|---|---|---|"]
    for method in dict.fromkeys(r["method"] for r in rows):
        mine = [r for r in rows if r["method"] == method]
        by_lr = {}
        for r in mine:  # a diverged run counts as the worst loss
            by_lr.setdefault(r["lr"], []).append(math.inf if "diverged" in r
                                                 else r["val"]["loss"])
        trained = [r for r in mine if "diverged" not in r]
        best = min(by_lr, key=lambda lr: statistics.fmean(by_lr[lr]))
        edge = " (grid edge)" if best in (min(by_lr), max(by_lr)) else ""
        per = ", ".join(f"{lr:g}: " + ("diverged" if math.inf in v else
                                       f"{statistics.fmean(v):.3f}")
                        for lr, v in sorted(by_lr.items()))
        params = trained[0]["params"] if trained else "-"
        lines.append(f"| {method} | {params} | {best:g}{edge} | "
                     f"{mean_sd(by_lr[best], 3)} | {per} |")
    lines += ["", f"Machine: {payload['machine']['cpu']}, torch {payload['machine']['torch']};"
              f" command:", "", f"    {payload['command']}"]
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
