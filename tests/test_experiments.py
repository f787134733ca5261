def test_log_cost_benchmark_runs_and_reports_ratios(capsys):
    from experiments.log_cost import main

    r = main(["--model", "tiny", "--appends", "20", "--steps", "1", "--saves", "1"])
    assert r["append_over_step"] == r["append_median_s"] / r["step_median_s"] > 0
    assert r["state_bytes"] == 4 * 3_219_776
    assert "append / full torch.save" in capsys.readouterr().out
