r"""Compress HuggingFace GPT-2 models with calibration (issue 31): the dict-input path end to end,
and a 124M-parameter GPT-2-sized config converted in bounded memory.

    python -m benchmarks.studies.compress_hf small --seeds 0 1 2
    python -m benchmarks.studies.compress_hf 124m --batches 4
    python -m benchmarks.studies.compress_hf 124m --batches 16
    python -m benchmarks.studies.compress_hf floor --targets 2 3 4 --formats tt lowrank
    python -m benchmarks.studies.compress_hf floor --targets 2 3 4 8 --formats lowrank tt ttm \
        --arms uniform/plain uniform/calibrated global/calibrated \
        global/calibrated+measured sensitivity/calibrated --name hf_sensitivity
    python -m benchmarks.studies.compress_hf finetune --format tt --target 4 --seeds 0 1 2
    python -m benchmarks.studies.compress_hf finetune --format tt --target 4 --seeds 0 1 2 \
        --lrs 1e-4 3e-4 1e-3 3e-3 --extend

``small``: a GPT-2 built from a config (d 128, 2 layers, 4 heads, the quick LM task's vocabulary
and 64 tokens; random init, nothing downloaded), trained dense in-process through the engine on
the LM task's rows, then its ``transformer.h.*`` layers (HuggingFace ``Conv1D``) converted at 2x,
``uniform/plain`` against ``global/calibrated``, in tt and lowrank, with calibration batches of
``{"input_ids", "attention_mask"}`` dicts (``model(**batch)``); validation perplexity of each.

``124m``: ``GPT2LMHeadModel(GPT2Config())`` (124M parameters, random init: the point is
memory), calibrated on ``--batches`` batches of random token ids and converted to TT at 2x with
a global budget. The peak RSS of the process (``getrusage``), the statistics' bytes and the
time of each phase go to ``gpt2_124m_<batches>.json``: the same peak for 4 and 16 batches shows
memory independent of the number of batches.

``floor`` (issue 41): the same small GPT-2 (trained once, kept under ``--cache``), at each
``--targets`` ratio and format, perplexity before fine-tuning of the arms of :data:`FLOOR_ARMS`:
``uniform/plain``, ``uniform/calibrated``, ``global/calibrated`` (the estimate floor),
``global/calibrated+measured`` (``floor="measured"``: the model's own loss, HuggingFace's
``.loss`` from ``labels`` in the calibration batches, measured on those batches) and
``+refit`` (with ``closed_form_refit``), and ``sensitivity/calibrated``
(``allocation="sensitivity"``: each layer's ranks from the model's loss with that layer alone
decomposed at candidate ranks, then the measured floor against uniform; the same batches and
``.loss``). Per ``--seeds`` calibration seed; rows to ``<name>.json`` and the table (mean ± sd
over seeds) to ``<name>.md``.

``finetune`` (issue 41): each arm of :data:`FINETUNE_ARMS` converted at each
``--parametrizations`` and fine-tuned at each rate of ``--lrs`` per seed, the table bolding each
arm's best cell and flagging a best at the grid's edge; ``--extend`` adds rates, seeds, arms or
parametrizations to an existing ``<name>.json`` of the same settings, measuring only what is
missing. Two controls: ``dense`` (the trained model fine-tuned as long) and ``narrow`` (a
narrower model of the same family at the uniform/plain conversion's size, all parameters
counted, trained from scratch for ``--steps`` + ``--ft-steps`` at each rate).

``--model llama`` (``floor``, ``finetune``, ``small``): the same study on a Llama built from a
config (:data:`MODELS`: hidden 128, 2 layers, 4 heads and 4 key-value heads, SwiGLU width 512,
untied embeddings; random init, nothing downloaded), its ``model.layers.*`` linears converted,
kept under its own cache file and written under ``hf_llama_*`` names by default:

    python -m benchmarks.studies.compress_hf floor --model llama --targets 2 4 8 --formats tt \
        --arms uniform/plain uniform/calibrated global/calibrated sensitivity/calibrated \
        --seeds 0 1 2 --name hf_llama_sensitivity
"""

from __future__ import annotations

import argparse
import copy
import itertools
import json
import shlex
import sys
import tempfile
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor, nn

