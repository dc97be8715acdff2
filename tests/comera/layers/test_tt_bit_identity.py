"""TT and TT-matrix layers compute the same bits as before they became generic over a layout.

The reference (``data/tt_reference.pt``) was written by :mod:`tt_reference` on main before the
change; any change of a float operation or its order in the layers, the regularisers,
``soft_size``, saliency, pruning, rounding, allocation, truncation or initialisation fails here.
"""

from __future__ import annotations

import warnings

import torch

from tests.comera.layers.tt_reference import FIXTURE, compute


def test_tt_layers_and_rank_machinery_are_bit_identical_to_the_reference():
    expected = torch.load(FIXTURE)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = compute()
    assert sorted(got) == sorted(expected)
    differ = [k for k in expected
              if got[k].dtype != expected[k].dtype or not torch.equal(got[k], expected[k])]
    assert not differ, f"{len(differ)} results changed, e.g. {differ[:6]}"
