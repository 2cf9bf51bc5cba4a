"""lmfs.nn.moe: routers, dispatch, balancing, capacity, upcycling, and MoE models with their accounting."""

import copy
import math

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from lmfs.accounting import flops_per_token, matmul_params, param_count
from lmfs.nn import GatedMLP, Linear, TransformerConfig, TransformerLM, count_params
from lmfs.nn.moe import MoE, ROUTERS, bin_counts, capacity, device_balance_loss, router_z_loss, switch_loss, upcycle

D, F_, E = 16, 24, 4


def moe(router="softmax_topk", top_k=2, seed=0, **kwargs) -> MoE:
    torch.manual_seed(seed)
    return MoE(D, F_, E, top_k, router=router, **kwargs)


def inputs(N=24, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(N, D, generator=g), torch.randint(100, (N,), generator=g)


@pytest.mark.parametrize("capacity_factor", [None, 0.75])
@pytest.mark.parametrize("router", ROUTERS)
def test_loop_and_sorted_dispatch_agree_forward_and_backward(router, capacity_factor):
    sorted_moe = moe(router, capacity_factor=capacity_factor, n_shared=1)
    loop_moe = copy.deepcopy(sorted_moe)
    loop_moe.dispatch = "loop"
    x, ids = inputs()
    outs = []
    for layer in (sorted_moe, loop_moe):
        xi = x.clone().requires_grad_()
        y = layer(xi, ids)
        (y * torch.linspace(-1, 1, y.numel()).view_as(y)).sum().backward()
        outs.append((y, xi.grad, {n: p.grad for n, p in layer.named_parameters()}))
    (y1, gx1, g1), (y2, gx2, g2) = outs
    torch.testing.assert_close(y1, y2, atol=1e-5, rtol=0)
    torch.testing.assert_close(gx1, gx2, atol=1e-5, rtol=0)
    for name in g1:
        torch.testing.assert_close(g1[name], g2[name], atol=1e-5, rtol=0, msg=name)
    if capacity_factor is not None and router != "expert_choice":
        C = capacity(len(x), 2, E, capacity_factor)
        assert sorted_moe.stats["kept"].max() <= C and int(sorted_moe.stats["dropped"]) > 0


def as_gated_mlp(layer: MoE, e: int) -> GatedMLP:
    """Expert ``e`` as an independent lmfs.nn.GatedMLP (Linear layout: the transposes)."""
    mlp = GatedMLP(D, F_)
    with torch.no_grad():
        mlp.gate.weight.copy_(layer.experts.w_gate[e].T)
        mlp.up.weight.copy_(layer.experts.w_up[e].T)
        mlp.down.weight.copy_(layer.experts.w_down[e].T)
    return mlp


@pytest.mark.parametrize("router", ["softmax_topk", "topk_softmax", "sigmoid"])
def test_top_k_equal_to_E_with_equal_weights_is_the_mean_of_the_experts(router):
    layer = moe(router, top_k=E)
    with torch.no_grad():
        layer.router.proj.weight.zero_()  # every expert scores the same
    x, _ = inputs()
    want = torch.stack([as_gated_mlp(layer, e)(x) for e in range(E)]).mean(0)
    torch.testing.assert_close(layer(x), want, atol=1e-6, rtol=1e-5)


def test_switch_loss_is_one_at_uniform_load_and_grows_with_skew():
    uniform = torch.full((8, E), 1 / E)
    assert switch_loss(uniform, torch.full((E,), 5)).item() == pytest.approx(1.0)
    for p in ([0.4, 0.3, 0.2, 0.1], [0.7, 0.1, 0.1, 0.1], [1.0, 0, 0, 0]):
        p = torch.tensor(p)
        counts = (p * 1000).round().long()  # loads that follow the probabilities
        loss = switch_loss(p.expand(8, E), counts).item()
        assert loss == pytest.approx(E * (p ** 2).sum().item(), rel=1e-5) and loss > 1.01
    # all load on expert 0 and all probability there: the maximum, E
    assert switch_loss(torch.eye(E)[[0] * 8], torch.tensor([8, 0, 0, 0])).item() == pytest.approx(E)
    # per-device: two devices of two experts; balanced devices give 1 even if experts inside are not
    probs = torch.tensor([[0.5, 0.0, 0.5, 0.0]]).expand(6, E)
    assert device_balance_loss(probs, torch.tensor([3, 0, 3, 0]), 2).item() == pytest.approx(1.0)
    assert switch_loss(probs, torch.tensor([3, 0, 3, 0])).item() == pytest.approx(2.0)


def test_router_z_loss_by_hand():
    logits = torch.tensor([[0.0, 1.0, 2.0], [3.0, -1.0, 0.5]])
    by_hand = sum(math.log(sum(math.exp(v) for v in row)) ** 2 for row in logits.tolist()) / 2
    assert router_z_loss(logits).item() == pytest.approx(by_hand, rel=1e-6)


def test_capacity_drops_the_overflow_in_token_order():
    layer = moe(top_k=1, capacity_factor=1.0)
    N = 8  # capacity ceil(1.0 · 8·1 / 4) = 2
    with torch.no_grad():
        layer.router.proj.weight.zero_()
        layer.router.proj.weight[0, 0] = 10.0  # feature 0 sends every token to expert 0
    x, _ = inputs(N)
    x[:, 0] = 1.0
    y = layer(x)
    assert layer.stats["load"].tolist() == [8, 0, 0, 0] and layer.stats["kept"].tolist() == [2, 0, 0, 0]
    assert int(layer.stats["dropped"]) == 6
    p0 = torch.softmax(layer.router.logits(x), -1)[:, 0]
    torch.testing.assert_close(y[:2], p0[:2, None] * as_gated_mlp(layer, 0)(x[:2]))
    assert (y[2:] == 0).all()  # dropped tokens get nothing (the residual carries them)
    with pytest.raises(ValueError, match="capacity_factor"):
        moe(capacity_factor=0.0)


@pytest.mark.parametrize("capacity_factor", [None, 0.75])
@pytest.mark.parametrize("router", ROUTERS)
def test_kept_and_dropped_count_the_assignments_that_are_kept(router, capacity_factor):
    """``kept`` is the load where nothing can be dropped, the load capped at C otherwise: either
    way the count of the assignments that come out of the capacity step."""
    layer = moe(router, capacity_factor=capacity_factor)
    x, ids = inputs(40)
    routing = layer.router(x, ids, capacity_factor)
    token, expert, _ = layer.drop_over_capacity(routing, 40)
    assert torch.equal(layer.stats["load"], torch.bincount(routing.expert, minlength=E))
    assert torch.equal(layer.stats["kept"], torch.bincount(expert, minlength=E))
    if router == "expert_choice":  # tokens that no expert picked
        assert int(layer.stats["dropped"]) == 40 - len(set(token.tolist()))
    else:
        assert int(layer.stats["dropped"]) == len(routing.expert) - len(expert)
        assert (int(layer.stats["dropped"]) > 0) == (capacity_factor is not None)  # C = 15 < the mean load 20


def test_bin_counts_is_bincount():
    g = torch.Generator().manual_seed(0)
    cases = [(torch.tensor([], dtype=torch.long), 4), (torch.zeros(3, dtype=torch.long), 1),
             (torch.tensor([4, 0, 4, 2]), 5), (torch.tensor([1, 1]), 1000),
             (torch.randint(64, (131072,), generator=g), 64), (torch.randint(5000, (20000,), generator=g), 5000)]
    for ids, n in cases:
        got = bin_counts(ids, n)
        assert got.dtype == torch.long and torch.equal(got, torch.bincount(ids, minlength=n)), (ids, n)


@pytest.mark.gpu
def test_bin_counts_on_gpu_is_exact_and_does_not_wait_for_the_gpu():
    """Counting must not read anything back to the host: the sync debug mode makes such a read an error."""
    ids = torch.randint(64, (131072,), device="cuda")
    big = torch.randint(16384, (16384,), device="cuda")  # expert choice counts per token
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        got, got_big = bin_counts(ids, 64), bin_counts(big, 16384)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.equal(got, torch.bincount(ids, minlength=64))
    assert torch.equal(got_big, torch.bincount(big, minlength=16384))


def test_bias_updates_move_the_load_toward_uniform():
    layer = moe("sigmoid", top_k=1, bias_rate=0.02)
    with torch.no_grad():
        layer.router.proj.weight[0] += 3.0  # a router that prefers expert 0
    x, _ = inputs(256)
    layer(x)
    before = layer.stats["load"].float()
    for _ in range(60):  # no training: only the bias moves
        layer(x)
        layer.update_bias()
    layer(x)
    after = layer.stats["load"].float()
    assert before.max() > 100 and after.std() < before.std() / 3, (before, after)
    assert layer.router.bias[0] < 0  # the overloaded expert was pushed down


def test_hash_and_expert_choice_routing():
    x, ids = inputs(32)
    layer = moe("hash", top_k=2)
    assert layer(x, ids).shape == x.shape and sum(p.numel() for p in layer.router.parameters()) == 0
    routing = layer.router(x, ids)
    assert routing.token.shape == routing.expert.shape == (64,) and (routing.weight == 0.5).all()
    pairs = routing.expert.view(2, 32)
    assert (pairs[0] != pairs[1]).all()  # k distinct experts
    same = layer.router(x[:4], ids[:4]).expert.view(2, 4)
    assert torch.equal(same, pairs[:, :4])  # a function of the token id alone
    assert int(layer.stats["load"].sum()) == 64 and int(layer.stats["dropped"]) == 0
    with pytest.raises(ValueError, match="token ids"):
        layer(x)

    layer = moe("expert_choice", top_k=1, capacity_factor=1.0)
    y = layer(x)
    C = capacity(32, 1, E, 1.0)
    assert y.shape == x.shape and layer.stats["load"].tolist() == [C] * E  # balanced by construction
    routing = layer.router(x, None, 1.0)
    picked = set(routing.token.tolist())
    assert int(layer.stats["dropped"]) == 32 - len(picked)
    probs = torch.softmax(layer.router.logits(x), -1)
    for e in range(E):  # each expert took its C highest-scoring tokens
        mine = routing.token[routing.expert == e]
        assert set(mine.tolist()) == set(probs[:, e].topk(C).indices.tolist())


def test_bad_inputs_get_clear_errors():
    with pytest.raises(ValueError, match="moe_top_k=5 must be between 1 and moe_experts=4"):
        TransformerConfig(moe_experts=4, moe_top_k=5)
    with pytest.raises(ValueError, match="moe_capacity_factor"):
        TransformerConfig(moe_experts=4, moe_capacity_factor=0)
    with pytest.raises(ValueError, match="moe_router='softmax'"):
        TransformerConfig(moe_experts=4, moe_router="softmax")
    with pytest.raises(ValueError, match="moe_bias_rate"):
        TransformerConfig(moe_experts=4, moe_bias_rate=1e-3)
    with pytest.raises(ValueError, match="gated"):
        TransformerConfig(moe_experts=4, ffn="gelu")
    with pytest.raises(ValueError, match="top_k=5"):
        MoE(D, F_, 4, 5)
    with pytest.raises(ValueError, match="unknown router"):
        MoE(D, F_, 4, 1, router="switch")
    TransformerConfig(moe_top_k=99)  # a dense model ignores the MoE fields


def tiny(**overrides) -> TransformerConfig:
    fields = dict(vocab_size=64, context_length=16, d_model=32, n_layers=2, n_heads=2, moe_experts=4,
                  moe_top_k=2, moe_expert_dim=16)
    return TransformerConfig(**(fields | overrides))


def test_tiny_moe_model_trains():
    torch.manual_seed(0)
    model = TransformerLM(tiny(moe_shared_experts=1, moe_router="sigmoid", moe_bias_rate=1e-3))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(0)
    x = torch.randint(64, (4, 16), generator=g)
    losses = []
    for _ in range(30):
        _, loss = model(x[:, :-1], x[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad()
        model.update_moe_biases()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0], losses
    assert any(m.router.bias.abs().sum() > 0 for m in model.moe_layers())
    # training mode adds the weighted balancing losses, eval mode reports the LM loss alone
    model.train()
    with torch.no_grad():
        train_loss = model(x, x)[1]
        lm_loss = model.loss(model(x)[0], x)
        assert train_loss.item() == pytest.approx((lm_loss + model.moe_loss()).item(), rel=1e-6)
        model.eval()
        assert model(x, x)[1].item() == pytest.approx(lm_loss.item(), rel=1e-6)
    assert set(model.aux_losses()) == {"balance", "device_balance", "z"} and len(model.moe_stats()) == 2


VARIANTS = [{}, dict(moe_every=2, moe_shared_experts=2), dict(moe_router="hash", moe_top_k=1),
            dict(moe_experts=8, moe_top_k=3, moe_expert_dim=8, moe_shared_experts=1)]


@pytest.mark.parametrize("overrides", VARIANTS, ids=str)
def test_total_and_active_parameters_and_flops(overrides):
    config = tiny(attn_impl="reference", moe_dispatch="loop", **overrides)
    model = TransformerLM(config)
    total = sum(p.numel() for p in model.parameters())
    expert_params = sum(m.experts.w_gate[0].numel() * 3 for m in model.moe_layers())
    active = total - (config.moe_experts - config.moe_top_k) * expert_params
    assert count_params(config) == param_count(config) == model.num_params() == total
    assert count_params(config, active=True) == param_count(config, active=True) == active < total
    linears = sum(m.weight.numel() for m in model.modules() if isinstance(m, Linear))
    assert matmul_params(config) == linears + config.moe_top_k * expert_params + config.vocab_size * config.d_model

    x = torch.randint(config.vocab_size, (2, 16))
    with FlopCounterMode(display=False) as counter:
        model(x)
    assert counter.get_total_flops() == x.numel() * flops_per_token(config, 16)


def test_upcycled_model_computes_the_dense_function():
    torch.manual_seed(0)
    dense = TransformerLM(tiny(moe_experts=0))
    x = torch.randint(64, (2, 16))
    want = dense(x)[0]
    # top-k = E and equal router weights: the mean of identical experts, i.e. the dense MLP
    full = upcycle(dense, n_experts=4, top_k=4, router="softmax_topk")
    for m in full.moe_layers():
        torch.nn.init.zeros_(m.router.proj.weight)
    torch.testing.assert_close(full(x)[0], want, atol=1e-5, rtol=1e-5)
    # the default router renormalises the k weights, so any k computes the dense function too
    sparse = upcycle(dense, n_experts=4, top_k=2, every=2)
    assert [type(b.mlp).__name__ for b in sparse.blocks] == ["GatedMLP", "MoE"]
    torch.testing.assert_close(sparse(x)[0], want, atol=1e-5, rtol=1e-5)
    router = sparse.moe_layers()[0].router.proj.weight
    assert 0 < router.std() < 1e-2  # small, not zero: training can break the symmetry


def test_training_loop_moves_the_sigmoid_routers_bias():
    import numpy as np

    from lmfs.train import TrainConfig, train

    config = TransformerConfig(vocab_size=32, context_length=16, d_model=32, n_layers=1, n_heads=4,
                               moe_experts=4, moe_top_k=1, moe_router="sigmoid", moe_bias_rate=0.01)
    torch.manual_seed(0)
    model = TransformerLM(config)
    router = model.moe_layers()[0].router
    assert torch.count_nonzero(router.bias) == 0
    data = np.random.default_rng(0).integers(0, 32, 4000).astype(np.uint16)
    train(model, data, TrainConfig(steps=3, batch_size=4, context_length=16), device="cpu", progress=False)
    # Each step adds ±0.01 to every expert whose load is off the mean: without the loop's call it stays 0.
    assert router.bias.abs().max() > 0
