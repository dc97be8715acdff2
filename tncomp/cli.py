"""The ``tncomp`` command: inspect a layer's costs and plans, draw them, manage the plan cache.

Commands: inspect (costs, regimes, plans, each step's roofline floor; --measure times the
steps), draw (a picture of the network and its contraction tree), plot-costs (FLOPs and
modelled time against the batch size), calibrate (refused when the machine is too busy to
measure), cache (info, or clear: the plan cache and the calibration files).

SPEC forms:
  tt:768x3072:modes=12,8,8|12,16,16:rank=30      CoMERA TT layer (rank: max, or r1,r2,...)
  ttm:768x3072:modes=12,8,8|12,16,16:rank=30     interleaved TT-matrix layer
  eq:bi,ij->bj:B,768|768,3072                    einsum with shapes (a name is a symbol)
  path/to/net.json                               {"eq": ..., "shapes": [...]} or {"tt": {...}}
Unknown SPEC keys are refused; a rank above the layer's full TT rank is clipped to it, with a
warning. Bad input exits with status 2 and one line on stderr.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
import warnings
from pathlib import Path
from typing import TYPE_CHECKING

from tncomp.errors import OptionError, SpecError, TncompError  # errors live in errors.py

if TYPE_CHECKING:
    import torch

    from tncomp.compiler.ir import Network

EXIT_USAGE = 2
_DIGITS = re.compile(r"^[0-9]+$")  # str.isdigit also takes '²', which int() refuses


def _device(text: str) -> torch.device:
    """``torch.device(text)`` if this machine has it, else an :class:`OptionError` naming it."""
    import torch

    try:
        device = torch.device(text)
    except (RuntimeError, ValueError):
        raise OptionError(
            f"--device {text!r} is not a torch device; use e.g. cpu or cuda."
        ) from None
    if device.type == "cpu":
        return device
    if device.type != "cuda":
        raise OptionError(f"--device {text!r}: tncomp plans for cpu and cuda devices; use "
                          "--device cpu or --device cuda.")
    if not torch.cuda.is_available():
        raise OptionError(f"--device {text!r}: CUDA is not available on this machine (torch "
                          f"{torch.__version__}, no usable GPU); use --device cpu.")
    if device.index is not None and device.index >= torch.cuda.device_count():
        raise OptionError(f"--device {text!r}: this machine has {torch.cuda.device_count()} "
                          "CUDA device(s); pick an index below that.")
    return device


def _ints(text: str, what: str) -> list[int]:
    try:
        return [int(v) for v in text.split(",") if v]
    except ValueError:
        raise SpecError(f"{what} {text!r} is not a comma-separated list of ints.") from None


class RankClipWarning(UserWarning):
    """A layer SPEC asked for a rank above the layer's full TT rank (clipped to it)."""


SPEC_KEYS = ("modes", "rank")  # the KEY=VALUE fields of tt:/ttm: SPECs
JSON_KEYS = {"eq": ("eq", "shapes"), "tt": ("in_modes", "out_modes", "ranks", "batch"),
             "ttm": ("in_modes", "out_modes", "ranks", "batch")}


def _warn_if_clipped(spec: str, kind: str, in_modes, out_modes, ranks) -> None:
    """A :class:`RankClipWarning` when an int rank exceeds the full rank of the train (every
    bond is then clipped, and the layer is uncompressed)."""
    from tncomp.compiler.builders import resolve_ranks

    if isinstance(ranks, bool) or not isinstance(ranks, int):
        return
    try:
        train = (list(in_modes) + list(out_modes) if kind == "tt"
                 else [m * n for m, n in zip(in_modes, out_modes, strict=True)])
        full = resolve_ranks(max(math.prod(train), 1), train)
    except (TncompError, TypeError, ValueError):
        return  # the builder reports a bad layer itself
    full_rank = max(full)
    if ranks <= full_rank:
        return
    if kind == "tt":
        sizes = [full[k] * n * full[k + 1] for k, n in enumerate(train)]
    else:
        sizes = [full[k] * m * n * full[k + 1]
                 for k, (m, n) in enumerate(zip(in_modes, out_modes, strict=True))]
    params, dense = sum(sizes), math.prod(in_modes) * math.prod(out_modes)
    bigger = f", {params} parameters against {dense} dense" if params > dense else ""
    warnings.warn(RankClipWarning(
        f"SPEC {spec!r}: rank={ranks} is above the layer's full TT rank {full_rank}, so every "
        f"bond is clipped to full rank (uncompressed{bigger}); pick a rank below {full_rank}."
    ), stacklevel=3)


