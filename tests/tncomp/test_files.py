"""tncomp.files: atomic writes never follow a link at the target, and say what a path is."""

from __future__ import annotations

import os

from tncomp.files import atomic_write_bytes, atomic_write_text, link_or_special


def test_atomic_write_replaces_a_planted_link_and_leaves_its_target(tmp_path):
    victim = tmp_path / "victim"
    victim.write_text("DATA")
    target = tmp_path / "out.json"
    target.symlink_to(victim)
    atomic_write_text(target, "new")
    assert victim.read_text() == "DATA"
    assert not target.is_symlink() and target.read_text() == "new"
    atomic_write_bytes(target, b"again")
    assert target.read_bytes() == b"again"


def test_link_or_special_names_links_fifos_and_folders(tmp_path):
    plain = tmp_path / "plain"
    plain.write_text("x")
    link = tmp_path / "link"
    link.symlink_to(plain)
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    assert link_or_special(plain) is None
    assert link_or_special(tmp_path / "absent") is None
    assert link_or_special(link) == f"a symbolic link (to {plain})"
    assert link_or_special(fifo) == "not a regular file"
    assert link_or_special(tmp_path) == "not a regular file"
