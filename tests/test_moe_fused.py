"""lmfs.kernels.moe (the fused, atomic-free sorted dispatch) against the loop dispatch of lmfs.nn.moe.

Without a GPU the kernels run in Triton's interpreter: small shapes, widths that are not multiples
of the interpreter's 16-wide blocks, ragged and empty expert groups, dropped assignments.
"""

import copy

import pytest
import torch
from helpers import DEVICE, model_of, tiny

from lmfs.kernels.moe import FusedMoE, _combine, fused_routing, slot_table, use_fused_moe
from lmfs.nn.moe import MoE, ROUTERS, Router, device_balance_loss, router_z_loss, switch_loss

D, F_, E = 20, 24, 4


def layers(router="softmax_topk", top_k=2, seed=0, **kwargs):
    """The same layer twice: the loop dispatch (the reference) and the fused one."""
    torch.manual_seed(seed)
    loop = MoE(D, F_, E, top_k, router=router, dispatch="loop", **kwargs).to(DEVICE)
    fused = use_fused_moe(copy.deepcopy(loop))
    fused.dispatch = "sorted"
    return loop, fused


def run(layer, x, ids, dtype=None):
    """Output, input gradient and parameter gradients of ``<layer(x), ramp>``."""
    if dtype is not None:
        layer = layer.to(dtype)
        x = x.to(dtype)
    x = x.clone().requires_grad_()
    y = layer(x, ids)
    (y.float() * torch.linspace(-1, 1, y.numel(), device=y.device).view_as(y)).sum().backward()
    return y.float(), x.grad.float(), {n: p.grad.float() for n, p in layer.named_parameters() if p.grad is not None}


