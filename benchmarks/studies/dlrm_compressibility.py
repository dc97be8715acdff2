"""How compressible is the planted DLRM table? TT-SVD errors of the synthetic data's hidden
per-id vectors, with and without a hot-row cache.

    python -m benchmarks.studies.dlrm_compressibility

The quick DLRM run's label is a logistic function of a hidden vector per (table, id): a hash of
the id, independent from id to id (:meth:`comera.data.SyntheticCriteo.hidden_vectors`). The best
any embedding table can do is represent that (rows x h) table. This script takes it for every TT
table of the quick run, rounds it to a TT-matrix with the same row modes as the model's table at
several ranks (TT-SVD: within sqrt(d - 1) of the best error at those ranks), and reports the
relative error, plain and weighted by how often the training data looks each id up, and with the
``C`` most frequent ids exact (a hot-row cache). Results:
``benchmarks/results/dlrm_compressibility/compressibility.{json,md}``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from benchmarks.lib.measure import RESULTS
from comera.experiments.dlrm_task import DLRMTask, DLRMTaskConfig
from comera.formats.factorize import factorize
from comera.formats.ttsvd import matrix_to_ttm, ttm_to_matrix
from comera.models.dlrm import DLRM

OUT = RESULTS / "dlrm_compressibility"


def planted_table(generator, table: int, rows: int) -> torch.Tensor:
    """(rows, h) float64: the hidden vector of every id of ``table``."""
    sparse = torch.zeros(rows, len(generator.cardinalities), dtype=torch.long)
    sparse[:, table] = torch.arange(rows)
    return generator.hidden_vectors(sparse)[:, table, :]


def errors(table: torch.Tensor, row_modes, ranks: int, weights: torch.Tensor,
           caches: list[int]) -> dict:
    rows, h = table.shape
    padded = torch.zeros(int(torch.tensor(row_modes).prod()), h, dtype=torch.float64)
    padded[:rows] = table
    col_modes = factorize(h, len(row_modes))
    cores = matrix_to_ttm(padded, row_modes, col_modes, [ranks] * (len(row_modes) - 1))
    approx = ttm_to_matrix(cores)[:rows]
    err = (approx - table).square().sum(1)  # (rows,)
    energy = table.square().sum(1)  # (rows,)
    out = {"plain": float((err.sum() / energy.sum()).sqrt()),
           "lookup_weighted": float(((weights * err).sum() / (weights * energy).sum()).sqrt()),
           "tt_params": sum(c.numel() for c in cores)}
    order = torch.argsort(weights, descending=True)
    for c in caches:
        kept = err.clone()
        kept[order[:c]] = 0.0
        out[f"lookup_weighted_cache{c}"] = float(
            ((weights * kept).sum() / (weights * energy).sum()).sqrt())
        out[f"cache{c}_lookup_share"] = float(weights[order[:c]].sum() / weights.sum())
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    p.add_argument("--caches", type=int, nargs="+", default=[16, 64, 256])
    p.add_argument("--out", type=Path, default=OUT)
    args = p.parse_args(argv)
    cfg = DLRMTaskConfig.quick()
    task = DLRMTask(cfg)
    generator = task.data.generator if hasattr(task.data, "generator") else None
    if generator is None:
        from comera.data.criteo import SyntheticCriteo

        generator = SyntheticCriteo(cardinalities=cfg.model_config("dense").table_sizes,
                                    zipf_exponent=cfg.zipf_exponent, seed=cfg.data_seed)
    model = DLRM(cfg.model_config("tt"))
    result = {"config": {"max_rows": cfg.max_rows, "hidden_dim": generator.hidden_dim,
                         "n_train": cfg.n_train}, "tables": []}
    for k, table in enumerate(model.embeddings):
        if not cfg.model_config("tt").is_tt_table(k):
            continue
        rows = table.num_embeddings
        planted = planted_table(generator, k, rows)
        counts = torch.bincount(task.data.train.sparse[:, k].long(), minlength=rows).double()
        entry = {"table": k, "rows": rows, "row_modes": list(table.row_modes), "ranks": {}}
        for r in args.ranks:
            entry["ranks"][r] = errors(planted, table.row_modes, r, counts, args.caches)
        result["tables"].append(entry)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "compressibility.json").write_text(json.dumps(result, indent=1))
    lines = ["Relative TT-SVD error of the planted per-id table (rows x h = "
             f"{generator.hidden_dim}), mean over the {len(result['tables'])} TT tables of the "
             "quick DLRM run; 'weighted': each row weighted by its training lookups; 'cache C': "
             "the C most looked-up rows exact.", "",
             "| TT rank | TT params / table | error | weighted error | "
             + " | ".join(f"weighted, cache {c} (lookups {{share{c}}})" for c in args.caches)
             + " |", "|---|---|---|---|" + "---|" * len(args.caches)]
    n = len(result["tables"])
    shares = {c: sum(t["ranks"][args.ranks[0]][f"cache{c}_lookup_share"]
                     for t in result["tables"]) / n for c in args.caches}
    lines[2] = lines[2].format(**{f"share{c}": f"{100 * s:.0f}%" for c, s in shares.items()})
    for r in args.ranks:
        def mean(key: str, r: int = r) -> float:
            return sum(t["ranks"][r][key] for t in result["tables"]) / n
        lines.append(f"| {r} | {mean('tt_params'):.0f} | {mean('plain'):.3f} | "
                     f"{mean('lookup_weighted'):.3f} | "
                     + " | ".join(f"{mean(f'lookup_weighted_cache{c}'):.3f}"
                                  for c in args.caches) + " |")
    (args.out / "compressibility.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
