"""tncomp and comera on a device, in the ways users call them: exact in float64 against
torch.einsum, every memory mode, torch.autocast (bf16 and fp16), torch.compile with inductor
(which generates kernels around the tncomp operator), torch.func, and on CUDA also CUDA graphs
under a converted model, the allocator's view of the memory modes and the paper transformer's
step against the CPU. Each is compared with the float32 eager result on the same device.

The device-parametrized tests run on CUDA under ``pytest -m gpu`` (skipped without it) and on
the CPU under ``-m slow`` (the default run covers the CPU in the per-feature tests), so the
checks themselves are exercised on every machine."""

import pytest
import torch
from torch import nn

import comera
import tncomp
from comera.models.transformer import PairClassifier, TransformerConfig

NEEDS_CUDA = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
DEVICES = [pytest.param("cpu", marks=pytest.mark.slow), pytest.param("cuda", marks=NEEDS_CUDA)]
cuda_only = pytest.mark.parametrize("device", [pytest.param("cuda", marks=NEEDS_CUDA)])
on_devices = pytest.mark.parametrize("device", DEVICES)

LOW = {torch.bfloat16: dict(rtol=3e-2, atol=3e-2), torch.float16: dict(rtol=5e-3, atol=5e-3)}
NETWORKS = {
    "tt": lambda: tncomp.tt_linear((4, 6, 8), (8, 6, 4), 5),
    "ttm": lambda: tncomp.ttm_linear((4, 6, 8), (8, 6, 4), 5),
    "eq": lambda: tncomp.from_eq("bij,jk,kl->bil", ("B", 6, 7), (7, 5), (5, 9)),
}


def _operands(net, batch, device, dtype=torch.float64):
    gen = torch.Generator(device=device).manual_seed(0)
    shapes = [[batch if isinstance(s, tncomp.Dim) else s for s in net.shape(t)]
              for t in net.operands]
    return [torch.randn(*s, device=device, dtype=dtype, generator=gen).requires_grad_()
            for s in shapes]


def _eq(net):
    """The network as a torch.einsum equation (one letter per index name)."""
    letters: dict[str, str] = {}

    def term(t):
        return "".join(letters.setdefault(i, chr(97 + len(letters))) for i in t.indices)

    return ",".join(term(t) for t in net.operands) + "->" + term(net.output)


@on_devices
@pytest.mark.parametrize("name", sorted(NETWORKS))
@pytest.mark.parametrize("memory", ["fast", "balanced", "min"])
@pytest.mark.parametrize("batch", [1, 33, 600])
def test_float64_equals_einsum_forward_and_gradients(device, name, memory, batch):
    net = NETWORKS[name]()
    layer = tncomp.compile(net, memory=memory, disk_cache=False)
    ops = _operands(net, batch, device)
    got = layer(*ops)
    want = tncomp.contract(_eq(net), *[o.detach().cpu() for o in ops])  # planned, CPU
    ref = torch.einsum(_eq(net), *ops)
    torch.testing.assert_close(got, ref, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(got.cpu(), want, rtol=1e-10, atol=1e-10)
    dy = torch.randn_like(got)
    grads = torch.autograd.grad(got, ops, dy)
    ref_grads = torch.autograd.grad(ref, ops, dy)
    for g, r in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(g, r, rtol=1e-10, atol=1e-10)


@on_devices
def test_gradcheck_and_gradgradcheck(device):
    net = tncomp.tt_linear((2, 3), (3, 2), 2)
    layer = tncomp.compile(net, disk_cache=False)
    ops = _operands(net, 3, device)
    assert torch.autograd.gradcheck(layer, ops)
    assert torch.autograd.gradgradcheck(layer, ops)


def _mlp(device, seed=0, **convert):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64)).to(device)
    comera.convert_(model, comera.ConvertConfig(ranks=8, **convert))
    return model


def _grads(model):
    return [p.grad.detach().clone() for p in model.parameters()]


def _step(model, x, autocast_dtype=None):
    model.zero_grad(set_to_none=True)
    with torch.autocast(x.device.type, dtype=autocast_dtype or torch.bfloat16,
                        enabled=autocast_dtype is not None):
        out = model(x)
    out.float().square().mean().backward()
    return out, _grads(model)


@on_devices
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_autocast_runs_in_low_precision_and_keeps_float32_parameters(device, dtype):
    model = _mlp(device)
    x = torch.randn(128, 64, device=device)
    want, want_grads = _step(model, x)
    got, grads = _step(model, x, dtype)
    assert got.dtype == dtype
    torch.testing.assert_close(got.float(), want, **LOW[dtype])
    for p, g, w in zip(model.parameters(), grads, want_grads, strict=True):
        assert p.dtype == g.dtype == torch.float32
        scale = float(w.abs().max())
        torch.testing.assert_close(g, w, rtol=0.1, atol=0.1 * scale)


