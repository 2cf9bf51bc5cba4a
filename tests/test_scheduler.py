"""lmfs.inference.Scheduler on the CPU with a fake model step: no model, no device.

The fake step answers every scheduled request with a token that depends only on the request and its
position (so a preempted request recomputes the same tokens); a runner with steps in flight is
imitated by handing tokens back a few steps late. Checked against brute force: every request gets
exactly the tokens its own sequence implies, blocks are never shared unless the prefix is equal,
never leaked, and never exceed the budget."""

import random

import pytest

from lmfs.inference import BlockAllocator, Request, SamplingParams, Scheduler
from lmfs.inference.scheduler import ScheduledBatch


def token_at(index: int, position: int) -> int:
    """The fake model's token for request ``index`` at ``position`` (deterministic)."""
    return (7 * index + 3 * position) % 50 + 1


def make(n_blocks=40, block_size=4, max_batch_size=8, max_batch_tokens=64, context_length=64, tokenizer=None):
    return Scheduler(BlockAllocator(n_blocks, block_size), block_size, max_batch_size, max_batch_tokens,
                     context_length, tokenizer)


def check_blocks(s: Scheduler):
    """Every running request holds enough blocks for what it has on the device, and the allocator's
    count of used blocks is what the requests hold (shared blocks once)."""
    held = {}
    for r in s.running:
        assert len(r.blocks) * s.block_size >= r.device_len - 1 >= 0
        assert r.device_len <= r.end, "scheduled past the length it ends at"
        for b in r.blocks:
            held[b] = held.get(b, 0) + 1
    assert s.allocator.num_used >= len(held)


def run(s: Scheduler, requests, delay: int = 0, steps_limit: int = 10_000):
    """Drive ``s`` to the end with the fake model step; ``delay``: steps a token is held back (a runner
    with steps in flight). Returns the number of steps."""
    s.begin(s.empty_stats(), events=True)
    s.add(requests)
    in_flight = []   # (requests, ids) not handed back yet, oldest first
    steps = 0
    while s.busy:
        steps += 1
        assert steps < steps_limit, "the scheduler does not finish"
        batch = s.schedule()
        assert isinstance(batch, ScheduledBatch)
        check_blocks(s)
        if batch.prefill:   # a prefill reads every step in flight first, and is read at once
            for reqs, ids in in_flight:
                s.accept(reqs, ids, [0.0] * len(ids))
            in_flight = []
            ids = [token_at(r.index, r.length) for r in batch.requests]
            s.accept(batch.requests, ids, [0.0] * len(ids))
            continue
        # the token fed sits at position device_len - 2 after scheduling: the next one is at device_len - 1
        if batch.requests:
            in_flight.append((batch.requests, [token_at(r.index, r.device_len - 1) for r in batch.requests]))
        keep = delay if batch.requests else 0
        while len(in_flight) > keep:
            reqs, ids = in_flight.pop(0)
            # a request keeps its blocks while a step that writes into them is in flight
            assert all(r.blocks and r.row is not None for r in reqs), "blocks freed under a step in flight"
            s.accept(reqs, ids, [0.0] * len(ids))
    assert not in_flight and s.unread == 0
    return steps


def expected_tokens(r: Request, context_length: int) -> list[int]:
    """Brute force: the tokens request ``r`` generates alone (stop tokens and lengths applied)."""
    out, n = [], len(r.prompt)
    while True:
        t = token_at(r.index, n + len(out))
        out.append(t)
        if t in r.params.stop_token_ids or len(out) >= r.params.max_tokens or n + len(out) >= context_length:
            return out


def requests_of(specs, seed=0):
    rng = random.Random(seed)
    return [Request(i, [rng.randrange(1, 50) for _ in range(n)], SamplingParams(max_tokens=m, temperature=0))
            for i, (n, m) in enumerate(specs)]


@pytest.mark.parametrize("delay", [0, 1, 2])
def test_preemption_storm_finishes_every_request_with_its_own_tokens(delay):
    """A KV budget far below what the requests need at once: requests are preempted again and again,
    recomputed, and every one still ends with exactly the tokens it generates alone; no block is
    left behind and the row budget is never exceeded."""
    specs = [(random.Random(i).randrange(3, 14), random.Random(100 + i).randrange(4, 30)) for i in range(16)]
    s = make(n_blocks=14, block_size=4, max_batch_size=6, max_batch_tokens=20)
    requests = requests_of(specs)
    run(s, requests, delay)
    assert s.stats["preemptions"] > 5
    for r in requests:
        assert r.finish_reason == "length" and r.out == expected_tokens(r, s.context_length), r.index
    assert s.allocator.num_used == 0 and sorted(s.free_rows) == list(range(6))
    assert not s.running and not s.waiting


