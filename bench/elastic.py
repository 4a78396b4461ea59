"""Elastic restart on emulated hosts: torchrun's elastic agent, one host killed mid-epoch.

    sudo .venv/bin/python -m bench.elastic [--hosts 3] [--out FILE.md]

Three hosts (network namespaces, tools/cluster) each run one torchrun agent with
``--nnodes 2:3 --max-restarts 3 --rdzv-backend c10d`` (host 0 holds the rendezvous store) and
one worker ``fxpipe.cli_train gpt --elastic`` (a GPT mini learning counting sequences, AdamW with
named groups, LR warm-up, 1f1b-flush with 4 microbatches, a checkpoint every 8 minibatches into
one shared folder; each minibatch is read with a 0.1 s delay so the run lasts long enough to be
cut mid-epoch). Once the
checkpoint at minibatch 16 of epoch 1 is complete, every process of the last host is SIGKILLed.
The survivors' workers fail (a dead peer), their agents re-rendezvous with 2 nodes, and the
workers re-plan for WORLD_SIZE=2 and resume from the newest complete checkpoint.

Checks (printed, and the script exits non-zero when one fails):
* the restart ran on 2 workers with a plan other than the first one's, from a checkpoint;
* a FRESH 2-host run (static torchrun) from a copy of that checkpoint alone, with the same
  plan, logs exactly the same per-update losses as the elastic run after its restart, and ends
  with bit-identical weights;
* the elastic run's final evaluation loss against an uninterrupted 3-host run (1f1b-flush trains
  the same sums under every plan, so they agree to float rounding).

Needs root (network namespaces). Results go to benchmarks/elastic.md.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench._report import publish
from tools.cluster import EmulatedCluster, read_output, wait_all
from tools.cluster.netns import namespace_pids

ROOT = Path(__file__).resolve().parents[1]

DATA = '''"""A slow, learnable loader for bench/elastic.py: counting sequences (each token is the
previous one + 1 mod 128) in the GPT mini's shape, read with a delay of {delay} s."""
import time

import torch


def batch(k, size=4, seq=16, vocab=128):
    g = torch.Generator().manual_seed(k)
    tokens = (torch.randint(0, vocab, (size, 1), generator=g) + torch.arange(seq + 1)) % vocab
    return (tokens[:, :-1].contiguous(),), tokens[:, 1:].contiguous()


class Slow:
    def __init__(self, items, delay):
        self.items, self.delay = items, delay

    def __len__(self):
        return len(self.items)

    def __iter__(self):
        for b in self.items:
            time.sleep(self.delay)
            yield b


def loaders():
    return Slow([batch(k) for k in range({n})], {delay}), [batch(10_000 + k) for k in range(8)]
