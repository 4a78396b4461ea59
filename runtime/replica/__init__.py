"""fxpipe.runtime.replica: one stage replica's computation. torch, no torch.distributed.

Forward, backward and update of one stage (``stage``, ``stage_update``, ``stage_set``,
``stage_call``, ``splitgrad``), its weight versions (``stash``, ``master``), numerics
(``precision``, ``loss_scale``, ``clipping``, ``global_step``), the scale a cut minibatch's loss
takes (``weighted``), staleness mitigations
(``mitigation``, ``compensate``), the options a step takes (``step_options``) and the device a
rank uses (``device``). Imports ``schedules``; never ``pricing``.
"""
