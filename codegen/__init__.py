"""fxpipe.codegen: split a traced graph into pipeline stages, run, export and draw them.

``split`` makes the stages and ``pipeline`` runs them in one process; ``export`` and ``sourcegen``
write them as readable Python; ``carry`` adapts them to torch's pipelining; ``visualize`` draws.
"""
from .export import export_stages, load_exported
from .pipeline import run_stages
from .split import StageSpec, split_graph
from .visualize import draw_overview, draw_plan

__all__ = ["split_graph", "StageSpec", "run_stages", "export_stages", "load_exported", "draw_plan",
           "draw_overview"]
