"""comera.convert_: replace nn.Linear / nn.Embedding by TT layers, in place."""

from __future__ import annotations

import re
import warnings

import pytest
import torch
from torch import nn

import comera
from comera import ConvertConfig, TTEmbedding, TTLinear, TTMLinear
from comera.formats.bond_ranks import FullRankWarning

F64 = torch.float64


class Attn(nn.Module):
    def __init__(self):
        super().__init__()
        self.q = nn.Linear(16, 16, dtype=F64)
        self.k = nn.Linear(16, 16, dtype=F64)
        self.v = nn.Linear(16, 16, bias=False, dtype=F64)


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(20, 16, padding_idx=0, dtype=F64)
        self.attn = Attn()
        self.ffn = nn.Sequential(nn.Linear(16, 24, dtype=F64), nn.ReLU(),
                                 nn.Linear(24, 16, dtype=F64))
        self.head = nn.Linear(16, 4, dtype=F64)

    def forward(self, ids):
        h = self.emb(ids)
        h = h + self.attn.q(h) * torch.tanh(self.attn.k(h)) + self.attn.v(h)
        return self.head(h + self.ffn(h))


LINEAR_NAMES = ["attn.q", "attn.k", "attn.v", "ffn.0", "ffn.2", "head"]


def _ids():
    return torch.tensor([[0, 3, 19, 7], [5, 5, 0, 11]])


@pytest.mark.parametrize("fmt", ["tt", "ttm"])
def test_full_rank_sequential_outputs_unchanged(fmt):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(12, 10, dtype=F64), nn.ReLU(), nn.Linear(10, 6, dtype=F64))
    x = torch.randn(5, 12, dtype=F64)
    with torch.no_grad():
        y = model(x)
    report = comera.convert_(model, ranks=10**6, format=fmt)
    cls = TTLinear if fmt == "tt" else TTMLinear
    assert isinstance(model[0], cls) and isinstance(model[2], cls)
    assert isinstance(model[1], nn.ReLU)
    assert [r.name for r in report.layers] == ["0", "2"]
    assert [r.kind for r in report.layers] == [cls.__name__] * 2
    assert [r.shape for r in report.layers] == [(12, 10), (10, 6)]
    assert report.before == 12 * 10 + 10 + 10 * 6 + 6
    assert report.after == sum(m.num_parameters() for m in (model[0], model[2]))
    with torch.no_grad():
        torch.testing.assert_close(model(x), y, rtol=1e-9, atol=1e-10)


def test_full_rank_with_embedding_outputs_unchanged():
    torch.manual_seed(1)
    model = Model()
    ids = _ids()
    with torch.no_grad():
        y = model(ids)
    report = comera.convert_(model, ranks=10**6, embedding=True)
    assert isinstance(model.emb, TTEmbedding)
    assert model.emb.padding_idx == 0
    assert [r.name for r in report.layers] == ["emb", *LINEAR_NAMES]
    assert report.layers[0].kind == "TTEmbedding" and report.layers[0].shape == (20, 16)
    with torch.no_grad():
        torch.testing.assert_close(model(ids), y, rtol=1e-9, atol=1e-10)
    assert not any(isinstance(m, nn.Linear | nn.Embedding) for m in model.modules())


def test_embedding_false_leaves_embeddings():
    model = Model()
    report = comera.convert_(model, ranks=2)
    assert type(model.emb) is nn.Embedding
    assert [r.name for r in report.layers] == LINEAR_NAMES
    assert all(r.kind == "TTLinear" for r in report.layers)


def test_include_exclude_select_modules():
    model = Model()
    report = comera.convert_(model, include=["attn.*", "ffn.*"], exclude=["attn.k", "*.2"],
                             ranks=2)
    assert [r.name for r in report.layers] == ["attn.q", "attn.v", "ffn.0"]
    assert isinstance(model.attn.q, TTLinear) and isinstance(model.attn.v, TTLinear)
    assert isinstance(model.ffn[0], TTLinear)
    assert type(model.attn.k) is nn.Linear
    assert type(model.ffn[2]) is nn.Linear
    assert type(model.head) is nn.Linear
    assert model.attn.v.bias is None and model.attn.q.bias is not None
    # only linear=False, embedding=True: just the embedding
    model = Model()
    report = comera.convert_(model, linear=False, embedding=True, ranks=2)
    assert [(r.name, r.kind) for r in report.layers] == [("emb", "TTEmbedding")]
    assert type(model.head) is nn.Linear


