"""fxpipe.runtime.training: the training loop a user drives.

``Trainer`` and its parts, ``schedule="auto"`` (``auto``, ``auto_pilot``, ``auto_resolve``), data
streams and microbatch cutting (``data``, ``prefetch``, ``trainer_cut``, ``loss_split``), the
first minibatch checked before any step (``first_check``), metrics, checkpoints and resuming under
another plan (``checkpoint``, ``repartition``), re-planning a running trainer
(``trainer_switch``), optimizer groups by parameter name (``param_names``, ``recipes``). Imports
the four other packages; nothing in the runtime imports it.
"""
