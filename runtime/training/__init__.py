"""fxpipe.runtime.training: the training loop a user drives; nothing in the runtime imports it.

The loop (``trainer``, its options in sections in ``config``, with ``trainer_schedule``,
``trainer_cut``, ``trainer_checkpoint``, ``trainer_results``, ``trainer_progress``,
``trainer_switch``; ``host``: the trainer as auto and the re-planner drive it),
``schedule="auto"`` (``auto``, ``auto_level``, ``auto_pilot``,
``auto_pipeline``, ``auto_look``, ``auto_resolve``, ``auto_data``, ``auto_memory``), the data
(``data``, ``prefetch``, ``minibatch``, ``loss_split``), what is checked before a run
(``first_check``, ``memory_fit``, ``stage_calibration``), state (``checkpoint``, ``repartition``),
optimizers (``param_names``, ``recipes``) and what a run logs (``metrics``).
"""
