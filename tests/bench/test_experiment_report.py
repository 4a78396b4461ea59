"""bench.experiment.report's verdict on auto, on hand-made results (no cluster needed)."""
from __future__ import annotations

from bench.experiment.report import same_updates, seeds_table


def run(mode: str, seed: int, accs: list[float], epoch_s: float) -> dict:
    return {"mode": mode, "seed": seed, "schedule": mode, "final_accuracy": accs[-1],
            "samples_per_s": 100.0,
            "epochs": [{"epoch": i + 1, "test_accuracy": a, "train_time_s": epoch_s * (i + 1)}
                       for i, a in enumerate(accs)]}


def test_verdict_and_same_updates_by_hand() -> None:
    slow, fast = [0.5, 0.95], [0.92, 0.96]
    results = [run("fxpipe", 0, slow, 1.0), run("fxpipe", 1, slow, 1.2),
               run("flush", 0, fast, 2.0), run("flush", 1, fast, 2.2),
               run("auto", 0, fast, 2.1), run("auto", 1, fast, 3.0)]
    # time to 90%: fxpipe 2.0, 2.4 (1 s epochs, 2nd epoch); flush 2.0, 2.2; auto 2.1, 3.0
    _, v = seeds_table(results, 0.9)
    assert v["best_mode"] == "flush" and v["best"][0] == 2.1
    assert v["auto"][0] == 2.55 and not v["within"]  # 2.55 > 2.1 + sd(2.0, 2.2) = 2.24
    assert v["same_as"] == "flush"
    modes = {"auto": [results[4]], "flush": [run("flush", 0, [0.92, 0.97], 2.0)],
             "fxpipe": [results[0]]}
    assert same_updates(modes) is None  # one epoch's accuracy differs: not the same updates
