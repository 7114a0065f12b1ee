"""What a training loop needs around the math: the rollout queue, checkpoints, metrics, progress.

* ``minippo.training.rollout_queue``: background generation with a staleness bound.
* ``minippo.training.checkpoint``: atomic DCP checkpoints (``Checkpointer``), RNG capture.
* ``minippo.training.metrics``: loggers behind one interface (jsonl, stdout, TensorBoard, W&B).
* ``minippo.training.nan_guard``: skip optimizer steps with a non-finite loss or gradient norm.
* ``minippo.training.evaluation``: mean reward, unbiased pass@k, lengths of samples of a prompt
  set (the eval recipe, validation inside training).
* ``minippo.training.progress``: the tqdm bar; ``minippo.training.schedules``: LR schedules;
  ``minippo.training.plot``: plot a metrics.jsonl.
"""
