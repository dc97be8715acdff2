"""A late-stage step does about the work of an early one (issue 42, item 10).

The late stage of ``make run`` took 1.5x the early stage's step time with fewer parameters: every
step, after landing on its target, its pruning (:func:`comera.ranks.objective.prune_to_`) rounded
every layer twice and recounted the model's size several times, each a walk over every gated layer
reading its gates with a few tiny torch ops. At a DLRM's sizes those ops, not the arithmetic, are
the step. The work is counted here in torch ops (the profiler's ``aten::`` events), which a loaded
machine does not change, on a small DLRM with TT tables and hot-row caches.
"""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F
from torch.profiler import ProfilerActivity, profile

import comera
from comera.models.dlrm import DLRM, DLRMConfig
from comera.ranks.objective import prune_to_

pytestmark = pytest.mark.usefixtures("one_thread")

CONFIG = DLRMConfig(cardinalities=(3000, 2000, 50, 4000), embedding_dim=8, bottom_mlp=(16, 8),
                    top_mlp=(16, 1), table_format="ttm", tt_ranks=6, tt_min_rows=1000,
                    tt_cache_rows=8)


def _ops(fn) -> int:
    """Torch ops ``fn()`` runs (every ``aten::`` event, nested ones included)."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return sum(1 for e in prof.events() if e.name.startswith("aten::"))


def _batch(generator: torch.Generator):
    sparse = torch.stack([torch.randint(0, rows, (64,), generator=generator)
                          for rows in CONFIG.table_sizes], 1)  # (64, T)
    return (torch.randn(64, CONFIG.num_dense, generator=generator), sparse,
            torch.randint(0, 2, (64,), generator=generator).float())


def _landed():
    """A DLRM trained 5 early steps (op count of the next one), then a late stage that has
    landed on its target: (model, trainer, step function, early step's ops)."""
    torch.manual_seed(0)
    model = DLRM(CONFIG)
    trainer = comera.CoMERATrainer(model, lam=0.01)
    generator = torch.Generator().manual_seed(0)

    def step():
        dense, sparse, labels = _batch(generator)
        return trainer.step(F.binary_cross_entropy_with_logits(model(dense, sparse), labels))

    for _ in range(5):
        step()
    early = _ops(step)
    with torch.no_grad():  # prune two slices of every bond: the late stage starts below rank 6
        for _, layer in comera.gated_layers(model):
            layer.gates[0][-2:] = 0.0
    ratio = 1.3 * comera.compression_ratio(model, only=comera.GatedLayer)
    trainer.start_late_stage(comera.LateStage.for_compression(model, ratio, steps=10))
    for _ in range(12):
        stats = step()
    assert stats.stage == "late" and stats.size <= trainer.late.target_size  # landed
    return model, trainer, step, early


def test_pruning_at_its_target_reads_the_ranks_a_few_times():
    """Within its limit and with no bond to round, prune_to_ changes nothing and costs no more
    than one size count and three reads of every layer's ranks (on main it rounded twice and
    counted the size twice: 2,376 ops here against 210 for a size count)."""
    model, trainer, _, _ = _landed()
    layers = [layer for _, layer in comera.gated_layers(model)]
    ranks = [layer.ranks for layer in layers]
    limit = trainer.late.target_size
    pruned = []
    work = _ops(lambda: pruned.extend(prune_to_(model, limit, 1, 0.95 * limit, True,
                                                trainer.optimizer)))
    assert pruned == [] and [layer.ranks for layer in layers] == ranks
    size_count = _ops(lambda: comera.model_size(model))
    rank_read = _ops(lambda: [layer.bond_ranks for layer in layers])
    assert work <= size_count + 3 * rank_read, (work, size_count, rank_read)


def test_a_landed_late_step_does_about_the_work_of_an_early_step():
    """The late step's bookkeeping (the size target, the schedule, the rounding) adds at most
    40% to the torch ops of an early step with its rank regulariser (on main: 83%)."""
    _, _, step, early = _landed()
    late = _ops(step)
    assert late <= 1.4 * early, (late, early)