'''


def worker_args(work: Path, ckpt: Path, tag: str, epochs: int) -> list[str]:
    return ["-m", "fxpipe.cli_train", "gpt", "--data", f"{work / 'data.py'}:loaders",
            "--seq-len", "32", "--schedule", "1f1b-flush", "--microbatches", "4",
            "--optimizer", "adamw", "--lr", "1e-2", "--weight-decay", "0.1", "--warmup", "4",
            "--epochs", str(epochs), "--checkpoint-dir", str(ckpt), "--checkpoint-every", "8",
            "--timeout", "20", "--elastic", "--no-progress",
            "--metrics", str(work / f"{tag}.jsonl"), "--save", str(work / f"{tag}.pt")]


def agents(c: EmulatedCluster, hosts: list[int], argv: list[str], work: Path, tag: str,
           elastic: str | None, port: int) -> list[subprocess.Popen]:
    """One torchrun agent per host: elastic (c10d, ``--nnodes MIN:MAX``) or static."""
    env = {"GLOO_SOCKET_IFNAME": "eth0", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": str(ROOT)}
    procs = []
    for i, h in enumerate(hosts):
        if elastic:
            launch = ["--nnodes", elastic, "--max-restarts", "3", "--rdzv-backend", "c10d",
                      "--rdzv-endpoint", f"{c.address(hosts[0])}:{port}", "--rdzv-id", tag,
                      # host 0 holds the store: torchrun cannot tell (the namespaces share
                      # one hostname, which resolves to none of their addresses)
                      "--rdzv-conf", f"last_call_timeout=5,is_host={int(i == 0)}",
                      "--local-addr", c.address(h)]
        else:
            launch = ["--nnodes", str(len(hosts)), "--node-rank", str(i), "--master-addr",
                      c.address(hosts[0]), "--master-port", str(port), "--max-restarts", "0",
                      "--local-addr", c.address(h)]
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "1",
               *launch, *argv]
        path = work / f"{tag}-host{h}.log"
        with open(path, "wb") as out:
            p = c.run(h, cmd, env=env, stdout=out, stderr=subprocess.STDOUT)
        p.log_path = path  # type: ignore[attr-defined]
        procs.append(p)
    return procs


def records(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--hosts", type=int, default=3)
    p.add_argument("--minibatches", type=int, default=48, help="per epoch")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--kill-at", type=int, default=16, help="kill after this checkpoint (epoch 1)")
    p.add_argument("--work", default=None, help="keep the run's files here")
    p.add_argument("--out", default=None, help="write the markdown here, not benchmarks/elastic.md")
    a = p.parse_args(argv)
    work = Path(a.work or tempfile.mkdtemp(prefix="fxp-elastic-"))
    work.mkdir(parents=True, exist_ok=True)
    (work / "data.py").write_text(DATA.format(n=a.minibatches, delay=0.1))
    last = a.hosts - 1
    with EmulatedCluster(a.hosts, bandwidth="1Gbit", latency=0, prefix="fxpel") as c:
        # 1. the elastic run; one host dies mid-epoch
        t0 = time.monotonic()
        run = agents(c, list(range(a.hosts)), worker_args(work, work / "ckpt", "elastic",
                                                          a.epochs),
                     work, "elastic", f"2:{a.hosts}", 29400)
        mark = work / "ckpt" / f"e0000-m{a.kill_at:07d}" / "manifest.json"
        while not mark.exists():
            if any(q.poll() is not None for q in run) or time.monotonic() - t0 > 600:
                print("\n".join(read_output(q)[-3000:] for q in run))
                raise SystemExit("the elastic run ended or stalled before the kill point")
            time.sleep(0.05)
        killed = namespace_pids(c.namespaces[last])
        for pid in killed:
            os.kill(pid, signal.SIGKILL)
        t_kill = time.monotonic() - t0
        codes = wait_all(run[:last], timeout=900)
        t_end = time.monotonic() - t0
        logs = "".join(read_output(q) for q in run)
        starts = re.findall(r"elastic: restart (\d+), world (\d+), plan replicas (\[[^\]]*\]): "
                            r"(resuming from (e\d+-m\d+)|starting fresh)", logs)
        print("\n".join(" ".join(s[:4]) for s in starts))
        first, again = starts[0], starts[-1]
        folder = again[4]
        # 2. a fresh static 2-host run from a copy of that checkpoint alone, same plan
        shutil.copytree(work / "ckpt" / folder, work / "ckpt-fresh" / folder)
        fresh = agents(c, list(range(last)), worker_args(work, work / "ckpt-fresh", "fresh",
                                                         a.epochs),
                       work, "fresh", None, 29500)
        fresh_codes = wait_all(fresh, timeout=900)
        fresh_log = "".join(read_output(q) for q in fresh)
        # 3. an uninterrupted run on every host (the target)
        base = agents(c, list(range(a.hosts)), worker_args(work, work / "ckpt-base", "base",
                                                           a.epochs),
                      work, "base", None, 29600)
        base_codes = wait_all(base, timeout=900)
    import torch

    el, fr = records(work / "elastic.jsonl"), records(work / "fresh.jsonl")
    el_train = [r for r in el if r["kind"] == "train"]
    fr_train = [r for r in fr if r["kind"] == "train"]
    after = el_train[len(el_train) - len(fr_train):]  # the restarted run's records come last
    same_losses = [r["loss"] for r in after] == [r["loss"] for r in fr_train]
    s_el = torch.load(work / "elastic.pt", weights_only=True)
    s_fr = torch.load(work / "fresh.pt", weights_only=True)
    s_base = torch.load(work / "base.pt", weights_only=True)
    same_weights = s_el.keys() == s_fr.keys() and all(torch.equal(s_el[k], s_fr[k])
                                                      for k in s_el)
    drift = max(float((s_el[k] - s_base[k]).abs().max()) for k in s_el)
    runs = (("elastic", el), ("fresh", fr), ("base", records(work / "base.jsonl")))
    ev = {tag: [r["eval_loss"] for r in recs if r["kind"] == "eval"] for tag, recs in runs}
    acc = {tag: [r.get("eval_accuracy", 0.0) for r in recs if r["kind"] == "eval"]
           for tag, recs in runs}

    def fmt(xs: list[float]) -> str:
        return "[" + ", ".join(f"{x:.4f}" for x in xs) + "]"
    fresh_plan = re.search(r"plan replicas (\[[^\]]*\])", fresh_log)
    ok = (codes == [0] * last and fresh_codes == [0] * last and base_codes == [0] * a.hosts
          and again[1] == str(last) and again[3].startswith("resuming")
          and first[2] != again[2] and fresh_plan is not None
          and fresh_plan.group(1) == again[2] and same_losses and same_weights)
    md = [f"## Elastic restart: {a.hosts} emulated hosts, one killed mid-epoch (`bench/elastic.py`)",
          "", f"Command: `sudo .venv/bin/python -m bench.elastic --hosts {a.hosts}` "
          f"({a.minibatches} minibatches per epoch, {a.epochs} epochs, 0.1 s per read, "
          "torchrun `--nnodes 2:3 --max-restarts 3 --rdzv-backend c10d`).", "",
          "| | value |", "|---|---|",
          f"| first start | world {first[1]}, plan replicas {first[2]} |",
          f"| host {last} killed (SIGKILL, all its processes) | {t_kill:.1f} s after launch, "
          f"after checkpoint e0000-m{a.kill_at:07d} |",
          f"| restart | #{again[0]}, world {again[1]}, plan replicas {again[2]}, {again[3]} |",
          f"| survivors' exit codes | {codes} (elastic run ended {t_end:.1f} s after launch) |",
          f"| fresh 2-host run from a copy of {folder} | exit {fresh_codes}, plan replicas "
          f"{fresh_plan.group(1) if fresh_plan else '?'} |",
          f"| losses after the restart == fresh run's (metrics records, one per segment) | "
          f"{same_losses} ({len(fr_train)} records, compared exactly) |",
          f"| final weights bit-identical to the fresh run's | {same_weights} |",
          f"| eval loss per epoch: elastic / fresh / uninterrupted {a.hosts} hosts | "
          f"{fmt(ev['elastic'][-a.epochs:])} / {fmt(ev['fresh'])} / {fmt(ev['base'])} |",
          f"| eval accuracy per epoch: elastic / uninterrupted {a.hosts} hosts | "
          f"{fmt(acc['elastic'][-a.epochs:])} / {fmt(acc['base'])} |",
          f"| max abs weight difference to the uninterrupted run | {drift:.3g} |",
          "", f"All checks passed: {ok}."]
    publish("elastic", "\n".join(md), a.out)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