def test_ranks_dict_first_match_wins():
    model = Model()
    report = comera.convert_(model, ranks={"attn.*": 2, "ffn.0": 3, "*": 1})
    expected = {"attn.q": 2, "attn.k": 2, "attn.v": 2, "ffn.0": 3, "ffn.2": 1, "head": 1}
    for r in report.layers:
        layer = model.get_submodule(r.name)
        assert max(layer.bonds) == expected[r.name], r.name
        assert r.ranks == layer.ranks


def test_format_dict_first_match_wins():
    model = Model()
    report = comera.convert_(model, ranks=2, format={"attn.*": "ttm", "*": "tt"})
    kinds = {r.name: (r.kind, r.format) for r in report.layers}
    assert kinds == {name: ("TTMLinear", "ttm") if name.startswith("attn.") else
                     ("TTLinear", "tt") for name in LINEAR_NAMES}
    assert "ttm" in str(report).splitlines()[2].split()


def test_format_dict_without_match_raises_before_any_swap():
    model = Model()
    with pytest.raises(comera.ConfigError, match=re.escape("no format pattern matches layer")):
        comera.convert_(model, ranks=2, format={"attn.*": "ttm"})
    assert type(model.head) is nn.Linear and type(model.attn.q) is nn.Linear


def test_an_unknown_format_names_the_registered_ones():
    from comera.formats.registry import format_names, get_format

    convertible = [n for n in format_names() if get_format(n).from_modes]
    with pytest.raises(comera.ConfigError, match=re.escape(", ".join(convertible))):
        ConvertConfig(format="tucker2")


def test_ranks_dict_without_match_raises():
    pattern = re.escape("no ranks pattern matches layer 'attn.q'")
    with pytest.raises(comera.ConfigError, match=pattern):
        comera.convert_(Model(), ranks={"ffn.*": 2})


def test_modes_per_layer():
    model = Model()
    report = comera.convert_(model, include=["ffn.0"], ranks=2,
                             modes={"ffn.0": ((4, 4), (4, 6))})
    assert model.ffn[0].in_modes == (4, 4) and model.ffn[0].out_modes == (4, 6)
    assert report.layers[0].modes == ((4, 4), (4, 6))


@pytest.mark.parametrize("fmt", ["tt", "ttm"])
@pytest.mark.parametrize("target", [2.0, 5.0])
def test_target_compression_bounds_each_layer(fmt, target):
    torch.manual_seed(2)
    model = nn.Sequential(nn.Linear(64, 96, dtype=F64), nn.ReLU(),
                          nn.Linear(96, 64, bias=False, dtype=F64))
    report = comera.convert_(model, target_compression=target, format=fmt)
    cls = TTLinear if fmt == "tt" else TTMLinear
    for r, idx in zip(report.layers, (0, 2), strict=True):
        layer = model[idx]
        dense = layer.in_features * layer.out_features
        assert layer.num_parameters(effective=True) <= dense / target
        assert r.after <= r.before / target
        # the largest such max rank: one more exceeds the budget (or reaches no new bond)
        bigger = cls(layer.in_features, layer.out_features, layer.in_modes, layer.out_modes,
                     max(layer.bonds) + 1, layer.bias is not None)
        assert (bigger.num_parameters() > dense / target or bigger.bonds == layer.bonds)


def test_target_compression_embedding():
    model = nn.Sequential(nn.Embedding(64, 16, dtype=F64))
    report = comera.convert_(model, linear=False, embedding=True, target_compression=4.0)
    assert model[0].num_parameters() <= 64 * 16 / 4.0
    assert report.after <= report.before / 4.0


def test_report_str_table():
    report = comera.convert_(Model(), ranks=2, embedding=True)
    text = str(report)
    lines = text.splitlines()
    assert lines[0].split()[:4] == ["layer", "type", "format", "shape"]
    assert set(lines[1]) == {"-"}
    for name in ["emb", *LINEAR_NAMES]:
        assert any(line.startswith(name + " ") for line in lines), name
    assert lines[-1].startswith("total")
    assert f"{report.before:,}" in lines[-1] and f"{report.after:,}" in lines[-1]
    assert f"{report.before / report.after:.1f}x" in lines[-1]
    assert len(lines) == 2 + 7 + 1