def _spec_options(spec: str, fields: list[str]) -> dict[str, str]:
    """The KEY=VALUE fields of a tt:/ttm: SPEC, each key known and given once."""
    opts: dict[str, str] = {}
    for field in fields:
        key, eq, value = field.partition("=")
        if not eq:
            raise SpecError(f"SPEC {spec!r} has field {field!r}; fields are KEY=VALUE with KEY "
                            f"one of {', '.join(SPEC_KEYS)}, e.g. rank=30.")
        if key not in SPEC_KEYS:
            raise SpecError(f"SPEC {spec!r} has unknown key {key!r}; the keys are "
                            f"{', '.join(SPEC_KEYS)} (e.g. modes=12,8,8|12,16,16:rank=30).")
        if key in opts:
            raise SpecError(f"SPEC {spec!r} gives {key}= twice; give it once.")
        opts[key] = value
    return opts


def parse_spec(spec: str) -> Network:
    """The :class:`~tncomp.compiler.ir.Network` a SPEC declares (see the module docstring).

    Unknown keys are refused (:class:`SpecError`); an int rank above the layer's full rank
    gives a :class:`RankClipWarning`."""
    from tncomp.compiler.builders import from_eq, tt_linear, ttm_linear

    if spec.endswith(".json"):
        path = Path(spec)
        if not path.is_file():
            raise SpecError(f"SPEC file {spec} does not exist.")
        try:
            data = json.loads(path.read_text())
        except ValueError as exc:
            raise SpecError(f"SPEC file {spec} is not valid JSON: {exc}") from None
        except RecursionError:
            raise SpecError(f"SPEC file {spec} nests its JSON too deep to read; a SPEC file is "
                            "an object of lists of ints.") from None
        try:
            _check_json_keys(spec, data)
            if isinstance(data, dict) and "eq" in data:
                return from_eq(data["eq"], *data.get("shapes", []))
            for kind, build in (("tt", tt_linear), ("ttm", ttm_linear)):
                if isinstance(data, dict) and kind in data:
                    d = data[kind]
                    net = build(d["in_modes"], d["out_modes"], d["ranks"], d.get("batch", "B"))
                    _warn_if_clipped(spec, kind, d["in_modes"], d["out_modes"], d["ranks"])
                    return net
        except KeyError as exc:
            raise SpecError(f"SPEC file {spec}: entry {kind!r} lacks {exc}; give in_modes, "
                            "out_modes and ranks.") from None
        except (TypeError, AttributeError) as exc:
            raise SpecError(f"SPEC file {spec} has malformed content ({exc}); see "
                            "tncomp --help for the JSON forms.") from None
        raise SpecError(f"SPEC file {spec} needs an 'eq', 'tt' or 'ttm' entry (a JSON object).")
    kind, _, rest = spec.partition(":")
    if kind == "eq":
        eq, _, shapes = rest.rpartition(":")
        if not eq:
            raise SpecError(f"SPEC {spec!r}: write eq:EQUATION:SHAPES, e.g. eq:bi,ij->bj:B,3|3,4")
        parsed = [[int(v) if _DIGITS.match(v) else v for v in s.split(",")]
                  for s in shapes.split("|")]
        return from_eq(eq, *parsed)
    if kind in ("tt", "ttm"):
        fields = rest.split(":")
        try:
            n_in, n_out = (int(v) for v in fields[0].split("x"))
        except ValueError:
            raise SpecError(f"SPEC {spec!r}: the shape must be INxOUT, e.g. 768x3072.") from None
        opts = _spec_options(spec, fields[1:])
        if "modes" not in opts:
            raise SpecError(f"SPEC {spec!r} needs modes=IN|OUT, e.g. modes=12,8,8|12,16,16.")
        ins, _, outs = opts["modes"].partition("|")
        in_modes, out_modes = _ints(ins, "in modes"), _ints(outs, "out modes")
        if math.prod(in_modes) != n_in or math.prod(out_modes) != n_out:
            raise SpecError(
                f"SPEC {spec!r}: modes multiply to {math.prod(in_modes)}x{math.prod(out_modes)}, "
                f"not {n_in}x{n_out}; pick modes whose products are the layer's sizes."
            )
        ranks = _ints(opts.get("rank", "8"), "rank")
        build = tt_linear if kind == "tt" else ttm_linear
        rank = ranks[0] if len(ranks) == 1 else ranks
        net = build(in_modes, out_modes, rank)
        _warn_if_clipped(spec, kind, in_modes, out_modes, rank)
        return net
    raise SpecError(
        f"SPEC {spec!r} is not understood; use tt:INxOUT:modes=..|..:rank=R, ttm:..., "
        "eq:EQUATION:SHAPES, or a .json file."
    )


