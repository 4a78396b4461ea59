"""fxpipe.runtime.execution: carrying schedules out, in one process or many.

The run contract (``contract``), the single-process oracle (``reference``), the distributed
executor and its ranks (``executor``, ``worker``, ``hosted``, ``launch``), what travels between
them (``comm``, ``wire``, ``buckets``, ``allocator``, ``agree``), LocalSGD, torch's own pipelining
schedules, and the trainer's backends. The only package of fxpipe that imports
torch.distributed; imports ``replica`` and ``schedules``.
"""