def test_admission_respects_rows_tokens_and_blocks():
    s = make(n_blocks=9, block_size=4, max_batch_size=3, max_batch_tokens=10)
    s.begin(s.empty_stats())
    s.add(requests_of([(4, 5), (5, 5), (3, 5), (2, 5)]))
    first = s.schedule()
    # 4 + 5 tokens fit the budget of 10, the third (3 more) does not
    assert first.prefill and [r.index for r in first.requests] == [0, 1]
    assert s.stats["prefill_tokens"] == 9 and s.unread == 2
    s.accept(first.requests, [1, 1], [0.0, 0.0])
    second = s.schedule()
    # rows: 3 in all, 2 taken; blocks: 8 usable, 2 + 2 taken, the next needs ceil(4/4) = 1
    assert second.prefill and [r.index for r in second.requests] == [2]
    s.accept(second.requests, [1], [0.0])
    third = s.schedule()
    assert not third.prefill and len(third.requests) == 3   # no free row for the fourth: a decode step
    assert len(s.waiting) == 1


def test_prefix_blocks_are_shared_only_for_equal_full_blocks():
    """Two prompts that share 9 tokens with block size 4 share 2 full blocks (8 tokens), computed once;
    a third prompt that differs in its first block shares nothing. Freed prefix blocks are released
    back to the allocator when the last user finishes."""
    common = list(range(1, 10))
    prompts = [common + [20, 21], common + [30], [2] + common[1:] + [40]]
    requests = [Request(i, p, SamplingParams(max_tokens=3, temperature=0)) for i, p in enumerate(prompts)]
    s = make(n_blocks=30, block_size=4)
    s.begin(s.empty_stats())
    s.add(requests[:1])
    first = s.schedule()
    s.accept(first.requests, [1], [0.0])
    s.add(requests[1:])
    batch = s.schedule()
    assert batch.prefill and [r.cached for r in batch.requests] == [8, 0]
    assert batch.requests[0].blocks[:2] == requests[0].blocks[:2]
    assert not set(batch.requests[1].blocks) & set(requests[0].blocks)
    assert s.stats["shared_prefix_tokens"] == 8
    # the tokens computed: 11 for the first prompt, 10 - 8 for the second, 10 for the third
    assert s.stats["prefill_tokens"] == 11 + 2 + 10
    s.accept(batch.requests, [1, 1], [0.0, 0.0])
    while s.busy:
        b = s.schedule()
        s.accept(b.requests, [1] * len(b.requests), [0.0] * len(b.requests))
    assert s.allocator.num_used == 0


@pytest.mark.parametrize("delay", [0, 2])
def test_stop_tokens_max_tokens_and_context_length_finish_requests(delay):
    """A stop token ends a request (kept in its output); max_tokens and the context length end
    others; with tokens handed back late, the extra tokens scheduled after a stop are dropped."""
    ctx = 24
    requests = requests_of([(5, 30), (6, 4), (20, 30), (3, 30)])
    stop = token_at(0, 5 + 6)   # request 0's 7th token
    requests[0] = Request(0, requests[0].prompt, SamplingParams(max_tokens=30, temperature=0, stop_token_ids=[stop]))
    s = make(context_length=ctx)
    run(s, requests, delay)
    for r in requests:
        assert r.out == expected_tokens(r, ctx)
    assert requests[0].finish_reason == "stop" and requests[0].out[-1] == stop and len(requests[0].out) <= 7
    assert requests[1].finish_reason == "length" and len(requests[1].out) == 4
    assert requests[2].finish_reason == "length" and len(requests[2].prompt) + len(requests[2].out) == ctx
    assert s.allocator.num_used == 0


def test_stop_strings_cut_the_text():
    class Chars:
        def decode(self, ids):
            return "".join(chr(96 + t % 26) for t in ids)

    text = Chars().decode(expected_tokens(Request(0, [1, 2, 3], SamplingParams(max_tokens=30)), 64))
    stop = text[6:8]
    r = Request(0, [1, 2, 3], SamplingParams(max_tokens=30, temperature=0, stop=[stop]))
    s = make(tokenizer=Chars())
    run(s, [r], delay=2)
    assert r.finish_reason == "stop" and r.text == text[:text.index(stop)] and len(r.out) == text.index(stop) + 2


def test_scheduler_checks_its_budgets():
    with pytest.raises(ValueError, match="max_batch_size"):
        make(max_batch_size=0)
