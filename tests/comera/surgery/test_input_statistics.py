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
from comera.surgery.input_statistics import (
    check_batches,
    collect_input_stats,
    gram_bytes,
    statistics_bytes,
)

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
    ([torch.randn(2, 9)], r"layer 'a' received an input of shape \(2, 9\); it takes "
                          r"\(\.\.\., 6\)"),
    ([(torch.randn(2, 6), 1.0, 3)], "batch 0: the model rejected it"),
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
    assert stats["attn.in_proj"].rows == 6  # one tensor as query, key and value: counted once
    q2 = torch.randn(2, 3, 8)  # three tensors: averaged
    stats, _ = collect_input_stats(packed, {"attn.in_proj": packed}, [(q2, x, 2 * x)], True)
    torch.testing.assert_close(stats["attn.in_proj"].gram, _gram(torch.cat([q2, x, 2 * x])))
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


# -- one statistic per distinct input; scale-free accumulation; memory stated and bounded -------
class Attention(nn.Module):
    """q/k/v fed one hidden state (as HF Llama's projections are), o fed another tensor;
    ``split=True`` feeds k a different tensor (the sharing stops)."""

    def __init__(self, width: int = 6):
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(width, width, dtype=F64) for _ in range(4))

    def forward(self, x, split=False):
        key = x * 2 if split else x
        return self.o(torch.tanh(self.q(x) + self.k(key) + self.v(x)))


def _names(model: Attention) -> dict:
    return {n: getattr(model, n) for n in "qkvo"}


def test_layers_fed_one_tensor_share_one_statistic():
    torch.manual_seed(0)
    model = Attention()
    batches = [torch.randn(5, 6, dtype=F64), torch.randn(3, 6, dtype=F64)]
    stats, _ = collect_input_stats(model, _names(model), batches)
    assert stats["q"] is stats["k"] is stats["v"] and stats["o"] is not stats["q"]
    xs = torch.cat(batches)
    torch.testing.assert_close(stats["q"].gram, _gram(xs), rtol=1e-13, atol=0)
    assert stats["q"].rows == 8  # one accumulation, not three
    assert statistics_bytes(stats) == gram_bytes([6, 6])  # two distinct inputs


def test_a_shared_statistic_splits_exactly_when_its_layers_stop_sharing():
    torch.manual_seed(0)
    model = Attention()
    x1, x2, x3 = (torch.randn(4, 6, dtype=F64) for _ in range(3))
    stats, _ = collect_input_stats(model, _names(model), [x1, (x2, True), x3])
    assert stats["q"] is stats["v"] and stats["k"] is not stats["q"]
    torch.testing.assert_close(stats["q"].gram, _gram(torch.cat([x1, x2, x3])), rtol=1e-12,
                               atol=1e-15)
    torch.testing.assert_close(stats["k"].gram, _gram(torch.cat([x1, 2 * x2, x3])), rtol=1e-12,
                               atol=1e-15)
    assert stats["k"].rows == 12


def test_memory_does_not_grow_with_the_number_of_batches():
    torch.manual_seed(0)
    model = Attention()
    one, _ = collect_input_stats(model, _names(model), [torch.randn(4, 6, dtype=F64)])
    many, _ = collect_input_stats(model, _names(model),
                                  (torch.randn(4, 6, dtype=F64) for _ in range(50)))
    assert statistics_bytes(one) == statistics_bytes(many) == gram_bytes([6, 6])
    assert many["q"].moments.shape == (6, 6) and many["q"].rows == 200


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, F64])
@pytest.mark.parametrize("scale", [1e20, 1e-25])
def test_no_finite_input_overflows_or_underflows(dtype, scale):
    """A 1e20 or 1e-25 activation gives the same second moments, relative to its scale, as a
    1.0 one (float16 cannot hold either: it is scaled to the ends of its own range)."""
    gen = torch.Generator().manual_seed(0)
    base = torch.randn(64, 6, generator=gen, dtype=F64)
    if dtype == torch.float16:
        scale = 2.0**-10 if scale < 1 else 2.0**12  # normal float16 values
    layer = nn.Linear(6, 3).to(dtype)
    ref, _ = collect_input_stats(layer, {"l": layer}, [base.to(dtype)])
    got, _ = collect_input_stats(layer, {"l": layer}, [(base * scale).to(dtype)])
    x = (base * scale).to(dtype).to(F64)
    truth = _gram(x / scale)  # the inputs as stored, brought back to scale 1 in float64
    moments = got["l"].moments * 4.0 ** got["l"].exponent / scale**2
    rtol = {torch.float16: 1e-6, torch.bfloat16: 1e-6, torch.float32: 1e-6, F64: 1e-13}[dtype]
    torch.testing.assert_close(moments, truth, rtol=rtol, atol=rtol * float(truth.abs().max()))
    assert torch.isfinite(got["l"].moments).all() and got["l"].moments.abs().max() > 0
    torch.testing.assert_close(got["l"].moments / got["l"].moments.abs().max(),
                               ref["l"].moments / ref["l"].moments.abs().max(),
                               rtol=1e-6, atol=1e-2 if dtype in (torch.float16,
                                                                 torch.bfloat16) else 1e-6)


def test_over_the_limit_is_refused_before_the_first_statistic():
    torch.manual_seed(0)
    model = Attention(8)
    batches = [torch.randn(4, 8, dtype=F64)]
    unshared, shared = gram_bytes([8] * 4), gram_bytes([8, 8])
    with pytest.raises(ConfigError, match=r"calibration needs 0\.0 MiB .* over "
                                          r"statistics_memory=1,000 bytes") as info:
        collect_input_stats(model, _names(model), batches, limit=1000)
    assert "widest" in str(info.value)
    assert not model.q._forward_pre_hooks and model.training  # hooks removed, mode restored
    # between the shared need and the unshared bound: the probe finds the sharing, and it runs
    stats, _ = collect_input_stats(model, _names(model), batches, limit=(shared + unshared) // 2)
    assert statistics_bytes(stats) == shared
    with pytest.raises(ConfigError, match="statistics_memory"):
        collect_input_stats(model, _names(model), batches, limit=shared - 1)


def test_running_out_of_memory_is_said_as_such():
    class Hungry(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x):
            self.fc(x)
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")

    model = Hungry()
    with pytest.raises(ConfigError, match=r"batch 0: out of memory \(OutOfMemoryError: CUDA out "
                                          r"of memory.*MiB of input statistics held") as info:
        collect_input_stats(model, {"fc": model.fc}, [torch.randn(2, 4)])
    assert "rejected" not in str(info.value)


def test_a_misspelled_key_names_the_keys_given():
    model = TwoInputs()
    with pytest.raises(ConfigError, match=r"keys: \['x', 'scal'\]; \['scal'\] are not arguments "
                                          r"of TwoInputs\.forward \(it takes \['x', 'scale'\]\)\. "
                                          r"Did you mean 'scale' for 'scal'\?"):
        collect_input_stats(model, {"a": model.a}, [{"x": torch.randn(2, 6), "scal": 2.0}])
