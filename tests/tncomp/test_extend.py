"""tncomp's extension interface: the rename helper every deprecated name goes through, and
``tncomp.inspect`` kept callable but out of ``__all__`` (so ``import *`` leaves the standard
library's ``inspect`` alone)."""

from __future__ import annotations

import inspect
import sys
import types

import pytest

import tncomp
from tncomp.extend import renamed


def test_renamed_serves_the_new_object_with_a_warning_naming_it():
    getattr_ = renamed("pkg.old", {"old_name": ("tncomp.extend:renamed", "9.0")})
    with pytest.warns(DeprecationWarning, match=r"pkg\.old\.old_name is deprecated: use "
                                                r"tncomp\.extend\.renamed; .* goes in 9\.0\."):
        assert getattr_("old_name") is renamed
    with pytest.raises(AttributeError, match=r"module 'pkg\.old' has no attribute 'other'"):
        getattr_("other")


def test_renamed_refuses_a_target_it_cannot_resolve():
    with pytest.raises(ValueError, match=r"'package\.module:name'"):
        renamed("m", {"a": ("tncomp.extend.renamed", "1.0")})
    with pytest.raises(ValueError, match="the release"):
        renamed("m", {"a": ("tncomp.extend:renamed", "")})


def test_renamed_works_as_a_module_getattr():
    module = types.ModuleType("probe_module")
    module.__getattr__ = renamed("probe_module", {"old": ("tncomp:compile", "1.0")})
    sys.modules["probe_module"] = module
    try:
        with pytest.warns(DeprecationWarning, match="use tncomp.compile"):
            from probe_module import old  # type: ignore[attr-defined]
        assert old is tncomp.compile
    finally:
        del sys.modules["probe_module"]


def test_star_import_does_not_shadow_the_standard_library_inspect():
    assert "inspect" not in tncomp.__all__
    namespace: dict = {"inspect": inspect}
    exec("from tncomp import *", namespace)
    assert namespace["inspect"] is inspect  # still the standard library's
    assert callable(tncomp.inspect) and tncomp.inspect is not inspect
    assert "inspect" in dir(tncomp)


@pytest.mark.parametrize("name", ["autocast_cast", "autocast_dtype", "check_memory",
                                  "check_modes", "resolve_ranks"])
def test_the_extension_names_warn_from_tncomp(name):
    import tncomp.extend

    assert name not in tncomp.__all__
    with pytest.warns(DeprecationWarning, match=rf"tncomp\.{name} is deprecated: use "
                                                rf"tncomp\.extend\.{name}; .* 0\.3\.0"):
        assert getattr(tncomp, name) is getattr(tncomp.extend, name)


def test_comera_imports_without_a_deprecation_of_ours():
    import subprocess

    code = "import warnings; warnings.simplefilter('error', DeprecationWarning); import comera"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
