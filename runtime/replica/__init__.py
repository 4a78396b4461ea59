"""fxpipe.runtime.replica: one stage replica's computation (torch, no torch.distributed).

Compute and weights: ``stage``, ``stage_update``, ``stage_set``, ``stage_call``, ``splitgrad``,
``stash``, ``weighted``. Numerics: ``precision``, ``master``, ``loss_scale``, ``clipping``,
``global_step``, ``step_options``. Staleness and optimizers: ``mitigation``, ``compensate``,
``nesterov``, ``muon``. Device and memory: ``device``, ``live_bytes``, ``state_size``.
"""
