"""The rooms of benchmarks/, read from the source with ``ast`` (so they cannot rot).

    lib       benchmarks/lib/*                shared measurement code: imports comera, tncomp
    speed     benchmarks/speed/bench_*        speed scripts: comera, tncomp, lib
    harness   benchmarks/studies/harness/*    the study harness: comera, tncomp, lib, itself
    studies   benchmarks/studies/*            training studies: comera, tncomp, lib, the harness
    gpu       benchmarks/gpu/*                the GPU runs: comera, tncomp, lib, themselves, and
                                              the speed scripts whose models they time

So a speed script never imports a study or another speed script, a study never imports another
study (what two studies share is the harness's), and nothing imports the GPU runs.
"""

from __future__ import annotations

import pytest

from tests.helpers.imports import imports, package_modules

MODULES = package_modules("benchmarks")
ALLOWED = {
    "lib": {"lib"},
    "speed": {"lib"},
    "harness": {"lib", "harness"},
    "studies": {"lib", "harness"},
    "gpu": {"lib", "gpu", "speed"},
    "root": set(),
}


def room(module: str) -> str:
    parts = module.split(".")
    if len(parts) == 1:
        return "root"
    if parts[1] == "studies" and len(parts) > 2 and parts[2] == "harness":
        return "harness"
    if parts[1] in ("lib", "speed", "studies", "gpu"):
        return parts[1]
    raise AssertionError(f"{module} is in no room of benchmarks/; add it to this test.")


def _benchmark_imports(module: str) -> set[str]:
    found = set()
    for name, _ in imports(MODULES[module], MODULES):
        if name.split(".")[0] == "benchmarks" and name != "benchmarks" and name in MODULES:
            found.add(name)
    return found - {module}


@pytest.mark.parametrize("module", sorted(MODULES))
def test_each_room_imports_only_what_it_may(module):
    mine = room(module)
    bad = sorted(n for n in _benchmark_imports(module)
                 if room(n) not in ALLOWED[mine] and not (room(n) == mine == "root"))
    assert not bad, f"{module} ({mine}) imports {bad}; it may import {sorted(ALLOWED[mine])}"


def test_every_module_has_a_room_and_the_rooms_exist():
    rooms = {room(m) for m in MODULES}
    assert {"lib", "speed", "studies", "harness"} <= rooms
    assert any(m.startswith("benchmarks.speed.bench_") for m in MODULES)


def test_the_checker_sees_a_study_importing_a_study(tmp_path):
    """Not vacuous: a study importing another study (or a speed script) is seen."""
    probe = tmp_path / "probe.py"
    probe.write_text("from benchmarks.studies import lm_frontier\n"
                     "def f():\n    from benchmarks.speed import bench_formats\n")
    found = {name for name, _ in imports(probe, MODULES)}
    assert {"benchmarks.studies.lm_frontier", "benchmarks.speed.bench_formats"} <= found
    assert room("benchmarks.studies.lm_frontier") not in ALLOWED["studies"]
    assert room("benchmarks.speed.bench_formats") not in ALLOWED["studies"]
