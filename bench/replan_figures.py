"""Per-rank timeline pictures for bench/replan.py: one row per rank, what it did when.

Why pictures: a re-plan is justified by idle time, and idle time is what a table of
throughputs hides. Each rank's runtime timeline (``fxpipe.runtime.timeline``: forward,
backward, optimizer, send postings, receive waits, all-reduce, idle) of one segment is drawn as
coloured bars on a common clock (the ranks run on one machine, so their ``perf_counter`` agree);
white is idle. The panels: the ``replan`` run's last segment under the wrong plan (what the
re-plan measured), its segment of median length under the new plan, and the ``right`` and
``wrong`` runs' segments of median length, all on one time scale.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

COLOURS = {"forward": "#4c72b0", "backward": "#dd8452", "optimizer": "#55a868",
           "allreduce": "#8172b3", "recv": "#c44e52", "send": "#937860"}
LABELS = {"forward": "F (forward)", "backward": "B (backward)", "optimizer": "U (update)",
          "allreduce": "all-reduce", "recv": "receive wait", "send": "send (posting)"}


def load(work: Path, run: str) -> dict[int, list[dict[str, Any]]]:
    """rank -> that rank's segments (as the worker wrote them) of the last repeat's ``run``."""
    out = {}
    for f in sorted(work.glob(f"last-{run}-rank*.json")):
        out[int(f.stem.rsplit("rank", 1)[1])] = json.loads(f.read_text())
    return out


def segment(ranks: dict[int, list[dict[str, Any]]], index: int
            ) -> tuple[dict[int, list[list[Any]]], dict[int, list[int]]]:
    """Every rank's events of segment ``index``, shifted so the segment starts at 0."""
    evs = {r: segs[index]["events"] for r, segs in ranks.items()}
    t0 = min(e[2] for es in evs.values() for e in es)
    return ({r: [[c, n, s - t0, e - t0] for c, n, s, e in es] for r, es in evs.items()},
            {r: segs[index]["stage"] for r, segs in ranks.items()})


def typical(ranks: dict[int, list[dict[str, Any]]], candidates: list[int]) -> int:
    """Of the segments ``candidates``, the one of median length (a single segment on a shared
    machine may hold a stall of tens of ms that is not the plan's)."""
    def span(i: int) -> float:
        evs = [e for segs in ranks.values() for e in segs[i]["events"]]
        return max(e[3] for e in evs) - min(e[2] for e in evs)
    ordered = sorted(candidates, key=span)
    return ordered[len(ordered) // 2]


def draw(ax: Any, evs: dict[int, list[list[Any]]], stages: dict[int, list[int]], title: str,
         xmax: float) -> None:
    for row, r in enumerate(sorted(evs)):
        for c, name, s, e in evs[r]:
            if c in COLOURS:
                ax.broken_barh([(s * 1e3, (e - s) * 1e3)], (row - 0.4, 0.8),
                               facecolors=COLOURS[c], edgecolor="none")
                if c in ("forward", "backward") and (e - s) * 1e3 > xmax / 60:
                    ax.text((s + e) / 2 * 1e3, row, name.split()[0], ha="center",
                            va="center", fontsize=6, color="white")
    ax.set_yticks(range(len(evs)))
    ax.set_yticklabels([f"rank {r}\nstage {stages[r][0][0] if stages[r] else '?'}"
                        for r in sorted(evs)], fontsize=8)
    ax.set_ylim(len(evs) - 0.5, -0.5)
    ax.set_xlim(0, xmax)
    ax.set_title(title, fontsize=9, loc="left")
    ax.set_facecolor("white")
    ax.grid(axis="x", color="#dddddd", linewidth=0.5)


def plot_timelines(work: Path, out_dir: Path, stem: str, batch: int
                   ) -> list[tuple[str, Path]]:
    """Draw the pictures; returns (caption, path) of each png written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    rp, right, wrong = load(work, "replan"), load(work, "right"), load(work, "wrong")
    if not rp or not right:
        return []
    segs = rp[0]
    last_old = max(i for i, s in enumerate(segs) if s["plan"] == 0)
    new = [i for i, s in enumerate(segs) if s["plan"] == 1][1:]  # the new plan's first warms up
    panels = [(f"replan run, segment {last_old}: the wrong plan (what the re-plan measured)",
               *segment(rp, last_old))]
    if new:
        k = typical(rp, new)
        panels.append((f"replan run, segment {k}: after the re-plan (new plan)",
                       *segment(rp, k)))
    k = typical(right, list(range(2, len(right[0]))))
    panels.append((f"right run, segment {k}: the right plan", *segment(right, k)))
    if wrong:
        k = typical(wrong, list(range(2, len(wrong[0]))))
        panels.append((f"wrong run, segment {k}: the wrong plan kept", *segment(wrong, k)))
    xmax = max(e[3] for _, evs, _ in panels for es in evs.values() for e in es) * 1e3
    fig, axes = plt.subplots(len(panels), 1, figsize=(11, 1.3 + 1.1 * sum(
        len(p[1]) for p in panels) / len(panels) * len(panels)), sharex=True)
    for ax, (title, evs, stages) in zip(axes, panels):
        end = max(e[3] for es in evs.values() for e in es)
        draw(ax, evs, stages, f"{title}: {end * 1e3:.0f} ms for 8 minibatches "
             f"({8 * batch / end:.0f} samples/s)", xmax)
    axes[-1].set_xlabel("ms since the segment's first event")
    fig.legend(handles=[Patch(color=v, label=LABELS[k]) for k, v in COLOURS.items()],
               loc="lower center", ncol=6, fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{stem}.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return [("per-rank timelines before and after the re-plan", path)]
