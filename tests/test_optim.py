import copy
import math

import pytest
import torch

from lmfs.optim import (SGD, AdaGrad, Adam, AdamW, adam_state_for, as_lr_lambda, clip_grad_norm, cosine_with_warmup,
                        warmup_stable_decay)


def small_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))


def run(model, optimizer, steps=5, skip=0):
    """``steps`` optimizer steps on fixed batches; the first ``skip`` batches are drawn, not stepped on
    (to continue a run that took them)."""
    data = torch.Generator().manual_seed(1)
    for step in range(steps):
        x, y = torch.randn(16, 6, generator=data), torch.randn(16, 3, generator=data)
        if step >= skip:
            optimizer.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            optimizer.step()
    return [p.detach() for p in model.parameters()]


def resume_in(first, second):
    """Three steps of optimizer ``first``, its state dict (through adam_state_for) into ``second`` on
    the same parameters, two more steps: checks the parameters equal five steps of ``first``
    throughout. ``first`` and ``second`` build an optimizer from parameters; returns the second."""
    a, b = small_model(), small_model()
    want = run(a, first(a.parameters()), steps=5)
    opt = first(b.parameters())
    run(b, opt, steps=3)
    other = second(b.parameters())
    other.load_state_dict(adam_state_for(other, copy.deepcopy(opt.state_dict())))
    for g, w in zip(run(b, other, steps=5, skip=3), want):
        torch.testing.assert_close(g, w, atol=1e-6, rtol=1e-6)
    return other


CASES = [
    (SGD, torch.optim.SGD, dict(lr=0.1)),
    (SGD, torch.optim.SGD, dict(lr=0.1, weight_decay=0.1)),
    (SGD, torch.optim.SGD, dict(lr=0.1, momentum=0.9)),
    (SGD, torch.optim.SGD, dict(lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.05)),
    (AdaGrad, torch.optim.Adagrad, dict(lr=0.1)),
    (AdaGrad, torch.optim.Adagrad, dict(lr=0.1, weight_decay=0.1, eps=1e-8)),
    (Adam, torch.optim.Adam, dict(lr=1e-2)),
    (Adam, torch.optim.Adam, dict(lr=1e-2, betas=(0.8, 0.99), weight_decay=0.1)),
    (AdamW, torch.optim.AdamW, dict(lr=1e-2)),  # default weight_decay=0.01 on both sides
    (AdamW, torch.optim.AdamW, dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-6, weight_decay=0.1)),
]


def case_id(value):
    return value.__name__ if isinstance(value, type) else None


@pytest.mark.parametrize("ours,theirs,kwargs", CASES, ids=case_id)
def test_optimizer_matches_torch(ours, theirs, kwargs):
    a = small_model()
    b = copy.deepcopy(a)
    before = [p.detach().clone() for p in a.parameters()]
    got = run(a, ours(a.parameters(), **kwargs))
    want = run(b, theirs(b.parameters(), **kwargs))
    for g, w, p0 in zip(got, want, before):
        torch.testing.assert_close(g, w, atol=1e-6, rtol=1e-6)
        assert not torch.equal(g, p0)  # the parameters did move


@pytest.mark.parametrize("first,second", [(AdamW, torch.optim.AdamW), (torch.optim.AdamW, AdamW),
                                          (Adam, torch.optim.Adam)], ids=case_id)