def _check_json_keys(spec: str, data: object) -> None:
    """A :class:`SpecError` naming a key of a JSON SPEC that nothing would read."""
    if not isinstance(data, dict):
        return
    kind = next((k for k in JSON_KEYS if k in data), None)
    if kind is None:
        return  # parse_spec says which entries a SPEC file needs
    allowed = JSON_KEYS["eq"] if kind == "eq" else (kind,)
    entry = data[kind]
    unknown = sorted(set(data) - set(allowed))
    if kind != "eq" and isinstance(entry, dict):
        inner = sorted(set(entry) - set(JSON_KEYS[kind]))
        if inner:
            raise SpecError(f"SPEC file {spec}: entry {kind!r} has unknown key {inner[0]!r}; "
                            f"its keys are {', '.join(JSON_KEYS[kind])}.")
    if unknown:
        raise SpecError(f"SPEC file {spec} has unknown key {unknown[0]!r} beside {kind!r}; "
                        f"a SPEC file holds {' and '.join(repr(k) for k in allowed)} only.")


def _memory(text: str | None) -> str | int | None:
    """``--memory``: fast, balanced, min, or a budget in bytes (an OptionError otherwise)."""
    from tncomp.compiler.memory import check_memory

    if text is None:
        return None
    return check_memory(int(text) if text.strip().isdigit() else text)


def _threads(text: str | None, measure: bool = True) -> int | None:
    """``--threads``: a number of threads this process can use (an OptionError otherwise)."""
    from tncomp.runtime.device_timing import check_threads

    if text is None:
        return None
    if not measure:
        raise OptionError(f"--threads {text} sets the threads --measure runs on; add --measure, "
                          "or leave --threads out.")
    return check_threads(int(text) if _DIGITS.match(text) else text, "--threads")


def _cmd_inspect(args: argparse.Namespace) -> int:
    from tncomp.inspection import inspect

    memory = _memory(args.memory)  # before parsing the SPEC: a bad value fails fast
    threads = _threads(args.threads, args.measure)
    net = parse_spec(args.spec)
    print(inspect(net, batch=args.batch, measure=args.measure, threads=threads,
                  memory=memory or "fast"))
    return 0


def _cmd_draw(args: argparse.Namespace) -> int:
    from tncomp.inspection import draw_network
    from tncomp.views.figures import check_output_path

    path = check_output_path(args.output)  # before compiling: a bad path fails fast
    net = parse_spec(args.spec)
    drawing = draw_network(net, path, batch=args.batch)
    at = f" (tree FLOPs at batch {drawing.batch})" if drawing.batch is not None else ""
    print(f"wrote {drawing.path}: {len(net.operands)} tensors, {len(drawing.tree.steps)} "
          f"contractions{at}")
    return 0


def _cmd_plot_costs(args: argparse.Namespace) -> int:
    from tncomp.api import model_for
    from tncomp.inspection import plot_costs
    from tncomp.views.figures import check_output_path

    device = _device(args.device)  # before anything else: a missing device fails fast
    memory = _memory(args.memory)
    path = check_output_path(args.output)
    net = parse_spec(args.spec)
    curves = plot_costs(net, path, args.batch_range, model=model_for(device),
                        name=f"SPEC {args.spec!r}", memory=memory,
                        show_memory=memory is not None)
    bps = ", ".join(str(b) for b in curves.breakpoints) or "none"
    print(f"wrote {curves.path}: {len(curves.candidates)} candidate plans over "
          f"{curves.dim.name}={curves.batches[0]}..{curves.batches[-1]}, breakpoints {bps}"
          f"{'' if curves.dense is not None else ' (no dense equivalent)'}")
    return 0


def _cmd_cache(args: argparse.Namespace) -> int:
    from tncomp.api import cache_info, clear_cache
    from tncomp.runtime.device_timing import calibration_files

    if args.action == "clear":
        info = cache_info()
        calibrations = [p.name for p in calibration_files(info["disk_dir"])]
        clear_cache(disk=True, calibration=True)
        removed = (f"removed the calibration files {', '.join(calibrations)} (compile plans "
                   "with the default device models until `tncomp calibrate` runs again)"
                   if calibrations else "no calibration files were there")
        n = info["disk_entries"]
        print(f"cleared the tncomp plan cache in {info['disk_dir']} ({n} "
              f"entr{'y' if n == 1 else 'ies'}); {removed}")
    else:
        for key, value in cache_info().items():
            print(f"{key:<13} {value}")
    return 0