@on_devices
def test_fp16_training_with_grad_scaler_learns(device):
    model = _mlp(device)
    x = torch.randn(128, 64, device=device)
    with torch.no_grad():  # a teacher of the same form: the target is learnable
        target = _mlp(device, seed=1)(x)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler(device)
    losses = []
    for _ in range(30):
        opt.zero_grad(set_to_none=True)
        with torch.autocast(device, dtype=torch.float16):
            loss = (model(x).float() - target).square().mean()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        losses.append(float(loss.detach()))
    assert losses[-1] < 0.5 * losses[0]


@on_devices
@pytest.mark.parametrize("autocast_dtype", [None, torch.bfloat16])
def test_torch_compile_inductor_fullgraph_equals_eager(device, autocast_dtype):
    torch._dynamo.reset()
    model = _mlp(device)
    x = torch.randn(96, 64, device=device)
    want, want_grads = _step(model, x, autocast_dtype)
    compiled = torch.compile(model, fullgraph=True, backend="inductor")
    got, grads = _step(compiled, x, autocast_dtype)
    tol = LOW[autocast_dtype] if autocast_dtype else dict(rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(got, want, **tol)
    for g, w in zip(grads, want_grads, strict=True):
        torch.testing.assert_close(g, w, **tol)
    got2, _ = _step(compiled, torch.randn(40, 64, device=device), autocast_dtype)  # new batch
    assert got2.shape == (40, 64)


@on_devices
def test_torch_func_grad_and_vmap(device):
    model = _mlp(device)
    x = torch.randn(16, 64, device=device)
    params = {k: v.detach() for k, v in model.named_parameters()}

    def loss(p, x):
        return torch.func.functional_call(model, p, (x,)).square().mean()

    grads = torch.func.grad(loss)(params, x)
    _, want = _step(model, x)
    for (name, _), w in zip(model.named_parameters(), want, strict=True):
        torch.testing.assert_close(grads[name], w, rtol=1e-4, atol=1e-6)
    per_sample = torch.func.vmap(torch.func.grad(loss), in_dims=(None, 0))(params, x[:, None])
    mean = {k: v.mean(0) for k, v in per_sample.items()}
    for name in grads:
        torch.testing.assert_close(mean[name], grads[name], rtol=1e-4, atol=1e-6)


@cuda_only
@pytest.mark.parametrize("memory", ["fast", "min"])
def test_cuda_graphs_in_a_converted_model_equal_eager_over_training_steps(device, memory):
    eager, graphed = _mlp(device, memory=memory), _mlp(device, memory=memory)
    for _, layer in comera.gated_layers(graphed):
        layer.compile_options = {**layer.compile_options, "cuda_graphs": True}
        layer.build_compiled()
    opts = [torch.optim.SGD(m.parameters(), lr=1e-2) for m in (eager, graphed)]
    for step in range(4):
        x = torch.randn(64, 64, device=device, generator=torch.Generator(device).manual_seed(step))
        outs = []
        for model, opt in zip((eager, graphed), opts, strict=True):
            opt.zero_grad(set_to_none=True)
            out = model(x)
            out.square().mean().backward()
            opt.step()
            outs.append(out.detach())
        torch.testing.assert_close(outs[1], outs[0], rtol=1e-5, atol=1e-6)
    for p, q in zip(eager.parameters(), graphed.parameters(), strict=True):
        torch.testing.assert_close(q, p, rtol=1e-5, atol=1e-6)


@cuda_only
def test_memory_modes_save_less_on_the_device(device):
    """What a min-memory layer keeps for the backward, measured by the CUDA allocator."""
    net = tncomp.tt_linear((8, 8, 12), (12, 16, 16), 16)
    ops = [o.float().detach().requires_grad_() for o in _operands(net, 2048, device)]
    held = {}
    for memory in ("fast", "min"):
        layer = tncomp.compile(net, memory=memory, disk_cache=False)
        layer(*ops).sum().backward()  # plan and pool once
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        y = layer(*ops)
        held[memory] = torch.cuda.memory_allocated() - before - y.numel() * y.element_size()
        y.sum().backward()
        del y
    assert held["min"] < held["fast"]


@cuda_only
def test_transformer_training_step_on_cuda_equals_cpu(device):
    cfg = TransformerConfig.small(vocab_size=50)
    torch.manual_seed(0)
    cpu = PairClassifier(cfg)
    gpu = PairClassifier(cfg)
    gpu.load_state_dict(cpu.state_dict())
    gpu.to(device)
    cpu.eval()
    gpu.eval()
    ids = torch.randint(1, 50, (4, 12))
    losses = []
    for model, dev in ((cpu, "cpu"), (gpu, device)):
        out = model(ids.to(dev))
        loss = out.float().square().mean()
        loss.backward()
        losses.append(loss.detach().cpu())
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-4, atol=1e-5)
    for p, q in zip(cpu.parameters(), gpu.parameters(), strict=True):
        if p.grad is not None:
            torch.testing.assert_close(q.grad.cpu(), p.grad, rtol=1e-3, atol=1e-5)
