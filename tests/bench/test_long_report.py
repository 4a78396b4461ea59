"""bench/ablation/long_report (issue 25's 1,000-update rows): target, updates to target, ratios
and the goal line, on hand-made records whose answers are worked out here."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.ablation.long_report import load, markdown  # noqa: E402


def curve(points: dict[int, float]) -> list[list[float]]:
    return [[u, points[u]] for u in sorted(points)]


def rec(variant: str, S: int, seed: int, evals: dict[int, float]) -> dict:
    return {"key": f"lm|{S}|{variant}|adamw|{seed}", "task": "lm", "S": S, "variant": variant,
            "opt": "adamw", "seed": seed, "evals": curve(evals), "diverged": None}


def test_targets_ratios_and_goal(tmp_path: Path) -> None:
    # budget 100 updates; flush at u = 60 (60%) has 2.995 and 3.004: mean 2.9995 -> target 3.00
    flush = [{0: 5.0, 50: 3.1, 60: 2.995, 90: 2.9, 100: 2.9},
             {0: 5.0, 50: 3.2, 60: 3.004, 90: 2.9, 100: 2.9}]
    # reaches 3.00 at 50 and 70: 60 ± 14.1, ratio to flush's (60 + 90) / 2 = 75 -> 0.80
    nesterov = [{0: 5.0, 50: 2.99, 100: 2.8}, {0: 5.0, 50: 3.1, 70: 3.0, 100: 2.8}]
    # one seed never reaches it: not a goal candidate
    pipedream = [{0: 5.0, 80: 2.9, 100: 2.9}, {0: 5.0, 100: 3.5}]
    lines = [rec("1f1b-flush", 4, s, e) for s, e in enumerate(flush)]
    lines += [rec("pipedream+nesterov", 4, s, e) for s, e in enumerate(nesterov)]
    lines += [rec("pipedream", 4, s, e) for s, e in enumerate(pipedream)]
    lines += [rec("pipedream", 8, 0, {0: 5.0, 100: 3.5}), rec("1f1b-flush", 8, 0, flush[0])]
    path = tmp_path / "r.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in lines))
    periods = {S: {v: 1.0 for v in ("1f1b-flush", "pipedream", "pipedream+nesterov", "2bw")}
               for S in (4, 8)}
    text, figures = markdown(load(path), path, periods)
    assert figures["targets"] == {"lm|adamw": 3.0}
    # flush at S = 4 reaches 3.00 at 60 (seed 0: 2.995) and 90 (seed 1: 3.004 > 3.00 at 60)
    assert "| 4 | 1f1b-flush | 75 ± 21.2 (2/2) | 1.00 |" in text
    # seed by seed: 50 / 60 and 70 / 90 -> the worst seed 0.83
    assert "| 4 | pipedream+nesterov | 60 ± 14.1 (2/2) | 0.80 | 0.83 |" in text
    assert "| 4 | pipedream | 80 ± 0 (1/2) | 1.07 | - |" in text
    assert figures["best"] == {"lm|4|adamw": ["pipedream+nesterov", pytest.approx(0.8),
                                              pytest.approx(50 / 60)],
                               "lm|8|adamw": None}
    assert "met on 1 of 2 rows" in text


def test_goal_is_seed_by_seed(tmp_path: Path) -> None:
    """Means within 1.1x do not meet the goal when one seed is slower than 1.1x its flush."""
    flush = [{0: 5.0, 60: 2.9, 100: 2.8}, {0: 5.0, 60: 3.1, 100: 2.8}]  # target 3.00; 60, 100
    twobw = [{0: 5.0, 70: 2.9, 100: 2.8}, {0: 5.0, 80: 2.9, 100: 2.8}]  # 70, 80: means 0.94x
    lines = [rec("1f1b-flush", 4, s, e) for s, e in enumerate(flush)]
    lines += [rec("2bw", 4, s, e) for s, e in enumerate(twobw)]
    path = tmp_path / "r.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in lines))
    periods = {4: {v: 1.0 for v in ("1f1b-flush", "pipedream", "pipedream+nesterov", "2bw")}}
    text, figures = markdown(load(path), path, periods)
    assert figures["targets"] == {"lm|adamw": 3.0}
    assert "| 4 | 2bw | 75 ± 7.07 (2/2) | 0.94 | 1.17 |" in text  # seed 0: 70 / 60
    assert figures["best"] == {"lm|4|adamw": ["2bw", pytest.approx(75 / 80),
                                              pytest.approx(70 / 60)]}
    assert "met on 0 of 1 rows" in text
    assert "worst seed 1.167x flush's updates, means 0.94x (missed by 6.1%)" in text


def test_auto_replay_pays_the_losers_pilots() -> None:
    """auto_time by hand: identical pilot curves, so the faster pipedream (1.0 s per update
    against flush's 2.0) wins; flush's 10-update pilot is paid (20 s) and pipedream continues
    from its own to reach 3.00 at update 20 (20 s): 40 s."""
    from bench.ablation.long_report import auto_time

    losses = [5.0, 4.8, 4.6, 4.4, 4.2, 4.0, 3.8, 3.6, 3.4, 3.2, 3.0, 2.9]
    flush = rec("1f1b-flush", 4, 0, {0: 5.0, 30: 2.9})
    pd = rec("pipedream", 4, 0, {0: 5.0, 10: 3.5, 20: 2.95})
    flush["train_losses"], pd["train_losses"] = losses, losses
    recs = {"1f1b-flush": [flush], "pipedream": [pd]}
    per = {"1f1b-flush": 2.0, "pipedream": 1.0}
    # flush's level: the mean of its last 5 pilot losses, 3.6, at its 10th update (20 s);
    # pipedream reaches it at its 10th too (10 s) and stops its pilot there (12 read)
    assert auto_time(recs, 0, 10, per, 3.0, False, 1000) == ("pipedream", 10 * 2.0 + 20 * 1.0,
                                                             "piloted")
    # pipedream a tie on time (within the 5% margin): flush wins, pays pipedream's pilot (10
    # updates: flush's 10 s hold 10 of its 0.99 s) and reaches the target at 30
    per = {"1f1b-flush": 1.0, "pipedream": 0.99}
    assert auto_time(recs, 0, 10, per, 3.0, False, 1000) == ("1f1b-flush", 10 * 0.99 + 30 * 1.0,
                                                             "piloted")
    # a 30-update run: the losers' pilot (10 x 0.99 s) is more than a quarter of flush's 30 s,
    # so no pilot: flush alone, to its target at 30
    assert auto_time(recs, 0, 10, per, 3.0, False, 30) == ("1f1b-flush", 30.0, "priced out")


def test_auto_replay_judges_on_flushs_seconds() -> None:
    """pipedream (0.5 s per update) reaches flush's level (3.6) at its 16th update, past
    flush's 10-update pilot but within flush's 20 s (40 of its updates, at most 2P = 20
    read): it wins at 8 s against 20 s, stops its pilot at the segment end 20, and reaches the
    target at 20 (10 s) after flush's paid 20 s. On equal updates it would not have reached
    the level at all."""
    from bench.ablation.long_report import auto_time
    from fxpipe.runtime.training.auto import decide

    flush = rec("1f1b-flush", 4, 0, {0: 5.0, 30: 2.9})
    pd = rec("pipedream", 4, 0, {0: 5.0, 10: 3.5, 20: 2.95})
    flush["train_losses"] = [5.0, 4.8, 4.6, 4.4, 4.2, 4.0, 3.8, 3.6, 3.4, 3.2, 3.0, 2.9]
    pd["train_losses"] = [5.0 - 0.11 * i for i in range(24)]
    recs = {"1f1b-flush": [flush], "pipedream": [pd]}
    per = {"1f1b-flush": 2.0, "pipedream": 0.5}
    assert auto_time(recs, 0, 10, per, 3.0, False, 1000) == ("pipedream", 20.0 + 10.0, "piloted")
    equal_updates = {"1f1b-flush": flush["train_losses"][:10], "pipedream": pd["train_losses"][:10]}
    assert decide(equal_updates, per).schedule == "1f1b-flush"