def inputs(N=24, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(N, D, generator=g).to(DEVICE), torch.randint(100, (N,), generator=g).to(DEVICE)


def assert_same(got, want, atol):
    (y1, gx1, g1), (y2, gx2, g2) = got, want
    torch.testing.assert_close(y1, y2, atol=atol, rtol=0)
    torch.testing.assert_close(gx1, gx2, atol=atol, rtol=0)
    assert g1.keys() == g2.keys()
    for name in g1:
        torch.testing.assert_close(g1[name], g2[name], atol=atol, rtol=0, msg=name)


# What differs for the fused kernels is the layout, not how weights were computed: full top-k
# slots, slots emptied by dropping, a varying number of experts per token (expert choice), hashing.
CASES = [("softmax_topk", None), ("topk_softmax", 0.75), ("sigmoid", None), ("expert_choice", None),
         ("expert_choice", 0.5), ("hash", 0.75)]


def test_cases_cover_every_router():
    assert {router for router, _ in CASES} == set(ROUTERS)


@pytest.mark.parametrize("router,capacity_factor", CASES)
def test_fused_dispatch_matches_the_loop_forward_and_backward(router, capacity_factor):
    loop, fused = layers(router, capacity_factor=capacity_factor, n_shared=1)
    x, ids = inputs()
    assert_same(run(fused, x, ids), run(loop, x, ids), atol=1e-4)
    if capacity_factor is not None and router != "expert_choice":
        assert int(fused.stats["dropped"]) > 0  # dropped assignments leave empty slots


def test_fused_dispatch_with_empty_experts_and_top_1():
    """Three tokens, top-1 over four experts: at least one expert gets no rows."""
    loop, fused = layers(top_k=1)
    x, ids = inputs(N=3)
    assert_same(run(fused, x, ids), run(loop, x, ids), atol=1e-4)
    assert (fused.stats["kept"] == 0).any()


def test_fused_dispatch_in_float16():
    """16-bit operands, float32 accumulation: close to the float32 loop."""
    loop, fused = layers(n_shared=1)
    x, ids = inputs()
    want = run(loop, x, ids)
    got = run(fused, x, ids, dtype=torch.float16)
    for a, b in zip(got[:2], want[:2]):
        torch.testing.assert_close(a, b, atol=3e-2, rtol=3e-2)
    for name in want[2]:
        torch.testing.assert_close(got[2][name], want[2][name], atol=5e-2, rtol=3e-2, msg=name)


@pytest.mark.parametrize("N", [1, 17, 40])
def test_fused_dispatch_token_counts_off_the_blocks_with_dropping(N):
    """Token counts below, between and above the kernels' 16-row blocks, with assignments dropped."""
    loop, fused = layers(capacity_factor=0.6, n_shared=1)
    x, ids = inputs(N=N, seed=N)
    assert_same(run(fused, x, ids), run(loop, x, ids), atol=1e-4)
    if N > 1:
        assert int(fused.stats["dropped"]) > 0


def random_layout(T, slots, D, seed=0):
    """y (A, D) and a slot table for T tokens: a quarter of the slots empty (-1), the used ones a
    random permutation of the A sorted positions."""
    g = torch.Generator().manual_seed(seed)
    used = torch.rand(T, slots, generator=g) > 0.25
    A = int(used.sum())
    slot_pos = torch.full((T, slots), -1, dtype=torch.int32)
    slot_pos[used] = torch.randperm(A, generator=g).int()
    return torch.randn(A, D, generator=g).to(DEVICE), slot_pos.to(DEVICE)


@pytest.mark.parametrize("base_dtype", [None, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T,slots,D", [(1, 2, 20), (16, 3, 48), (37, 1, 20), (37, 8, 33)])
def test_combine_kernel_matches_a_loop_over_slots(T, slots, D, base_dtype):
    """The combine against PyTorch indexing; T and D on and off the kernel's blocks, empty
    slots, top-1 up to top-8; without a base, and with one (the shared experts' output) in the
    output's dtype or in bfloat16."""
    y, slot_pos = random_layout(T, slots, D, seed=T + D)
    base = None
    want = torch.zeros(T, D, device=y.device)
    if base_dtype is not None:
        base = torch.randn(T, D, generator=torch.Generator().manual_seed(T)).to(DEVICE, base_dtype)
        want = base.float().clone()  # not base itself: want is added to in place
    for j in range(slots):
        used = slot_pos[:, j] >= 0
        want[used] += y[slot_pos[used, j].long()]
    torch.testing.assert_close(_combine(y, slot_pos, torch.float32, base=base), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("router,capacity_factor", [("softmax_topk", None), ("sigmoid", 0.75)])
def test_fused_routing_weight_gradient_matches_autograd(router, capacity_factor):
    """The routing weights' gradient (the input-gradient kernel's row sums) on its own: the
    router's weight gradient is nothing else, so compare it alone with a tighter tolerance,
    with dropped assignments in the second case."""
    loop, fused = layers(router, capacity_factor=capacity_factor)
    x, ids = inputs(N=33, seed=3)
    got, want = run(fused, x, ids)[2], run(loop, x, ids)[2]
    assert want["router.proj.weight"].abs().max() > 1e-3  # a gradient worth comparing
    torch.testing.assert_close(got["router.proj.weight"], want["router.proj.weight"], atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("kind", ["softmax_topk", "topk_softmax"])
@pytest.mark.parametrize("N,d,E,k,losses", [(37, 20, 6, 2, True), (16, 40, 20, 3, True), (37, 20, 6, 2, False)])
def test_fused_router_matches_the_router_with_its_losses(kind, N, d, E, k, losses):
    """One kernel for the router against :class:`lmfs.nn.moe.Router` (float32 matmul, softmax,
    topk): the same assignments, weights, probabilities and logits, and through a loss that uses
    the weights and every balancing loss (or the weights alone), the same gradients for x and the
    router's weight. Shapes off the kernel's blocks (tokens, d_model, experts not multiples of 16)."""
    torch.manual_seed(0)
    router = Router(d, E, k, kind).to(DEVICE)
    x = torch.randn(N, d, device=DEVICE)
    ramp = torch.linspace(-1, 1, N * k, device=DEVICE)
    results = []
    for route in (lambda x: router(x), lambda x: fused_routing(router, x)):
        router.zero_grad()
        xg = x.clone().requires_grad_()
        r = route(xg)
        load = torch.bincount(r.expert, minlength=E)
        loss = (r.weight * ramp).sum()
        if losses:
            loss = loss + switch_loss(r.probs, load) + device_balance_loss(r.probs, load, 2) + router_z_loss(r.logits)
        loss.backward()
        results.append((r, xg.grad, router.proj.weight.grad.clone()))
    (got, gx, gw), (want, wx, ww) = results[1], results[0]
    assert torch.equal(got.token, want.token) and torch.equal(got.expert, want.expert)
    assert torch.equal(got.load, torch.bincount(want.expert, minlength=E))   # counted by the kernel
    for name in ("weight", "probs", "logits"):
        torch.testing.assert_close(getattr(got, name), getattr(want, name), atol=1e-6, rtol=1e-5, msg=name)
    torch.testing.assert_close(gx, wx, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(gw, ww, atol=1e-6, rtol=1e-5)


def test_slot_table_choice_major_equals_the_sorted_slots():
    """Token choice with nothing dropped: the slots read off the assignment order equal the
    general construction's (which sorts the assignments by token)."""
    g = torch.Generator().manual_seed(0)
    N, E, k = 50, 7, 3
    expert = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(N)]).T.reshape(-1)
    token, weight = torch.arange(N).repeat(k), torch.rand(N * k, generator=g)
    general, fast = slot_table(token, expert, weight, N, E, k), slot_table(token, expert, weight, N, E, k, True)
    for a, b in zip(general, fast):
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match="choice_major"):
        slot_table(token[:-1], expert[:-1], weight[:-1], N, E, k, True)


def test_slot_table_by_hand():
    """Tokens 0..2, assignments (token, expert): (0,2) (1,0) (2,2) (0,1) (2,0); sorted by expert
    (stably): (1,0) (2,0) (0,1) (0,2) (2,2) at positions 0..4."""
    token, expert = torch.tensor([0, 1, 2, 0, 2]), torch.tensor([2, 0, 2, 1, 0])
    weight = torch.tensor([0.5, 1.0, 0.25, 0.125, 0.75])
    rows, offsets, slot_pos, row_weight = slot_table(token, expert, weight, 3, 3, 2)
    assert rows.tolist() == [1, 2, 0, 0, 2] and offsets.tolist() == [0, 2, 3, 5]
    assert slot_pos.tolist() == [[3, 2], [0, -1], [4, 1]]
    assert row_weight.tolist() == [1.0, 0.75, 0.125, 0.5, 0.25]


def test_use_fused_moe_on_a_model_keeps_its_function():
    model = model_of(tiny(n_layers=1, moe_experts=4, moe_top_k=2, moe_expert_dim=24, moe_shared_experts=1)).to(DEVICE)
    idx = torch.randint(0, 50, (2, 16), generator=torch.Generator().manual_seed(1)).to(DEVICE)
    reference = copy.deepcopy(model)
    want_loss = reference(idx, idx)[1]
    want_loss.backward()

    assert use_fused_moe(model) is model and type(model.moe_layers()[0]) is FusedMoE
    loss = model(idx, idx)[1]
    loss.backward()
    torch.testing.assert_close(loss, want_loss, atol=1e-5, rtol=1e-5)
    assert model.state_dict().keys() == reference.state_dict().keys()
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, atol=1e-5, rtol=1e-4, msg=name)

    use_fused_moe(model, enabled=False)
    assert type(model.moe_layers()[0]) is MoE
    with pytest.raises(ValueError, match="holds no lmfs.nn.moe.MoE"):
        use_fused_moe(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="SwiGLU experts"):
        use_fused_moe(MoE(D, F_, E, 2, activation="geglu"))


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the benchmark is a benchmark, not a test")
def test_moe_benchmark_times_the_fused_path_on_cpu(capsys):
    from lmfs.benchmarks.moe import main

    result = main(["--device", "cpu", "--tokens", "6", "--repeats", "1", "--no-hf", "--profile"])
    assert result["rows"]["lmfs fused"]["max_abs_diff"] < 1e-4
    assert result["ratios"]["lmfs fused / loop"] > 0 and "lmfs fused TFLOP/s / dense" in result["ratios"]
    out = capsys.readouterr().out
    assert "lmfs fused / loop" in out and "profile of lmfs fused" in out


@pytest.mark.gpu
def test_fused_dispatch_bf16_at_benchmark_width_on_gpu():
    """The compiled, autotuned kernels in bfloat16 at the benchmark's widths (fewer tokens),
    against the loop dispatch in float32 on the same weights: forward and every gradient."""
    torch.manual_seed(0)
    loop = MoE(1024, 512, 64, 8, n_shared=1, dispatch="loop").cuda()
    with torch.no_grad():  # bf16-representable weights: both layers route the same way
        for p in loop.parameters():
            p.copy_(p.bfloat16().float())
    fused = use_fused_moe(copy.deepcopy(loop)).to(torch.bfloat16)
    fused.dispatch = "sorted"
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2048, 1024, generator=g).cuda()
    got, want = run(fused, x.bfloat16(), None), run(loop, x.bfloat16().float(), None)
    for name, a, b in [("out", got[0], want[0]), ("dx", got[1], want[1])] + [
            (n, got[2][n], want[2][n]) for n in want[2]]:
        scale = b.abs().max().item()
        assert (a - b).abs().max().item() <= 3e-2 * scale, name
