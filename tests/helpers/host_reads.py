"""Which ops of a piece of code read device values back to the host, found on the CPU.

A CUDA graph capture fails at such an op (the stream cannot wait for the host), and it costs a
sync in every eager step. Recorded with a dispatch mode, so the check runs without a GPU."""

from __future__ import annotations

import traceback

from torch.utils._python_dispatch import TorchDispatchMode

#: aten ops whose result needs a device value on the host: a Python number of a tensor, or an
#: output whose shape depends on the data.
HOST_READING_OPS = frozenset({
    "_local_scalar_dense", "is_nonzero", "equal", "nonzero", "unique_dim", "_unique",
    "_unique2", "unique_consecutive", "masked_select", "bincount", "histc",
})


class HostReads(TorchDispatchMode):
    """Records ``(op name, the Python frames that called it)`` of each host-reading op run
    inside the ``with`` block, in ``self.reads``."""

    def __init__(self) -> None:
        super().__init__()
        self.reads: list[tuple[str, str]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._schema.name.split("::")[-1]
        if name in HOST_READING_OPS or (name == "repeat_interleave"
                                        and (kwargs or {}).get("output_size") is None):
            frames = [f for f in traceback.format_stack()[:-1] if "/torch/" not in f]
            self.reads.append((name, "".join(frames[-3:])))
        return func(*args, **(kwargs or {}))


class PythonReads:
    """Counts the calls that turn a tensor into Python values (``item``, ``tolist``, ``bool``,
    ``int``, ``float``) made from the code under ``packages`` (paths inside the repository),
    in ``self.calls``: on a GPU each is a device-to-host copy. Torch's own calls (an
    optimizer reading its CPU step counter) are not counted."""

    NAMES = ("item", "tolist", "__bool__", "__int__", "__float__")

    def __init__(self, packages: tuple[str, ...] = ("comera", "tncomp")) -> None:
        from tests.helpers import ROOT

        self.roots = tuple(str(ROOT / p) + "/" for p in packages)
        self.calls = 0
        self._saved: dict = {}

    def __enter__(self) -> PythonReads:
        import sys

        import torch

        for name in self.NAMES:
            original = getattr(torch.Tensor, name)
            self._saved[name] = original

            def counted(tensor, *args, _original=original, **kwargs):
                caller = sys._getframe(1).f_code.co_filename
                if caller.startswith(self.roots):
                    self.calls += 1
                return _original(tensor, *args, **kwargs)

            setattr(torch.Tensor, name, counted)
        return self

    def __exit__(self, *exc) -> None:
        import torch

        for name, original in self._saved.items():
            setattr(torch.Tensor, name, original)
