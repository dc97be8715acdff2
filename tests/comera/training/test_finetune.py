"""The fine-tune recipe after conversion (comera.training.finetune): its numbers follow the rule,
its optimizer holds the gates and trains the cores, its schedule warms up as the engine's does,
the loop lowers a converted model's held-out loss on real text (dict batches and (x, y) pairs),
the HuggingFace arguments build a real TrainingArguments that a Trainer runs, and every bad
input is refused before a step."""

from __future__ import annotations

import itertools
import math
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import comera
from comera.errors import ConfigError, NonFiniteLossError
from comera.training import finetune as ft
from comera.training.finetune import (
    LR_FACTOR,
    WARMUP_FRACTION,
    FinetuneRecipe,
    finetune,
    hold_gates_,
    lr_factor,
)

pytestmark = pytest.mark.usefixtures("one_thread")

# real text: the bytes of this repository's own sources (no download, never random)
TEXT = torch.tensor(list(b"".join(p.read_bytes() for p in sorted(
    (Path(comera.__file__).parent / "training").glob("*.py")))), dtype=torch.long)
SEQ = 24


def _windows(first: int, count: int, batch: int = 8) -> list[torch.Tensor]:
    """``count`` batches of ``batch`` windows of SEQ + 1 bytes, at fixed places per index."""
    out = []
    for k in range(first, first + count):
        starts = torch.randint(0, len(TEXT) - SEQ - 1, (batch,),
                               generator=torch.Generator().manual_seed(k))
        out.append(torch.stack([TEXT[s:s + SEQ + 1] for s in starts.tolist()]))
    return out


