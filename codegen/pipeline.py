"""Run split stages one after another in this process: the reference semantics of a pipeline.

Autograd-transparent (the stages share the model's Parameter objects), so a backward through
``run_stages`` fills the same ``.grad`` fields as running the original model.
"""
from __future__ import annotations

import logging
from typing import Any, Mapping, Sequence

from fxpipe.errors import ConfigError

from .split import StageSpec, model_io

log = logging.getLogger(__name__)


def run_stages(stages: Sequence[StageSpec], args: Sequence[Any],
               kwargs: Mapping[str, Any] | None = None) -> Any:
    """Run ``stages`` in order on the model inputs ``args``/``kwargs``; return the model output.

    Values are routed by name: each stage reads its inputs from the model inputs or from what
    earlier stages produced, so a skip connection needs no relaying.
    """
    io = model_io(stages, "run_stages")
    if not isinstance(args, (tuple, list)):
        args = (args,)
    env: dict[str, Any] = io.bind_inputs(args, kwargs)
    for st in stages:
        missing = [n for n in st.inputs if n not in env]
        if missing:
            raise ConfigError(f"stage {st.index} needs {missing}, which no earlier stage produced",
                              hint="run the stages in index order")
        outs = st.gm(*(env[n] for n in st.inputs))
        if len(outs) != len(st.outputs):
            raise ConfigError(f"stage {st.index} returned {len(outs)} values, expected "
                              f"{len(st.outputs)}")
        env.update(zip(st.outputs, outs))
    return io.build_output(env)