def test_no_match_raises_with_searched_names():
    model = Model()
    with pytest.raises(comera.ConversionError) as info:
        comera.convert_(model, include=["decoder.*"])
    message = str(info.value)
    for name in LINEAR_NAMES:
        assert name in message
    assert "decoder.*" in message
    assert isinstance(info.value, ValueError)
    assert type(model.head) is nn.Linear  # nothing was touched


def test_config_and_overrides_together_raise():
    with pytest.raises(comera.ConfigError, match="either a ConvertConfig or keyword"):
        comera.convert_(Model(), ConvertConfig(), ranks=2)


# -- every field validated up front; oversized ranks said, naming the layer ----------------------
BAD_FIELDS = [
    ("include", 3), ("include", [1]), ("exclude", None),
    ("linear", 1), ("embedding", "yes"),
    ("ranks", "16"), ("ranks", 0), ("ranks", -4), ("ranks", 2.5), ("ranks", True),
    ("ranks", {"*": "16"}), ("ranks", {3: 16}), ("ranks", {}),
    ("target_compression", 1.0), ("target_compression", float("nan")),
    ("target_compression", float("inf")), ("target_compression", "10"),
    ("d", 0), ("d", 2.0), ("d", True), ("d", 10**300), ("d", 65),
    ("tau", -1e-3), ("tau", float("nan")), ("tau", float("inf")), ("tau", "0.01"),
    ("format", "nope"), ("format", {"*": "nope"}), ("format", {}), ("format", 3),
    ("modes", [(4, 4)]), ("modes", {"fc": (4, 4)}),
    ("modes", {"fc": ([4, 0], [4, 4])}),
    ("attention_in_proj", "fused"), ("memory", "tiny"), ("memory", -1),
    ("parametrization", "mup"), ("parametrization", None),
    ("allocation", "greedy"), ("allocation", None),
    ("target_size", 0), ("target_size", 2.5), ("target_size", 100),  # 100: needs "global"
    ("damping", 0), ("damping", -1.0), ("damping", float("nan")),
    ("damping", 10**400), ("target_compression", 10**400), ("target_size", 10**400),
    ("statistics_memory", 0), ("statistics_memory", 2.5), ("statistics_memory", 10**400),
    ("statistics_memory", True),
    ("floor", "best"), ("floor", 1), ("floor", "measured"),  # measured: needs "global"
    ("closed_form_refit", 1), ("closed_form_refit", "yes"),
]


@pytest.mark.parametrize(("field", "value"), BAD_FIELDS)
def test_convert_config_refuses_each_bad_field_naming_it(field, value):
    with pytest.raises(comera.ConfigError, match=re.escape(f"{field}=")) as info:
        ConvertConfig(**{field: value})
    assert isinstance(info.value, ValueError)


def test_convert_config_covers_every_field():
    assert {f for f, _ in BAD_FIELDS} == set(ConvertConfig.__dataclass_fields__)


def test_a_single_pattern_string_is_one_pattern():
    assert ConvertConfig(include="fc*").include == ("fc*",)


def test_a_rank_past_the_full_rank_warns_naming_the_layer():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 512))
    with pytest.warns(UserWarning,
                      match=r"full rank .*\b0 \(tt rank 100000 >= full 16") as record:
        report = comera.convert_(model, ranks=100_000, d=2)
    text = str(record[0].message)
    assert "below 1x" in text and "0 (" in text
    assert report.after > report.before  # what the warning is about


def test_a_compressing_conversion_does_not_warn():
    import warnings

    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        comera.convert_(model, ranks=4)


def test_comera_convert_with_a_huge_rank_warns_naming_the_layer(tmp_path):
    from tests.comera.test_cli import run_cli

    torch.manual_seed(0)
    torch.save(nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 512)),
               tmp_path / "model.pt")
    result = run_cli("convert", str(tmp_path / "model.pt"), "-o", str(tmp_path / "tt.pt"),
                     "--set", "ranks=100000", "--set", "d=2")
    assert result.returncode == 0, result.stderr
    assert "full rank" in result.stderr and "below 1x" in result.stderr
    assert "0 (tt rank 100000" in result.stderr