import comera
from benchmarks.lib.measure import timed
from benchmarks.studies.harness.trained import (
    CALIB_BATCH,
    CONVERTIBLE,
    OUT,
    ForEngine,
    Grid,
    best_cell,
    calibration_rows,
    compression_target,
    engine_run,
    grid_table,
    linear_sizes,
    make_task,
    peak_rss_mib,
    score,
)
from comera.experiments.engine import EngineConfig, train_model
from comera.experiments.results import machine
from comera.formats.scaling import DECOMPOSED, PARAMETRIZATIONS
from comera.surgery.convert import ConversionReport
from comera.surgery.input_statistics import gram_bytes


class Logits(nn.Module):
    """A HuggingFace causal LM as the LM task calls a model: token ids in, logits out."""

    def __init__(self, hf: nn.Module):
        super().__init__()
        self.hf = hf

    def forward(self, ids: Tensor) -> Tensor:
        return self.hf(input_ids=ids).logits


def small_gpt2(vocab: int, seq_len: int, width: int = 128) -> Logits:
    """A GPT-2 of d ``width`` (128), 2 layers, 4 heads, MLP width 4 x ``width``, ``vocab``
    tokens and ``seq_len`` positions (random init; its linears are HuggingFace ``Conv1D``)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=vocab, n_positions=seq_len, n_embd=width, n_layer=2,
                        n_head=4, n_inner=4 * width, bos_token_id=0, eos_token_id=0)
    return Logits(GPT2LMHeadModel(config))


def small_llama(vocab: int, seq_len: int, width: int = 128) -> Logits:
    """A Llama of hidden ``width`` (128), 2 layers, 4 heads and 4 key-value heads, ``vocab``
    tokens and ``seq_len`` positions, untied embeddings (random init; its linears are
    ``nn.Linear``). The SwiGLU width is 4 x ``width``, the GPT-2's MLP width: Llama's usual 8/3
    x 128 = 344 = 8 x 43 has no balanced three-mode factorization, so TT refuses it."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=vocab, max_position_embeddings=seq_len, hidden_size=width,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                         intermediate_size=4 * width, tie_word_embeddings=False, bos_token_id=0,
                         eos_token_id=0)
    return Logits(LlamaForCausalLM(config))


@dataclass(frozen=True, slots=True)
class HFModel:
    """One model the study builds from a config: its builder ``(vocab, seq_len, width=128) ->
    Logits``, the
    ``include`` pattern of the layers it converts, its cache file stem, its results' name prefix
    and how the tables name it."""

    build: Callable[..., Logits]
    include: str
    stem: str
    prefix: str
    title: str


#: The models of ``--model``: one code path, a row each.
MODELS = {
    "gpt2": HFModel(small_gpt2, "transformer.h.*", "gpt2-small", "hf", "small GPT-2"),
    "llama": HFModel(small_llama, "model.layers.*", "llama-small", "hf_llama", "small Llama"),
}


def _name(args, what: str) -> str:
    """The results' file name: ``--name`` or the model's prefix and ``what``."""
    return args.name or f"{MODELS[args.model].prefix}_{what}"


def dict_batches(task, indices: Tensor) -> list[dict[str, Tensor]]:
    """Calibration batches as a tokenizer returns them: ``input_ids`` and ``attention_mask``."""
    rows = task.train.ids[indices][:, :-1]
    return [{"input_ids": chunk, "attention_mask": torch.ones_like(chunk)}
            for chunk in rows.split(CALIB_BATCH)]