def _cmd_calibrate(args: argparse.Namespace) -> int:
    from tncomp.runtime.device_timing import calibrate

    device = _device(args.device)  # both before measuring: a bad value fails fast
    threads = _threads(args.threads)
    model = calibrate(device, shapes=args.shapes, threads=threads)
    table = (f", GEMM rates over {len(model.gemm_rates)} shapes from "
             f"{model.gemm_dims[0]} to {model.gemm_dims[-1]} "
             f"({min(model.gemm_rates) / 1e9:.1f}-{max(model.gemm_rates) / 1e9:.1f} GFLOP/s)"
             if model.gemm_dims else "")
    print(f"{model.source}: GEMM {model.gemm_flops_per_s / 1e9:.1f} GFLOP/s{table}, bandwidth "
          f"{model.bytes_per_s / 1e9:.1f} GB/s, step {model.step_overhead_s * 1e6:.1f} us "
          "(saved; compile() now plans with these numbers)")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tncomp", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("inspect", help="costs, regimes and plans of a layer")
    p.add_argument("spec", help="layer SPEC (see tncomp --help)")
    p.add_argument("--batch", type=int, default=None,
                   help="batch size to show the plan at (default 4096, within the bounds)")
    p.add_argument("--memory", default=None, metavar="MODE",
                   help="what the forward keeps for the backward: fast (all), balanced, min "
                        "(recompute all), or a budget in bytes")
    p.add_argument("--measure", action="store_true",
                   help="run the plan (random float32 CPU operands) and show each step's time "
                        "beside its roofline floor (refused when the operands and the plan "
                        "exceed the memory limit, $TNCOMP_MEMORY_LIMIT)")
    p.add_argument("--threads", default=None, metavar="N",
                   help="threads --measure runs on (default: torch's; 1 on a shared machine)")
    p.set_defaults(run=_cmd_inspect)
    p = sub.add_parser("draw", help="picture of the network and its forward contraction tree")
    p.add_argument("spec", help="layer SPEC (see tncomp --help)")
    p.add_argument("-o", "--output", required=True, help="picture file, e.g. net.png (or .svg)")
    p.add_argument("--batch", type=int, default=None,
                   help="batch size the tree's FLOPs are shown at (default 4096)")
    p.set_defaults(run=_cmd_draw)
    p = sub.add_parser("plot-costs", help="FLOPs and modelled time vs batch size, per plan")
    p.add_argument("spec", help="layer SPEC with one symbolic size (see tncomp --help)")
    p.add_argument("-o", "--output", required=True, help="picture file, e.g. costs.png")
    p.add_argument("--batch-range", type=int, nargs=2, metavar=("LO", "HI"), default=None,
                   help="batch sizes to sweep (default: the symbol's bounds, up to 65536)")
    p.add_argument("--device", default="cpu",
                   help="device whose cost model (calibrated, else default) times the plans")
    p.add_argument("--memory", default=None, metavar="MODE",
                   help="also plot the bytes each plan saves for the backward under MODE: "
                        "fast, balanced, min, or a budget in bytes (plans are timed under it)")
    p.set_defaults(run=_cmd_plot_costs)
    p = sub.add_parser("calibrate", help="measure this device's GEMM rate and bandwidth")
    p.add_argument("--device", default="cpu")
    p.add_argument("--shapes", action="store_true",
                   help="also measure GEMM rates over thin to square shapes: each step's floor "
                        "(inspect) is then at its own shape's rate, and plans use the table")
    p.add_argument("--threads", default=None, metavar="N",
                   help="threads to measure with (default: torch's; compile plans with the "
                        "rates whatever its thread count)")
    p.set_defaults(run=_cmd_calibrate)
    p = sub.add_parser("cache", help="show or clear the plan cache and the calibrations")
    p.add_argument("action", choices=["info", "clear"])
    p.set_defaults(run=_cmd_cache)
    return parser


def _silence_stdout() -> None:
    """Point stdout at the null device, so the interpreter's last flush into a closed pipe
    raises nothing (Python's recipe for ``| head``)."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):  # no file descriptor (a test's captured stdout)
        pass


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        try:
            code = args.run(args)
            sys.stdout.flush()  # a reader that stopped reading (| head) shows up here
        except BrokenPipeError:  # ... and is no error of ours: stop quietly
            _silence_stdout()
            return 0
        except TncompError as exc:  # the error alone: one line
            message = " ".join(str(exc).split())  # one line, whatever the message holds
            print(f"tncomp: error: {message}", file=sys.stderr)
            return EXIT_USAGE
    for w in caught:  # each warning as one line, not Python's two
        print(f"tncomp: warning: {' '.join(str(w.message).split())}", file=sys.stderr)
    return code


if __name__ == "__main__":
    sys.exit(main())
