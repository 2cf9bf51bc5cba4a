"""``python -m lmfs.scaling chinchilla [--bootstrap 40] [--json PATH]``: the parametric law fitted to
the runs of Chinchilla's Figure 4, next to the published fits.

The fit drops the 5 runs with the fewest tokens per parameter (under 0.41, far from any
compute-optimal point, as Besiroglu et al. 2024 also do), fits ``L = E + A/N^α + B/D^β`` to the
other 240 with :func:`lmfs.scaling.fit_chinchilla` and bootstraps over runs for intervals. The
allocation is compared at Chinchilla's own budget, 70B parameters on 1.4T tokens.
"""

from __future__ import annotations

import argparse

CHINCHILLA_FLOPS = 6 * 70e9 * 1.4e12  # 5.9e23
DROPPED = 5


def fit_figure4(bootstrap: int = 40, seed: int = 0) -> dict:
    """The fit and the published laws as a dict: estimates, 95% intervals, exponents, allocation."""
    from lmfs.scaling import BESIROGLU_2024, HOFFMANN_2022, fit_chinchilla, load_chinchilla_runs

    runs = load_chinchilla_runs()
    kept = runs.sort_values("tokens_per_param").iloc[DROPPED:]
    fit = fit_chinchilla(kept.N, kept.D, kept.loss, bootstrap=bootstrap, seed=seed)

    def summary(law) -> dict:
        N_opt, D_opt = law.compute_optimal(CHINCHILLA_FLOPS)
        return dict(E=law.E, A=law.A, B=law.B, alpha=law.alpha, beta=law.beta, a=law.a,
                    N_opt=float(N_opt), tokens_per_param=float(D_opt / N_opt))

    ours = summary(fit.law)
    if bootstrap >= 2:
        ours["ci95"] = {name: list(bounds) for name, bounds in fit.ci().items()}
    return {"device": "CPU", "runs": int(len(runs)), "fitted_runs": int(len(kept)), "bootstrap": bootstrap,
            "budget_flops": CHINCHILLA_FLOPS, "lmfs": ours,
            "published": {"Hoffmann et al. 2022": summary(HOFFMANN_2022),
                          "Besiroglu et al. 2024": summary(BESIROGLU_2024)}}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m lmfs.scaling", description=__doc__.split("\n")[0])
    parser.add_argument("command", choices=["chinchilla"])
    parser.add_argument("--bootstrap", type=int, default=40, help="bootstrap refits for the intervals")
    parser.add_argument("--json", default=None, help="write the result here (e.g. results/cpu/chinchilla-fit.json)")
    args = parser.parse_args(argv)
    result = fit_figure4(args.bootstrap)
    rows = {"lmfs (this fit)": result["lmfs"], **result["published"]}
    print(f"L = E + A/N^α + B/D^β on {result['fitted_runs']} of Chinchilla's {result['runs']} Figure-4 runs; "
          f"allocation at C = {CHINCHILLA_FLOPS:.2g} FLOPs")
    for name, r in rows.items():
        print(f"  {name:<24} E {r['E']:.3f}  A {r['A']:7.1f}  B {r['B']:7.1f}  α {r['alpha']:.3f}  β {r['beta']:.3f}"
              f"  a {r['a']:.3f}  N* {r['N_opt'] / 1e9:5.1f} B  {r['tokens_per_param']:5.1f} tokens/param")
    if args.json:
        from lmfs.bench import save_json

        save_json(result, args.json)
    return result


if __name__ == "__main__":
    main()
