"""bench/memory_check's page from a hand-made run: every summary figure computed by hand."""
from __future__ import annotations

from bench.memory_check import page


def _run() -> dict:
    plan = {"rule": "pipedream", "recompute": [False, False], "in_flight": [2, 1],
            "parameter_bytes": [100.0, 50.0], "activation_bytes": [100.0, 40.0],
            "rows": [{"stage": 0, "state": 400.0, "versions": 100.0, "activations": 200.0,
                      "measured": 735, "walked": 700.0},
                     {"stage": 1, "state": 200.0, "versions": 0.0, "activations": 40.0,
                      "measured": 480, "walked": 500.0}]}
    return {"model": "gpt", "kind": "pipedream", "recompute": "never", "ranks": [
        {"rank": 0, "stage": 0, "peak": 735, "plan": plan,
         "parts": {"held": 100, "F": 200, "B": 150, "U": 300, "comm": 35}},
        {"rank": 1, "stage": 1, "peak": 480,
         "parts": {"held": 50, "F": 60, "B": 200, "W": 50, "U": 100, "comm": 100, "other": 20}}]}


def test_summary_by_hand() -> None:
    text = page([_run(), {"model": "vgg-mini", "kind": "2bw", "recompute": "always",
                          "error": "Traceback\nRuntimeError: boom"}])
    # ratios: 735 / 700 = 1.05 (within 10%), 480 / 240 = 2.00
    assert ("stages within 10% of their prediction: 1 of 2; measured / predicted from 1.05 "
            "(gpt pipedream recompute never stage 0) to 2.00 (gpt pipedream recompute never "
            "stage 1), median 2.00.") in text
    # walked: 735 / 700 = 1.05, 480 / 500 = 0.96: both within 10%
    assert ("stages within 10%: **2 of 2**; measured / walked from 0.96 (gpt pipedream "
            "recompute never stage 1) to 1.05 (gpt pipedream recompute never stage 0), median "
            "1.05. Outside 10%: none.") in text
    assert "| 0.00 | 2.00 | 0.00 | 0.96 |" in text  # stage 1: predicted ratio, walked, ratio
    # (held + U + P) / (state + versions): 500 / 500 and 200 / 200
    assert "the backwards): 1.00 / 1.00 / 1.00; above 1" in text
    # F / activations: 200 / 200, 60 / 40
    assert "(F over predicted activations): 1.00 / 1.50 / 1.50:" in text
    # (B + W - P) / predicted: 50 / 700 = 0.07, 200 / 240 = 0.83
    assert "((B + W - P) over predicted): 0.07 / 0.83 / 0.83:" in text
    # comm (+ other) / predicted: 35 / 700 = 0.05, 120 / 240 = 0.50
    assert "(comm over predicted): 0.05 / 0.50 / 0.50:" in text
    assert "| gpt | pipedream | never | 1 | 0.00 |" in text  # MiB, two decimals
    assert "Failed: vgg-mini 2bw recompute always: RuntimeError: boom" in text


def test_a_stage_without_weights_has_no_state_ratio() -> None:
    """A stage that owns no parameter and keeps no copy (a loss-only last stage): its state is 0,
    so it has no (held + U + P) / state ratio; the page still lists it and its walked ratio."""
    run = _run()
    rows = run["ranks"][0]["plan"]["rows"]
    rows[1] = {**rows[1], "state": 0.0, "versions": 0.0}
    run["ranks"][0]["plan"]["parameter_bytes"] = [100.0, 0.0]
    text = page([run])
    assert "the backwards): 1.00 / 1.00 / 1.00; above 1" in text  # stage 0's alone
    assert "| 0.96 |" in text  # stage 1's measured / walked, 480 / 500