def cmd_small(args) -> int:
    task = make_task("lm", args.smoke, args.root)
    spec = MODELS[args.model]
    torch.manual_seed(0)
    model = spec.build(task.vocab, task.config.seq_len)
    config = EngineConfig(steps_early=args.steps, steps_late=0, stage="early", batch_size=32,
                          lr=1e-3, warmup=50, eval_every=args.steps, seed=0, threads=1,
                          format="dense")
    with tempfile.TemporaryDirectory() as out:
        (trained, _), seconds, _ = timed(
            lambda: train_model(ForEngine(task, model), "dense", config, Path(out)))
    trained.eval()
    result = {"machine": machine(), "command": _command(args), "train_seconds":
              round(seconds, 1), "dense": score(task, trained), "rows": []}
    for fmt in args.formats:
        budget = None
        for arm, seed in [("uniform/plain", args.seeds[0])] + [
                ("global/calibrated", seed) for seed in args.seeds]:
            batches = (dict_batches(task, calibration_rows(task, seed, args.calib_rows))
                       if arm.endswith("calibrated") else None)
            options = ({"target_compression": 2.0} if budget is None
                       else {"allocation": "global", "target_size": budget})
            m = copy.deepcopy(trained)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # HF's save_pretrained warning
                report = comera.convert_(m.hf, comera.ConvertConfig(
                    include=[spec.include], format=fmt, **options), calibration=batches)
            if budget is None:  # the global arm spends what the uniform arm holds
                budget = sum(layer.layout.parameters_at(layer.bond_sizes)
                             for _, layer in comera.gated_layers(m))
            params, dense = linear_sizes(m)
            row = {"format": fmt, "arm": arm, "seed": seed, "compression": dense / params,
                   "batches": report.batches, "val": score(task, m),
                   "ranks": {n: list(layer.ranks) for n, layer in comera.gated_layers(m)}}
            result["rows"].append(row)
            print(f"{fmt} {arm} seed {seed}: {row['compression']:.2f}x, val ppl "
                  f"{row['val']['perplexity']:.2f}", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{spec.prefix}_small.json").write_text(json.dumps(result, indent=1, default=str))
    return 0


FLOOR_ARMS = ("uniform/plain", "uniform/calibrated", "global/calibrated",
              "global/calibrated+measured", "global/calibrated+measured+refit",
              "sensitivity/calibrated")


#: The rate the small models are pretrained at (``trained_hf``).
PRETRAIN_LR = 1e-3


def trained_hf(task, steps: int, cache: Path | None, smoke: bool,
               model: str = "gpt2") -> tuple[Logits, float]:
    """The small ``model`` of :data:`MODELS` trained ``steps`` dense steps on the LM task at
    :data:`PRETRAIN_LR` (from ``cache`` when it holds it: trained once), and the seconds its
    training took."""
    spec = MODELS[model]
    path = (None if cache is None else
            cache / f"{spec.stem}-{steps}{'-smoke' if smoke else ''}.pt")
    if path is not None and path.is_file():
        saved = torch.load(path, weights_only=False)
        return saved["model"], saved["seconds"]
    torch.manual_seed(0)
    model = spec.build(task.vocab, task.config.seq_len)
    config = EngineConfig(steps_early=steps, steps_late=0, stage="early", batch_size=32,
                          lr=PRETRAIN_LR, warmup=50, eval_every=steps, seed=0, threads=1,
                          format="dense")
    with tempfile.TemporaryDirectory() as out:
        (trained, _), seconds, _ = timed(
            lambda: train_model(ForEngine(task, model), "dense", config, Path(out)))
    trained.eval()
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save({"model": trained, "seconds": seconds}, path)
    return trained, seconds


def trained_gpt2(task, steps: int, cache: Path | None, smoke: bool) -> tuple[Logits, float]:
    """The small GPT-2 trained (:func:`trained_hf` with ``model="gpt2"``)."""
    return trained_hf(task, steps, cache, smoke, "gpt2")


def floor_arm(trained: Logits, fmt: str, target: float, arm: str,
              batches: list[dict[str, Tensor]], parametrization: str = DECOMPOSED,
              include: str = MODELS["gpt2"].include) -> tuple[Logits, ConversionReport]:
    """A copy of ``trained`` with its ``include`` layers (default: the GPT-2's
    ``transformer.h.*``) converted as ``arm`` says, the layers at ``parametrization``
    (``convert_``'s default: plain)."""
    allocation, how = arm.split("+")[0].split("/")
    options = {"allocation": allocation, "format": fmt, "target_compression": target,
               "parametrization": parametrization}
    if "+measured" in arm:
        options["floor"] = "measured"
    if arm.endswith("+refit"):
        options["closed_form_refit"] = True
    model = copy.deepcopy(trained)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # HF's save_pretrained warning
        report = comera.convert_(model.hf, comera.ConvertConfig(include=[include], **options),
                                 calibration=batches if how == "calibrated" else None)
    return model.eval(), report


def cmd_floor(args) -> int:
    task = make_task("lm", args.smoke, args.root)
    spec, name = MODELS[args.model], _name(args, "floor")
    trained, seconds = trained_hf(task, args.steps, args.cache, args.smoke, args.model)
    result = {"machine": machine(), "command": _command(args), "model": args.model,
              "train_seconds": round(seconds, 1), "dense": score(task, trained), "rows": []}
    print(f"dense: val ppl {result['dense']['perplexity']:.2f}", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    for seed, fmt, target, arm in itertools.product(args.seeds, args.formats, args.targets,
                                                    args.arms):
        if arm == "uniform/plain" and seed != args.seeds[0]:
            continue  # no calibration: the same model whatever the seed
        batches = [{**b, "labels": b["input_ids"]}  # labels: the model's .loss is measured
                   for b in dict_batches(task, calibration_rows(task, seed, args.calib_rows))]
        (model, report), took, _ = timed(
            lambda arm=arm, fmt=fmt, target=target, batches=batches: floor_arm(
                trained, fmt, target, arm, batches, include=spec.include))
        params, dense = linear_sizes(model)
        row = {"format": fmt, "target": target, "arm": arm, "seed": seed,
               "compression": dense / params, "kept": report.kept,
               "losses": dict(report.losses), "val": score(task, model),
               "seconds": round(took, 1),
               "ranks": {n: list(layer.ranks) for n, layer in comera.gated_layers(model)}}
        result["rows"].append(row)
        print(f"seed {seed} {fmt} {target:g}x {arm}: {row['compression']:.2f}x, val ppl "
              f"{row['val']['perplexity']:.2f} kept {report.kept or '-'} "
              f"{row['losses'] or ''} ({took:.0f}s)", flush=True)
        (args.out / f"{name}.json").write_text(  # after each row: a stopped run keeps it
            json.dumps(result, indent=1, default=str))
    table = floor_table(result)
    (args.out / f"{name}.md").write_text(
        f"Validation perplexity of the {spec.title} before fine-tuning (mean ± sd over "
        f"calibration seeds {', '.join(map(str, args.seeds))}; in brackets: the ranks the "
        f"measured floor kept)."
        f"\n\n{table}\n\n    {result['command']}\n")
    print(table)
    return 0


def floor_table(result: dict) -> str:
    """Validation perplexity per format and target (rows) and arm (columns): the mean over the
    seeds measured, ± their sd where there are several, and which ranks a measured floor kept
    (each seed's, where they differ)."""
    arms = list(dict.fromkeys(r["arm"] for r in result["rows"]))
    cells: dict[tuple, dict[str, list]] = {}
    for r in result["rows"]:
        cells.setdefault((r["format"], r["target"]), {}).setdefault(r["arm"], []).append(r)
    lines = ["| format | target | " + " | ".join(arms) + " |", "|---|---|" + "---|" * len(arms)]
    for (fmt, target), row in sorted(cells.items()):
        shown = []
        for arm in arms:
            rows = row.get(arm, [])
            if not rows:
                shown.append("-")
                continue
            values = [r["val"]["perplexity"] for r in rows]
            mean = sum(values) / len(values)
            sd = (sum((v - mean) ** 2 for v in values) / (len(values) - 1)) ** 0.5 if len(
                values) > 1 else None
            notes = ["/".join(dict.fromkeys(r["kept"] for r in rows))] if rows[0]["losses"] else []
            reached = sum(r["compression"] for r in rows) / len(rows)
            if reached > 1.05 * target:  # a budget left unspent: say how small it came out
                notes.append(f"{reached:.2f}x")
            shown.append(f"{mean:.2f}" + (f" ± {sd:.2f}" if sd is not None else "")
                         + (f" ({', '.join(notes)})" if notes else ""))
        lines.append(f"| {fmt} | {target:g}x | " + " | ".join(shown) + " |")
    lines.append(f"\ndense: {result['dense']['perplexity']:.2f}")
    return "\n".join(lines)


#: What ``finetune`` compares: the trained dense model itself fine-tuned as long (the control:
#: the model is not converged, so part of any arm's gain is more training) and three conversions.
FINETUNE_ARMS = ("dense", "uniform/plain", "uniform/calibrated", "sensitivity/calibrated")

#: The other control: a narrower dense model of the converted model's size
#: (:func:`narrow_width`), trained from scratch for the pretraining and the fine-tune steps
#: together, at the row's rate (warm-up as in pretraining).
NARROW = "narrow"

#: What ``finetune --arms`` accepts: the controls and any arm of :data:`FLOOR_ARMS`
#: (``global/calibrated``, the issue's own target, among them); the default is
#: :data:`FINETUNE_ARMS`.
FINETUNE_CHOICES = ("dense", NARROW, *FLOOR_ARMS)
CONTROLS = ("dense", NARROW)


def narrow_width(spec: HFModel, task, trained: Logits, fmt: str,
                 target: float) -> tuple[int, int]:
    """(width, size): the widest model of ``spec`` (a multiple of 4, its head count) whose
    parameters, all of them, are at most ``size``, those of ``trained`` converted by
    ``uniform/plain`` to ``fmt`` at ``target``: the narrower dense model of the same size."""
    converted, _ = floor_arm(trained, fmt, target, "uniform/plain", [], include=spec.include)
    size = comera.model_size(converted)
    for width in range(128, 3, -4):
        built = spec.build(task.vocab, task.config.seq_len, width)
        if sum(p.numel() for p in built.parameters()) <= size:
            return width, size
    raise SystemExit(f"no {spec.title} of width 4 or more fits {size:,} parameters")


#: The settings a ``finetune`` results file is a function of: ``--extend`` adds to a file only
#: when they match.
FINETUNE_SETTINGS = ("model", "format", "target", "steps", "ft_steps", "calib_rows", "root",
                     "smoke")


def _finetune_settings(args) -> dict:
    return {k: str(v) if isinstance(v, Path) else v
            for k, v in vars(args).items() if k in FINETUNE_SETTINGS}


def _row_key(row: dict) -> tuple:
    """(arm, seed, parametrization, lr) of a fine-tune row; rows written before the
    parametrization was recorded were converted at ``convert_``'s default (plain)."""
    parametrization = (None if row["arm"] in CONTROLS
                       else row.get("parametrization", DECOMPOSED))
    return row["arm"], row["seed"], parametrization, row["lr"]


def _kept_rows(args, path: Path) -> tuple[list[dict], list[str]]:
    """With ``--extend``, the rows and commands of the results file at ``path`` (none if it does
    not exist); refused when it was made with other settings, as adding to it would mix them."""
    if not args.extend or not path.is_file():
        return [], []
    old = json.loads(path.read_text())
    commands = old.get("commands", [old["command"]])
    settings = old.get("settings")
    if settings is None:  # written before settings were recorded: its command says them
        settings = _finetune_settings(parser().parse_args(shlex.split(commands[0])[3:]))
    settings = {"model": "gpt2", **settings}  # written before --model: the GPT-2
    ours = _finetune_settings(args)
    differ = {k: (settings.get(k), v) for k, v in ours.items() if settings.get(k) != v}
    if differ:
        raise SystemExit(f"--extend: {path} was made with other settings (" + ", ".join(
            f"{k}: {a!r} there, {b!r} here" for k, (a, b) in differ.items())
            + "); pass another --name, or the same settings.")
    return old["rows"], commands


def _best_cells(rows: list[dict], arms: list[str], path: Path) -> dict[str, tuple]:
    """Per arm, its best (parametrization, rate) among ``rows`` (judged on the seeds every cell
    holds); a clear error for an arm with none."""
    found = {}
    for arm in arms:
        cells: dict[tuple, list[float]] = {}
        for r in sorted((r for r in rows if r["arm"] == arm), key=lambda r: r["seed"]):
            cells.setdefault(_row_key(r)[2:], []).append(r["after"])
        if not cells:
            raise SystemExit(f"--at-best: {path} holds no {arm} row; screen the grid first "
                             "(--lrs ... --seeds 0), then add seeds with --at-best.")
        found[arm] = best_cell(cells)
    return found


def cmd_finetune(args) -> int:
    """Each arm converted (calibration seed = seed) at each ``--parametrizations``, then
    ``--ft-steps`` of plain AdamW through the engine (lam 0, gates held, warm-up a tenth) at
    every rate of ``--lrs`` with that seed; validation perplexity before and after. Writes
    ``<name>.json`` and ``<name>.md``; with ``--extend``, keeps the rows that file holds and
    measures only the missing ones (a conversion only where one of its rates is missing)."""
    if args.at_best and not args.extend:
        raise SystemExit("--at-best reads the grid of an existing results file: pass --extend "
                         "(and the same --name) too.")
    task = make_task("lm", args.smoke, args.root)
    spec = MODELS[args.model]
    trained, seconds = trained_hf(task, args.steps, args.cache, args.smoke, args.model)
    path = args.out / f"{_name(args, 'finetune')}.json"
    kept, commands = _kept_rows(args, path)
    result = {"machine": machine(), "command": _command(args),
              "commands": [*commands, _command(args)], "settings": _finetune_settings(args),
              "train_seconds": round(seconds, 1), "pretrain_lr": PRETRAIN_LR,
              "dense": score(task, trained), "format": args.format, "target": args.target,
              "rows": kept}
    done = {_row_key(r) for r in kept}
    cells = _best_cells(kept, args.arms, path) if args.at_best else {}
    if kept:
        print(f"extending {path}: {len(kept)} rows kept", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    for seed in args.seeds:
        batches = [{**b, "labels": b["input_ids"]}
                   for b in dict_batches(task, calibration_rows(task, seed, args.calib_rows))]
        for arm in args.arms:
            grid = ([cells[arm]] if args.at_best else
                    [(p, lr) for p in ([None] if arm in CONTROLS else args.parametrizations)
                     for lr in args.lrs])
            for parametrization in dict.fromkeys(p for p, _ in grid):
                lrs = [lr for p, lr in grid if p == parametrization
                       and (arm, seed, parametrization, lr) not in done]
                if not lrs:
                    continue
                size = {}
                if arm == NARROW:  # from scratch: its own initialisation per seed
                    width, budget = narrow_width(spec, task, trained, args.format, args.target)
                    torch.manual_seed(seed)
                    model = spec.build(task.vocab, task.config.seq_len, width)
                    size = {"width": width, "budget": budget,
                            "parameters": sum(p.numel() for p in model.parameters())}
                elif arm == "dense":
                    model = copy.deepcopy(trained)
                else:
                    model = floor_arm(trained, args.format, args.target, arm, batches,
                                      parametrization, spec.include)[0]
                    params, dense = linear_sizes(model)
                    size = {"compression": dense / params,
                            "parameters": comera.model_size(model)}
                before = score(task, model)["perplexity"]
                steps = args.steps + args.ft_steps if arm == NARROW else args.ft_steps
                for lr in lrs:
                    config = EngineConfig(steps_early=steps, steps_late=0,
                                          stage="early", lam=0.0, batch_size=32, lr=lr,
                                          lr_gates=1e-12,
                                          warmup=50 if arm == NARROW else max(1, steps // 10),
                                          eval_every=steps + 1, seed=seed, threads=1,
                                          format="dense" if arm in CONTROLS else args.format)
                    tuned, took, _ = timed(lambda m=model, c=config: engine_run(
                        task, copy.deepcopy(m), c))
                    row = {"arm": arm, "seed": seed, "parametrization": parametrization,
                           "lr": lr, "before": before, "after": score(task, tuned)["perplexity"],
                           **size, "seconds": round(took, 1)}
                    result["rows"].append(row)
                    print(f"seed {seed} {arm} {parametrization or ''} lr {lr:g}: {before:.2f} "
                          f"-> {row['after']:.2f} ({took:.0f}s)", flush=True)
                    path.write_text(json.dumps(result, indent=1, default=str))
    path.write_text(json.dumps(result, indent=1, default=str))
    table = finetune_table(result)
    seeds = sorted({r["seed"] for r in result["rows"]})
    (args.out / f"{_name(args, 'finetune')}.md").write_text(
        f"Validation perplexity of the {spec.title} (dense {result['dense']['perplexity']:.2f}, "
        f"pretrained at lr {PRETRAIN_LR:g}) converted to {args.format} at {args.target:g}x, "
        f"before and after {args.ft_steps} fine-tune steps (mean ± sd over seeds "
        f"{', '.join(map(str, seeds))}; bold: each arm's best rate and parametrization; "
        f"best: that cell's rate as a multiple of the pretraining rate, flagged where it is "
        f"the grid's smallest or largest rate measured for the arm)."
        f"\n\n{table}\n\n{sizes_line(result)}" + "\n".join(f"    {c}" for c in result["commands"])
        + "\n")
    print(table)
    return 0


def sizes_line(result: dict) -> str:
    """The compression each converted arm reached (the layers converted, biases included; mean
    over its rows), a line and a blank one; empty for rows recorded without it."""
    reached: dict[str, list[float]] = {}
    narrow = {}
    for r in result["rows"]:
        if r["arm"] == NARROW:
            narrow = r
        elif r["arm"] != "dense" and "compression" in r:
            reached.setdefault(r["arm"], []).append(r["compression"])
    text = ""
    if reached:
        text += "Compression reached: " + ", ".join(f"{arm} {sum(v) / len(v):.2f}x"
                                                    for arm, v in reached.items()) + ".\n\n"
    if narrow:
        text += (f"{NARROW}: the model at width {narrow['width']}, {narrow['parameters']:,} "
                 f"parameters in all (uniform/plain's conversion: {narrow['budget']:,}), "
                 f"trained from scratch for {result['settings']['steps']} + "
                 f"{result['settings']['ft_steps']} steps (its 'before': at initialisation)."
                 "\n\n")
    return text


def finetune_table(result: dict) -> str:
    """Per arm (and parametrization, where several were measured; rows): perplexity before
    fine-tuning and after it at each rate (columns), the mean over seeds ± their sd, the arm's
    best cell in bold and its rate as a multiple of the pretraining rate
    (:func:`~benchmarks.studies.harness.trained.grid_table`)."""
    arms: dict[str, Grid] = {}
    for r in sorted(result["rows"], key=lambda r: r["seed"]):
        arm, _, parametrization, lr = _row_key(r)
        arms.setdefault(arm, {}).setdefault((parametrization, lr), []).append(
            (r["before"], r["after"]))
    return grid_table(arms, result.get("pretrain_lr", PRETRAIN_LR))


def cmd_124m(args) -> int:
    from transformers import GPT2Config, GPT2LMHeadModel

    phases = {"start": peak_rss_mib()}
    torch.manual_seed(0)
    tiny = {"n_embd": 32, "n_layer": 2, "n_head": 2, "vocab_size": 128} if args.tiny else {}
    model = GPT2LMHeadModel(GPT2Config(**tiny)).eval()
    total = sum(p.numel() for p in model.parameters())
    phases["model built"] = peak_rss_mib()
    gen = torch.Generator().manual_seed(0)
    batches = ({"input_ids": torch.randint(0, model.config.vocab_size, (args.batch, args.tokens),
                                           generator=gen)} for _ in range(args.batches))
    widths = [m.weight.shape[0] for n, m in model.named_modules()
              if n.startswith("transformer.h.") and type(m).__name__ == "Conv1D"]
    config = comera.ConvertConfig(include=["transformer.h.*"], format=args.format,
                                  target_compression=2.0, allocation="global")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        report, seconds, _ = timed(lambda: comera.convert_(model, config, calibration=batches))
    phases["converted"] = peak_rss_mib()
    result = {"machine": machine(), "command": _command(args), "parameters": total,
              "layers": len(report.layers), "batches": report.batches,
              "tokens_per_batch": args.batch * args.tokens, "format": args.format,
              "statistics_mib": gram_bytes(widths) / 2**20, "seconds": round(seconds, 1),
              "peak_rss_mib": phases, "linear_before": report.before,
              "linear_after": report.after, "compression": report.before / report.after,
              "mean_output_error": sum(r.error for r in report.layers) / len(report.layers)}
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"gpt2_124m_{args.batches}.json"
    path.write_text(json.dumps(result, indent=1, default=str))
    print(json.dumps({k: v for k, v in result.items() if k != "machine"}, indent=1))
    return 0


def _command(args) -> str:
    return "python -m benchmarks.studies.compress_hf " + shlex.join(sys.argv[1:])


def _model_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="gpt2", choices=list(MODELS),
                   help="the model built from a config and trained (default: gpt2)")


def parser() -> argparse.ArgumentParser:
    """The command line of the study."""
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    small = sub.add_parser("small", help="a small GPT-2 trained briefly, converted with dicts")
    _model_option(small)
    small.add_argument("--steps", type=int, default=600)
    small.add_argument("--formats", nargs="+", default=["tt", "lowrank"],
                       choices=CONVERTIBLE)
    small.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    small.add_argument("--calib-rows", type=int, default=256)
    small.add_argument("--root", type=Path, default=None)
    small.add_argument("--smoke", action="store_true")
    small.add_argument("--out", type=Path, default=OUT)
    small.set_defaults(run=cmd_small)
    floor = sub.add_parser("floor", help="the small GPT-2 at several ratios, every allocation "
                           "floor and the closed-form refit (issue 41)")
    _model_option(floor)
    floor.add_argument("--steps", type=int, default=600)
    floor.add_argument("--formats", nargs="+", default=["tt", "lowrank"],
                       choices=CONVERTIBLE)
    floor.add_argument("--targets", type=compression_target, nargs="+", default=[2.0, 3.0, 4.0])
    floor.add_argument("--arms", nargs="+", default=list(FLOOR_ARMS), choices=FLOOR_ARMS)
    floor.add_argument("--seeds", type=int, nargs="+", default=[0],
                       help="calibration seeds (uniform/plain runs once: it has none)")
    floor.add_argument("--name", default=None, help="the results' file name, no suffix "
                       "(default: hf_floor for the GPT-2, hf_llama_floor for the Llama)")
    floor.add_argument("--calib-rows", type=int, default=256)
    floor.add_argument("--root", type=Path, default=None)
    floor.add_argument("--cache", type=Path, default=Path("runs/compress_hf"),
                       help="where the trained model is kept (trained once per --model "
                       "and --steps)")
    floor.add_argument("--smoke", action="store_true")
    floor.add_argument("--out", type=Path, default=OUT)
    floor.set_defaults(run=cmd_floor)
    ft = sub.add_parser("finetune", help="the small GPT-2 converted, then fine-tuned at "
                        "several rates, beside the dense model fine-tuned as long and a "
                        "narrower dense model of the same size trained from scratch (issue 41)")
    _model_option(ft)
    ft.add_argument("--steps", type=int, default=600)
    ft.add_argument("--format", default="tt", choices=CONVERTIBLE)
    ft.add_argument("--target", type=compression_target, default=4.0)
    ft.add_argument("--arms", nargs="+", default=list(FINETUNE_ARMS), choices=FINETUNE_CHOICES)
    ft.add_argument("--lrs", type=float, nargs="+", default=[1e-4, 3e-4, 1e-3])
    ft.add_argument("--parametrizations", nargs="+", choices=PARAMETRIZATIONS,
                    default=[DECOMPOSED], help="the converted layers' parametrizations (each "
                    "arm but dense converted at each; default: convert_'s own, plain)")
    ft.add_argument("--extend", action="store_true",
                    help="keep the rows of an existing <name>.json made with the same "
                    "settings and measure only the missing ones")
    ft.add_argument("--at-best", action="store_true",
                    help="with --extend: fine-tune each arm only at its best (parametrization, "
                    "rate) of the grid <name>.json holds (screen on one seed, then add seeds)")
    ft.add_argument("--ft-steps", type=int, default=150)
    ft.add_argument("--seeds", type=int, nargs="+", default=[0])
    ft.add_argument("--name", default=None, help="the results' file name, no suffix "
                    "(default: hf_finetune for the GPT-2, hf_llama_finetune for the Llama)")
    ft.add_argument("--calib-rows", type=int, default=256)
    ft.add_argument("--root", type=Path, default=None)
    ft.add_argument("--cache", type=Path, default=Path("runs/compress_hf"))
    ft.add_argument("--smoke", action="store_true")
    ft.add_argument("--out", type=Path, default=OUT)
    ft.set_defaults(run=cmd_finetune)
    big = sub.add_parser("124m", help="GPT-2 124M: peak RSS of a calibrated conversion")
    big.add_argument("--batches", type=int, default=4)
    big.add_argument("--batch", type=int, default=4)
    big.add_argument("--tokens", type=int, default=256)
    big.add_argument("--format", default="tt", choices=CONVERTIBLE)
    big.add_argument("--tiny", action="store_true", help="a tiny config, for tests")
    big.add_argument("--out", type=Path, default=OUT)
    big.set_defaults(run=cmd_124m)
    return p


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    torch.set_num_threads(1)
    return args.run(args)


if __name__ == "__main__":
    raise SystemExit(main())
