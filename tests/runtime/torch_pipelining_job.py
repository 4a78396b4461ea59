"""Worker for test_runtime_torch_pipelining: one rank of a torch.distributed.pipelining run on
fxpipe's stages. ``run(rank, world, port, case, outdir)`` trains ``STEPS`` batches with a torch
schedule and saves this rank's parameters (by the model's names) and its losses."""
from __future__ import annotations

import os
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import pipelining as tp

from fxpipe.runtime.execution.torch_pipelining import torch_stages

STEPS = 2


def run(rank: int, world: int, port: int, case: dict[str, Any], outdir: str) -> None:
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world, timeout=timedelta(seconds=60))
        pipe = torch_stages(case["stages"], rank, world, placement=case["placement"])
        cls = getattr(tp, case["schedule"])
        m = case["microbatches"]
        sched = cls(pipe.stages if len(pipe.stages) > 1 or cls.__name__ not in
                    ("Schedule1F1B", "ScheduleGPipe") else pipe.stages[0],
                    n_microbatches=m, loss_fn=case["loss_fn"])
        opt = case["optimizer"](list(pipe.parameters()))
        losses: list[float] = []
        for x, y in case["data"]:
            opt.zero_grad()
            mb_losses: list[torch.Tensor] = []
            if pipe.first:
                sched.step(*pipe.inputs(x), target=y, losses=mb_losses)
            else:
                sched.step(target=y, losses=mb_losses)
            losses += [float(v.detach()) for v in mb_losses]
            pipe.sync_tied_grads()
            opt.step()
        params = {n: p.detach().clone() for m_ in pipe.modules
                  for n, p in m_.stage.named_parameters()}
        torch.save({"params": params, "losses": losses}, Path(outdir) / f"rank{rank}.pt")
        dist.destroy_process_group()
    except BaseException as err:  # noqa: BLE001 - a failing rank must exit non-zero, now
        import traceback
        (Path(outdir) / f"rank{rank}.err").write_text(f"{type(err).__name__}: {err}\n"
                                                        f"{traceback.format_exc()}")
        os._exit(1)
