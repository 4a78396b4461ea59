"""fxpipe.runtime.execution: carrying schedules out, in one process or many.

Executors: ``contract``, ``reference`` (the oracle), ``localsgd_executor``, ``executor`` and
``rank_update`` (a distributed rank), ``sharding`` (its optimizer state split over the
stage's replicas), ``hosted`` (several stages a process); processes: ``launch``,
``worker``, ``ports``, ``cores``, ``agree``, ``leave``, ``trainer_backends``; transport: ``comm``,
``wire``, ``buckets``; ``torch_pipelining``; overheads: ``overhead_probe``, ``overhead_local``.
"""
