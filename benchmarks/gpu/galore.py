"""GaLoreAdamW where ``import galore_torch`` fails on bitsandbytes.

galore-torch 1.0's ``__init__`` imports its 8-bit optimizer, hence bitsandbytes (a large,
CUDA-specific wheel). The benchmark uses only ``GaLoreAdamW`` (``galore_torch/adamw.py`` and its
projector), so when bitsandbytes is missing the package is set up without running its
``__init__``: ``galore_torch.adamw`` is imported from the installed files and the package module
exposes ``GaLoreAdamW``, which is what ``benchmarks.lib.model_baselines`` imports."""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types


def ensure_galore() -> str | None:
    """Make ``from galore_torch import GaLoreAdamW`` work; None when it does, else why not."""
    try:
        from galore_torch import GaLoreAdamW  # noqa: F401
        return None
    except ImportError as exc:
        if "bitsandbytes" not in str(exc):
            return f"galore_torch is not importable ({exc}); bring it (benchmarks/gpu/wheels.sh)"
    sys.modules.pop("galore_torch", None)
    spec = importlib.util.find_spec("galore_torch")
    if spec is None or not spec.submodule_search_locations:
        return "galore_torch is not installed (benchmarks/gpu/wheels.sh brings its wheel)"
    package = types.ModuleType("galore_torch")
    package.__path__ = list(spec.submodule_search_locations)
    package.__spec__ = spec
    sys.modules["galore_torch"] = package
    try:
        package.GaLoreAdamW = importlib.import_module("galore_torch.adamw").AdamW
    except ImportError as exc:
        sys.modules.pop("galore_torch", None)
        return f"galore_torch.adamw is not importable ({exc})"
    return None
