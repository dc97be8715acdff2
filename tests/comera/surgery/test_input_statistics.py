"""Streaming input statistics (comera/surgery/input_statistics.py): the grams equal X^T X / n over
every batch (tensors, dicts, tuples), nn.MultiheadAttention's q/k/v take its query/key/value,
batches stream (one alive at a time), and every bad input is a ConfigError that leaves the
model's hooks and modes as they were."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from torch import nn

from comera.errors import ConfigError
from comera.surgery.input_statistics import check_batches, collect_input_stats, gram_bytes

F64 = torch.float64


class TwoInputs(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(6, 5)
        self.b = nn.Linear(5, 3)
        self.drop = nn.Dropout(0.5)

    def forward(self, x, scale=1.0):
        return self.b(self.drop(torch.relu(self.a(x * scale))))


def _gram(rows: torch.Tensor) -> torch.Tensor:
    rows = rows.reshape(-1, rows.shape[-1]).to(F64)
    return rows.T @ rows / rows.shape[0]


def test_grams_are_the_inputs_second_moments_over_every_batch():
    torch.manual_seed(0)
    model = TwoInputs()
    batches = [torch.randn(4, 7, 6), torch.randn(3, 6)]
    stats, count = collect_input_stats(model, {"a": model.a, "b": model.b}, batches)
    assert count == 2
    xs = torch.cat([b.reshape(-1, 6) for b in batches])
    torch.testing.assert_close(stats["a"].gram, _gram(xs))
    assert stats["a"].rows == 31 and stats["a"].gram.dtype == F64
    model.eval()  # the statistics were taken in eval mode (dropout off)
    hidden = torch.relu(model.a(xs))
    torch.testing.assert_close(stats["b"].gram, _gram(hidden))


def test_dict_and_tuple_batches_are_keyword_and_positional_arguments():
    torch.manual_seed(0)
    model = TwoInputs()
    x = torch.randn(5, 6)
    by_dict, _ = collect_input_stats(model, {"a": model.a}, [{"x": x, "scale": 2.0}])
    by_tuple, _ = collect_input_stats(model, {"a": model.a}, [(x, 2.0)])
    torch.testing.assert_close(by_dict["a"].gram, _gram(2 * x))
    torch.testing.assert_close(by_tuple["a"].gram, _gram(2 * x))


def test_modes_and_hooks_are_restored():
    model = TwoInputs()
    model.train()
    model.b.eval()
    collect_input_stats(model, {"a": model.a}, [torch.randn(2, 6)])
    assert model.training and model.a.training and not model.b.training
    assert not model.a._forward_pre_hooks and not model.b._forward_pre_hooks
    with pytest.raises(ConfigError):
        collect_input_stats(model, {"a": model.a}, [torch.randn(2, 7)])
    assert model.training and not model.b.training and not model.a._forward_pre_hooks


@pytest.mark.parametrize(("batches", "match"), [
    ([], "no batches"),
    (torch.randn(4, 6), "one tensor of shape"),
    ({"x": torch.randn(4, 6)}, "calibration=\\[batch\\]"),
    (3, "iterable of batches"),
    ([torch.randn(2, 9)], "batch 0: the model rejected it"),
    (["text"], "batch 0 is a str"),
    ([torch.full((2, 6), float("nan"))], "NaN or infinite"),
])
def test_bad_calibration_is_a_config_error(batches, match):
    model = TwoInputs()
    with pytest.raises(ConfigError, match=match) as info:
        collect_input_stats(model, {"a": model.a}, batches)
    assert isinstance(info.value, ValueError)


def test_multihead_attention_projections_take_query_key_and_value():
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(8, 2, batch_first=True, kdim=4, vdim=6)
    q, k, v = torch.randn(2, 3, 8), torch.randn(2, 5, 4), torch.randn(2, 5, 6)
    names = {f"attn.{p}": mha for p in ("q_proj", "k_proj", "v_proj")}
    stats, _ = collect_input_stats(mha, names, [(q, k, v)])
    for part, x in (("q_proj", q), ("k_proj", k), ("v_proj", v)):
        torch.testing.assert_close(stats[f"attn.{part}"].gram, _gram(x))
    packed = nn.MultiheadAttention(8, 2, batch_first=True)
    x = torch.randn(2, 3, 8)
    stats, _ = collect_input_stats(packed, {"attn.in_proj": packed}, [{"query": x, "key": x,
                                                                       "value": x}], True)
    torch.testing.assert_close(stats["attn.in_proj"].gram, _gram(x))
    assert stats["attn.in_proj"].rows == 3 * 6


def test_batches_stream_one_at_a_time():
    """Memory does not grow with the number of batches: each batch can be freed once the next
    is asked for, and the statistics hold in_features^2 float64 values per layer."""
    model = TwoInputs()
    alive: list[weakref.ref] = []
    most = 0

    def batches():
        nonlocal most
        for _ in range(20):
            gc.collect()
            most = max(most, sum(r() is not None for r in alive))
            x = torch.randn(8, 6)
            alive.append(weakref.ref(x))
            yield x

    stats, count = collect_input_stats(model, {"a": model.a, "b": model.b}, batches())
    assert count == 20 and most <= 1
    assert gram_bytes([6, 5]) == 8 * (36 + 25)
    assert sum(s.gram.numel() * 8 for s in stats.values()) == gram_bytes([6, 5])


def test_unreached_layers_are_left_out():
    model = TwoInputs()
    spare = nn.Linear(6, 6)
    model.spare = spare  # never called by forward
    stats, _ = collect_input_stats(model, {"a": model.a, "spare": spare}, [torch.randn(2, 6)])
    assert set(stats) == {"a"}


def test_check_batches_passes_iterables_through():
    data = [torch.randn(2, 2)]
    assert check_batches(data) is data
    loader = torch.utils.data.DataLoader(torch.randn(10, 6), batch_size=4)
    model = TwoInputs()
    stats, count = collect_input_stats(model, {"a": model.a}, loader)
    assert count == 3 and stats["a"].rows == 10