def test_adam_state_moves_between_ours_and_torchs(first, second):
    """Three steps of one, its state dict into the other, two more steps: the same parameters as
    five steps of one optimizer throughout (the moments and the bias correction's step carry over)."""
    kwargs = dict(lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
    resume_in(lambda p: first(p, **kwargs), lambda p: second(p, **kwargs))
    sgd = torch.optim.SGD(small_model().parameters(), lr=0.1)
    assert adam_state_for(sgd, sgd.state_dict()) == sgd.state_dict()   # not an Adam: as it is


def test_a_foreach_adamw_checkpoint_resumes_as_fused():
    """The switches of how torch's AdamW computes are the resuming optimizer's own: a checkpoint of
    the foreach AdamW (or of ours) loads into a fused one, which then steps fused, and five steps
    in all equal five of one optimizer."""
    kwargs = dict(lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
    for first in (lambda p: torch.optim.AdamW(p, foreach=True, **kwargs), lambda p: AdamW(p, **kwargs)):
        fused = resume_in(first, lambda p: torch.optim.AdamW(p, fused=True, **kwargs))
        assert fused.param_groups[0]["fused"] and not fused.param_groups[0]["foreach"]


def test_optimizer_skips_params_without_grad_and_supports_groups():
    frozen, live = torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(3))
    opt = AdamW([{"params": [frozen]}, {"params": [live], "lr": 0.5}], lr=0.1)
    live.sum().backward()
    opt.step()
    assert torch.equal(frozen.detach(), torch.ones(3)) and (live < 1).all()


def test_optimizer_argument_errors():
    p = [torch.nn.Parameter(torch.zeros(2))]
    with pytest.raises(ValueError, match="momentum > 0"):
        SGD(p, lr=0.1, nesterov=True)
    with pytest.raises(ValueError, match=r"betas\[1\]=1.0"):
        Adam(p, betas=(0.9, 1.0))
    with pytest.raises(ValueError, match="lr=-1"):
        AdaGrad(p, lr=-1)


def test_closure_is_called_and_returned():
    w = torch.nn.Parameter(torch.tensor([2.0]))
    opt = SGD([w], lr=0.25)

    def closure():
        opt.zero_grad()
        loss = (w**2).sum()
        loss.backward()
        return loss

    assert opt.step(closure).item() == 4.0
    assert w.item() == 1.0  # 2 - 0.25 · 2·2


@pytest.mark.parametrize("max_norm", [0.01, 1.0, 1e6])
def test_clip_grad_norm_matches_torch(max_norm):
    a = small_model()
    b = copy.deepcopy(a)
    x = torch.randn(8, 6, generator=torch.Generator().manual_seed(2))
    for m in (a, b):
        m(x).pow(2).sum().backward()
    a[0].bias.grad = None  # a parameter without a gradient is skipped
    b[0].bias.grad = None
    got = clip_grad_norm(a.parameters(), max_norm)
    want = torch.nn.utils.clip_grad_norm_(b.parameters(), max_norm)
    torch.testing.assert_close(got, want)
    for pa, pb in zip(a.parameters(), b.parameters()):
        if pa.grad is not None:
            torch.testing.assert_close(pa.grad, pb.grad)
    if max_norm < got:  # clipped: the new norm is max_norm
        grads = [p.grad.flatten() for p in a.parameters() if p.grad is not None]
        new = torch.linalg.vector_norm(torch.cat(grads))
        assert math.isclose(new.item(), max_norm, rel_tol=1e-4)


def test_clip_grad_norm_of_a_single_tensor_and_of_nothing():
    w = torch.nn.Parameter(torch.zeros(2))
    w.grad = torch.tensor([3.0, 4.0])
    assert clip_grad_norm(w, 1.0).item() == 5.0
    torch.testing.assert_close(w.grad, torch.tensor([0.6, 0.8]), rtol=1e-5, atol=1e-6)
    assert clip_grad_norm([torch.nn.Parameter(torch.zeros(2))], 1.0).item() == 0.0


def test_cosine_with_warmup_boundaries():
    kw = dict(max_lr=1.0, min_lr=0.1, warmup_steps=10, cosine_steps=100)
    assert cosine_with_warmup(0, **kw) == 0.0
    assert cosine_with_warmup(5, **kw) == 0.5
    assert cosine_with_warmup(10, **kw) == 1.0
    assert math.isclose(cosine_with_warmup(60, **kw), 0.55)  # half-way: (max + min) / 2
    assert math.isclose(cosine_with_warmup(35, **kw), 0.1 + 0.9 * (1 + math.cos(math.pi / 4)) / 2)
    assert cosine_with_warmup(110, **kw) == 0.1
    assert cosine_with_warmup(10_000, **kw) == 0.1
    assert cosine_with_warmup(0, max_lr=1.0, min_lr=0.0, warmup_steps=0, cosine_steps=4) == 1.0
    with pytest.raises(ValueError, match="step must be >= 0"):
        cosine_with_warmup(-1, **kw)


def test_warmup_stable_decay_boundaries():
    kw = dict(max_lr=2.0, min_lr=0.2, warmup_steps=4, stable_steps=10, decay_steps=6)
    assert [warmup_stable_decay(s, **kw) for s in (0, 2, 4)] == [0.0, 1.0, 2.0]
    assert warmup_stable_decay(13, **kw) == 2.0           # last stable step
    assert math.isclose(warmup_stable_decay(17, **kw), 2.0 - 1.8 * 3 / 6)  # half-way down
    assert warmup_stable_decay(20, **kw) == 0.2
    assert warmup_stable_decay(500, **kw) == 0.2


def test_as_lr_lambda_drives_lambda_lr():
    kw = dict(max_lr=0.5, min_lr=0.05, warmup_steps=3, cosine_steps=7)
    opt = SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.5)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, as_lr_lambda(cosine_with_warmup, **kw))
    for step in range(15):
        assert math.isclose(opt.param_groups[0]["lr"], cosine_with_warmup(step, **kw), abs_tol=1e-12)
        opt.step()
        sched.step()
    with pytest.raises(ValueError, match="max_lr"):
        as_lr_lambda(cosine_with_warmup, min_lr=0.0)