def _mlp() -> nn.Module:
    """Next byte from the 4 before it: an embedding, then two linear layers to convert."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(256, 16), nn.Flatten(), nn.Linear(64, 64), nn.GELU(),
                         nn.Linear(64, 256))


def _pairs(first: int, count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(w[:, :4], w[:, 4]) for w in _windows(first, count, batch=32)]


def _converted_mlp() -> nn.Module:
    model = _mlp()
    comera.convert_(model, ranks=4)  # the two Linear layers, TT
    return model


def _held_out(model: nn.Module, pairs) -> float:
    model.eval()
    with torch.no_grad():
        return sum(float(F.cross_entropy(model(x), y)) for x, y in pairs) / len(pairs)


def _gates(model: nn.Module) -> list[torch.Tensor]:
    return [g for _, layer in comera.gated_layers(model) for g in layer.gates]


def _cores(model: nn.Module) -> list[torch.Tensor]:
    return [c for _, layer in comera.gated_layers(model) for c in layer.cores]


# -- the recipe's numbers ---------------------------------------------------------------------
def test_the_rate_is_the_factor_times_the_pretraining_rate():
    recipe = FinetuneRecipe(pretrain_lr=1e-3, steps=150)
    assert recipe.factor == LR_FACTOR and recipe.warmup_fraction == WARMUP_FRACTION
    assert recipe.lr == pytest.approx(LR_FACTOR * 1e-3, rel=1e-12)
    assert FinetuneRecipe(2e-4, 10, factor=2.0).lr == pytest.approx(4e-4, rel=1e-12)
    assert recipe.schedule == "constant" and recipe.weight_decay == 0.0
    assert recipe.hold_gates and recipe.max_grad_norm == 1.0


@pytest.mark.parametrize(("steps", "fraction", "warmup"),
                         [(150, 0.1, 15), (10, 0.1, 1), (5, 0.1, 1), (1, 0.1, 1),
                          (200, 0.05, 10), (70, 0.1, 7), (30, 0.1, 3), (40, 0.0, 0)])
def test_the_warm_up_is_its_share_of_the_steps_rounded_down_at_least_one(steps, fraction,
                                                                         warmup):
    assert FinetuneRecipe(1e-3, steps, warmup_fraction=fraction).warmup_steps == warmup


def test_the_recipe_is_frozen():
    recipe = FinetuneRecipe(1e-3, 10)
    with pytest.raises(AttributeError):
        recipe.steps = 20  # type: ignore[misc]


# -- the optimizer ----------------------------------------------------------------------------
def test_the_optimizer_leaves_out_held_gates_and_takes_cores_and_the_rest():
    model = _converted_mlp()
    optimizer = FinetuneRecipe(1e-3, 10).optimizer(model)
    taken = {id(p) for g in optimizer.param_groups for p in g["params"]}
    assert not taken & {id(g) for g in _gates(model)}
    assert {id(c) for c in _cores(model)} <= taken
    embedding = model[0].weight
    assert id(embedding) in taken and id(model[2].bias) in taken
    assert {g["name"] for g in optimizer.param_groups} == {"cores", "other"}
    assert all(g["lr"] == pytest.approx(LR_FACTOR * 1e-3) for g in optimizer.param_groups)
    assert all(g["weight_decay"] == 0.0 for g in optimizer.param_groups)


def test_without_holding_the_gates_train_at_the_rate_too():
    model = _converted_mlp()
    optimizer = FinetuneRecipe(1e-3, 10, hold_gates=False).optimizer(model)
    gates = next(g for g in optimizer.param_groups if g["name"] == "gates")
    assert {id(p) for p in gates["params"]} == {id(g) for g in _gates(model)}
    assert gates["lr"] == pytest.approx(LR_FACTOR * 1e-3)


def test_the_optimizer_leaves_out_frozen_parameters_and_works_on_a_dense_model():
    model = _mlp()
    model[0].requires_grad_(False)
    optimizer = FinetuneRecipe(1e-3, 10, weight_decay=0.01).optimizer(model)
    taken = [p for g in optimizer.param_groups for p in g["params"]]
    assert {id(p) for p in taken} == {id(p) for p in model[2:].parameters()}
    assert optimizer.param_groups[0]["weight_decay"] == 0.01


# -- the schedule -----------------------------------------------------------------------------
def _rates(recipe: FinetuneRecipe) -> list[float]:
    """The rate each optimizer step runs at, read before the step, as a loop sees it."""
    param = nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.AdamW([param], lr=recipe.lr)
    schedule = recipe.scheduler(optimizer)
    rates = []
    for _ in range(recipe.steps):
        rates.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        schedule.step()
    return rates


def test_the_warm_up_rises_linearly_from_a_step_of_rate_then_holds():
    recipe = FinetuneRecipe(1e-3, 30)  # warm-up 3
    lr = recipe.lr
    assert _rates(recipe) == pytest.approx([lr / 3, 2 * lr / 3] + [lr] * 28, rel=1e-12)


def test_the_cosine_schedule_falls_to_zero_at_the_last_step():
    rates = _rates(FinetuneRecipe(1e-3, 21, schedule="cosine", warmup_fraction=0.05))  # warm-up 1
    lr = FinetuneRecipe(1e-3, 21).lr
    assert rates[0] == pytest.approx(lr) and rates[-1] < 0.01 * lr
    assert all(a >= b for a, b in itertools.pairwise(rates))
    assert rates[11] == pytest.approx(lr * 0.5 * (1 + math.cos(math.pi * 10 / 20)))


@pytest.mark.parametrize("schedule", ["constant", "cosine"])
def test_the_schedule_is_the_engines(schedule):
    """One rule in two places until the engine imports this one: they must agree."""
    from comera.experiments.optim_schedule import lr_factor as engine_factor

    for warmup, total in ((0, 10), (1, 10), (15, 150), (7, 7)):
        for step in range(total + 2):
            assert lr_factor(step, warmup, total, schedule) == engine_factor(
                step, warmup, total, schedule)


def test_the_schedule_pickles_with_the_optimizer_state(tmp_path):
    recipe = FinetuneRecipe(1e-3, 10)
    optimizer = recipe.optimizer(_mlp())
    schedule = recipe.scheduler(optimizer)
    torch.save(schedule.state_dict(), tmp_path / "s.pt")
    assert torch.load(tmp_path / "s.pt", weights_only=False)["last_epoch"] == 0


# -- the loop ---------------------------------------------------------------------------------
def test_the_loop_lowers_a_converted_models_held_out_loss_on_x_y_pairs():
    model = _converted_mlp()
    val = _pairs(10_000, 4)
    before, gates = _held_out(model, val), [g.detach().clone() for g in _gates(model)]
    cores = [c.detach().clone() for c in _cores(model)]
    out = finetune(model, _pairs(0, 10), F.cross_entropy,
                   recipe=FinetuneRecipe(pretrain_lr=1e-2, steps=40))
    assert out is model
    after = _held_out(model, val)
    assert after < before - 0.3, (before, after)
    assert all(torch.equal(a, b) for a, b in zip(gates, _gates(model), strict=True))
    assert not any(torch.equal(a, b) for a, b in zip(cores, _cores(model), strict=True))
    assert all(g.requires_grad for g in _gates(model))  # restored after the run


def _gpt2():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=256,
                                     n_positions=SEQ + 1, bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(config)


def _dicts(first: int, count: int) -> list[dict[str, torch.Tensor]]:
    return [{"input_ids": w, "labels": w} for w in _windows(first, count)]


def _lm_loss(model, batches) -> float:
    model.eval()
    with torch.no_grad():
        return sum(float(model(**b).loss) for b in batches) / len(batches)


def _pretrained_converted_gpt2():
    """A tiny GPT-2 trained dense for a few steps on the text, then converted to TT at 4x."""
    model = _gpt2()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for batch in _dicts(0, 30):
        model(**batch).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # HF's save_pretrained warning
        comera.convert_(model, target_compression=4)
    return model


def test_the_loop_lowers_a_converted_gpt2s_held_out_loss_on_dict_batches():
    model = _pretrained_converted_gpt2()
    val = _dicts(10_000, 4)
    before = _lm_loss(model, val)
    finetune(model, _dicts(100, 30), recipe=FinetuneRecipe(pretrain_lr=3e-3, steps=30))
    after = _lm_loss(model, val)
    assert after < before - 0.02, (before, after)


def test_a_dataloader_is_read_again_when_the_steps_outlast_it():
    model = _converted_mlp()
    x = torch.cat([p[0] for p in _pairs(0, 2)])
    y = torch.cat([p[1] for p in _pairs(0, 2)])
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=32)
    seen = []
    model.register_forward_pre_hook(lambda m, args: seen.append(args[0].shape[0]))
    finetune(model, loader, F.cross_entropy, recipe=FinetuneRecipe(1e-3, 5))
    assert len(seen) == 5  # 2 batches a pass, read 3 times


def test_the_loop_restores_every_modules_mode():
    model = _converted_mlp().train()
    model[3].eval()
    seen = []
    model[3].register_forward_pre_hook(lambda m, args: seen.append(m.training))
    finetune(model, _pairs(0, 2), F.cross_entropy, recipe=FinetuneRecipe(1e-3, 2))
    assert seen == [True, True]  # trained in train mode
    assert model.training and not model[3].training


# -- HuggingFace Trainer ----------------------------------------------------------------------
def test_hf_training_args_are_the_recipe():
    recipe = FinetuneRecipe(2e-3, 150, schedule="cosine", weight_decay=0.01, max_grad_norm=None)
    assert recipe.hf_training_args() == {
        "learning_rate": recipe.lr, "max_steps": 150, "warmup_steps": 15,
        "lr_scheduler_type": "cosine", "weight_decay": 0.01, "max_grad_norm": 0.0}
    assert FinetuneRecipe(1e-3, 10).hf_training_args()["lr_scheduler_type"] == \
        "constant_with_warmup"


def test_a_trainer_runs_the_recipe_with_the_gates_held(tmp_path):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")  # Trainer needs it (the hf extra installs it)
    model = _pretrained_converted_gpt2()
    recipe = FinetuneRecipe(pretrain_lr=3e-3, steps=20)
    args = transformers.TrainingArguments(
        str(tmp_path), per_device_train_batch_size=8, report_to=[], use_cpu=True,
        disable_tqdm=True, save_strategy="no", **recipe.hf_training_args())
    assert args.learning_rate == recipe.lr and args.max_steps == 20
    assert args.get_warmup_steps(20) == 2
    assert hold_gates_(model) == len(_gates(model))
    gates = [g.detach().clone() for g in _gates(model)]
    val = _dicts(10_000, 4)
    before = _lm_loss(model, val)
    data = [{"input_ids": w, "labels": w} for b in _dicts(200, 20) for w in b["input_ids"]]
    trainer = transformers.Trainer(model=model, args=args, train_dataset=data)
    trainer.train()
    assert trainer.state.global_step == 20
    taken = {id(p) for g in trainer.optimizer.param_groups for p in g["params"]}
    assert not taken & {id(g) for g in _gates(model)}
    assert {id(c) for c in _cores(model)} <= taken
    assert trainer.lr_scheduler.get_last_lr()[0] == pytest.approx(recipe.lr)
    assert all(torch.equal(a, b) for a, b in zip(gates, _gates(model), strict=True))
    assert _lm_loss(model, val) < before
    assert hold_gates_(model, False) and all(g.requires_grad for g in _gates(model))


def test_a_trainer_given_the_recipes_optimizer_runs_its_schedule_exactly(tmp_path):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    model = _pretrained_converted_gpt2()
    recipe = FinetuneRecipe(pretrain_lr=3e-3, steps=6, warmup_fraction=0.5)  # warm-up 3
    optimizer = recipe.optimizer(model)
    seen = []
    optimizer.register_step_pre_hook(lambda opt, a, k: seen.append(opt.param_groups[0]["lr"]))
    args = transformers.TrainingArguments(
        str(tmp_path), per_device_train_batch_size=8, report_to=[], use_cpu=True,
        disable_tqdm=True, save_strategy="no", **recipe.hf_training_args())
    data = [{"input_ids": w, "labels": w} for b in _dicts(200, 6) for w in b["input_ids"]]
    transformers.Trainer(model=model, args=args, train_dataset=data,
                         optimizers=(optimizer, recipe.scheduler(optimizer))).train()
    lr = recipe.lr
    assert seen == pytest.approx([lr / 3, 2 * lr / 3, lr, lr, lr, lr], rel=1e-12)


# -- refusals ---------------------------------------------------------------------------------
@pytest.mark.parametrize(("kwargs", "match"), [
    ({"pretrain_lr": 0.0}, "pretrain_lr=0.0"),
    ({"pretrain_lr": -1e-3}, "pretrain_lr=-0.001"),
    ({"pretrain_lr": float("nan")}, "pretrain_lr=nan"),
    ({"pretrain_lr": float("inf")}, "pretrain_lr=inf"),
    ({"pretrain_lr": True}, "pretrain_lr=True"),
    ({"pretrain_lr": "1e-3"}, "pretrain_lr='1e-3'"),
    ({"steps": 0}, "steps=0"),
    ({"steps": 1.5}, "steps=1.5"),
    ({"steps": True}, "steps=True"),
    ({"factor": 0}, "factor=0"),
    ({"factor": float("nan")}, "factor=nan"),
    ({"factor": 1e308, "pretrain_lr": 10.0}, "overflows"),
    ({"warmup_fraction": 1.0}, r"warmup_fraction=1.0; a number in \[0, 1\)"),
    ({"warmup_fraction": -0.1}, "warmup_fraction=-0.1"),
    ({"schedule": "linear"}, "schedule='linear'; one of constant, cosine"),
    ({"weight_decay": -0.1}, "weight_decay=-0.1"),
    ({"weight_decay": float("nan")}, "weight_decay=nan"),
    ({"hold_gates": 1}, "hold_gates=1"),
    ({"max_grad_norm": 0.0}, "max_grad_norm=0.0"),
])
def test_a_bad_recipe_is_refused_naming_the_value(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        FinetuneRecipe(**{"pretrain_lr": 1e-3, "steps": 10, **kwargs})


def test_a_model_with_nothing_to_train_is_refused():
    model = _converted_mlp()
    for p in model.parameters():
        if all(p is not g for g in _gates(model)):
            p.requires_grad_(False)
    with pytest.raises(ConfigError, match="no trainable parameters besides the held rank"):
        FinetuneRecipe(1e-3, 10).optimizer(model)
    FinetuneRecipe(1e-3, 10, hold_gates=False).optimizer(model)  # the gates are trainable
    with pytest.raises(ConfigError, match="no trainable parameters"):
        finetune(model, _pairs(0, 1), F.cross_entropy, recipe=FinetuneRecipe(1e-3, 10))
    assert all(g.requires_grad for g in _gates(model))  # restored after the refusal


def test_what_is_not_a_model_or_an_optimizer_is_refused():
    recipe = FinetuneRecipe(1e-3, 10)
    with pytest.raises(ConfigError, match=r"expected a torch nn\.Module, got a dict"):
        recipe.optimizer({})
    with pytest.raises(ConfigError, match="takes a torch optimizer"):
        recipe.scheduler(_mlp())
    with pytest.raises(ConfigError, match="no gated layers"):
        hold_gates_(_mlp())
    with pytest.raises(ConfigError, match="hold='yes'"):
        hold_gates_(_converted_mlp(), "yes")


def _one_shot(count: int):
    yield from _pairs(0, count)


@pytest.mark.parametrize(("batches", "match"), [
    ([], "batches is empty"),
    (_one_shot(0), "batches is empty"),
    (lambda: _one_shot(2), "ran out after 2 of 5 steps"),
    (torch.zeros(3, 4), "batches is a Tensor"),
    ({"input_ids": torch.zeros(2, 4)}, "batches is a dict"),
    (3, "batches is a int"),
])
def test_bad_batches_are_refused(batches, match):
    batches = batches() if callable(batches) else batches
    model = _converted_mlp()
    with pytest.raises(ConfigError, match=match):
        finetune(model, batches, F.cross_entropy, recipe=FinetuneRecipe(1e-3, 5))


def test_a_batch_without_a_loss_is_refused_before_a_step():
    model = _converted_mlp()
    cores = [c.detach().clone() for c in _cores(model)]
    recipe = FinetuneRecipe(1e-3, 5)
    with pytest.raises(ConfigError, match=r"an \(x, y\) batch needs loss_fn"):
        finetune(model, _pairs(0, 2), recipe=recipe)
    with pytest.raises(ConfigError, match="holds no loss; include labels"):
        finetune(model, [{"input": p[0]} for p in _pairs(0, 2)], recipe=recipe)
    with pytest.raises(ConfigError, match="the batch is a 3-tuple"):
        finetune(model, [(*p, p[1]) for p in _pairs(0, 2)], F.cross_entropy, recipe=recipe)
    with pytest.raises(ConfigError, match=r"the loss has shape \(32,\)"):
        finetune(model, _pairs(0, 2), lambda o, y: F.cross_entropy(o, y, reduction="none"),
                 recipe=recipe)
    with pytest.raises(ConfigError, match="does not require grad"):
        finetune(model, _pairs(0, 2), lambda o, y: torch.tensor(1.0), recipe=recipe)
    assert all(torch.equal(a, b) for a, b in zip(cores, _cores(model), strict=True))


def test_bad_arguments_of_the_loop_are_refused():
    model = _converted_mlp()
    with pytest.raises(ConfigError, match=r"pass comera\.FinetuneRecipe"):
        finetune(model, _pairs(0, 1), F.cross_entropy, recipe={"lr": 1e-3})
    with pytest.raises(ConfigError, match="loss_fn='ce'"):
        finetune(model, _pairs(0, 1), "ce", recipe=FinetuneRecipe(1e-3, 1))
    with pytest.raises(TypeError, match="recipe"):
        finetune(model, _pairs(0, 1), F.cross_entropy)  # the recipe is required


def test_a_non_finite_loss_stops_the_loop_and_restores_the_gates():
    model = _converted_mlp()
    with pytest.raises(NonFiniteLossError, match="step 0"):
        finetune(model, _pairs(0, 2), lambda o, y: F.cross_entropy(o, y) * math.inf,
                 recipe=FinetuneRecipe(1e-3, 5))
    assert all(g.requires_grad for g in _gates(model)) and model.training


def test_the_module_exports_what_the_face_does():
    assert {"FinetuneRecipe", "finetune", "hold_gates_"} <= set(comera.__all__)
    assert comera.finetune is ft.finetune and comera.FinetuneRecipe is FinetuneRecipe
    assert comera.hold_gates_ is hold_gates_