def test_a_nan_weight_is_refused_naming_the_layer_before_any_swap():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 24), nn.ReLU(), nn.Linear(24, 8))
    with torch.no_grad():
        model[2].weight[3, 5] = float("nan")
    with pytest.raises(comera.ConversionError, match=r"^2\.weight: .*1 NaN or infinite weight"):
        comera.convert_(model, ranks=4)
    assert type(model[0]) is nn.Linear and type(model[2]) is nn.Linear  # nothing was swapped


@pytest.mark.parametrize("ranks", [4, {"nothing.*": 2}])
def test_ranks_and_a_target_compression_together_are_refused(ranks):
    """Issue 34, item 13: both used to be taken, the target silently winning."""
    model = nn.Sequential(nn.Linear(64, 64, dtype=F64))
    with pytest.raises(comera.ConfigError, match=r"ranks=.* and target_compression=10.*give one"):
        comera.convert_(model, ranks=ranks, target_compression=10)
    assert type(model[0]) is nn.Linear
    report = comera.convert_(model, target_compression=4.0)  # the target alone: it decides
    assert report.after <= report.before / 4.0  # the bias counted on both sides


def test_a_layer_asked_for_more_rank_than_it_holds_warns_as_convert_does():
    """Issue 34, item 13: GatedLinear(ranks=10000) clipped silently where convert_ warns."""
    with pytest.warns(FullRankWarning, match=r"TTLinear: ranks=10000 reaches the full rank"):
        TTLinear(16, 16, (4, 4), (4, 4), 10000)
    with pytest.warns(FullRankWarning, match=r"GatedLinear: ranks=10000 .* tucker layout"):
        comera.GatedLinear(16, 16, "tucker", ranks=10000)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        TTLinear(16, 16, (4, 4), (4, 4), 3)  # below the caps: nothing to say
    model = nn.Sequential(nn.Linear(16, 16))
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        comera.convert_(model, ranks=10000, d=2)
    assert len(said) == 1 and "reaches the full rank of 1 layer" in str(said[0].message)


# -- issue 42: one clear error for numbers too large, misspelled options, dropped ranks ----------
@pytest.mark.parametrize(("field", "value"), [
    ("damping", 10**400), ("target_compression", 10**400), ("target_size", 10**400)])
def test_a_number_too_large_for_a_float_is_one_short_config_error(field, value):
    options = {field: value, **({"allocation": "global"} if field == "target_size" else {})}
    with pytest.raises(comera.ConfigError, match=f"{field}=<an int of 401 digits>") as info:
        ConvertConfig(**options)
    assert len(str(info.value)) < 300


def test_ranks_with_a_global_target_are_refused_naming_both():
    with pytest.raises(comera.ConfigError, match=r"ranks=4 and allocation='global' "
                                                 r"\(target_size=5000\)"):
        ConvertConfig(ranks=4, allocation="global", target_size=5000)


def test_a_misspelled_option_lists_the_known_names():
    model = nn.Sequential(nn.Linear(16, 16))
    with pytest.raises(comera.ConfigError, match=r"target_compresion \(did you mean "
                                                 r"target_compression\?\); known: .*damping"):
        comera.convert_(model, target_compresion=2)
    assert type(model[0]) is nn.Linear


def test_an_unreachable_uniform_target_is_refused_naming_the_largest_reachable():
    """As the global allocation refuses a budget below rank 1, so does the uniform one (it
    warned and built rank-1 layers that missed the target), naming the largest target every
    layer reaches; the model is left as it was."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 16))
    state = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(comera.ConfigError, match=r"target_compression=50 cannot be reached: 2 "
                                                 r"layer\(s\).*largest target every layer "
                                                 r"reaches is (\d+\.?\d*)") as info:
        comera.convert_(model, target_compression=50, d=2)
    assert all(type(m) is nn.Linear for m in (model[0], model[2]))
    assert all(torch.equal(model.state_dict()[k], v) for k, v in state.items())
    reach = float(re.search(r"reaches is (\d+(?:\.\d+)?)", str(info.value)).group(1))
    report = comera.convert_(model, target_compression=reach * 0.999, d=2)  # reachable: built
    assert all(all(r == 1 for r in layer.ranks) for layer in report.layers)
    assert report.before / report.after >= reach * 0.999


def test_an_unreachable_global_target_names_the_largest_reachable():
    model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 16))
    with pytest.raises(comera.ConfigError, match=r"cannot be met.*largest target they reach "
                                                 r"is \d"):
        comera.convert_(model, target_compression=50, d=2, allocation="global")
    assert type(model[0]) is nn.Linear
