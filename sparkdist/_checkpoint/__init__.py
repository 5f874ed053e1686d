"""Checkpoints on ``torch.distributed.checkpoint``: the step layout and its commit marker
(``layout``, pure), DCP reads and writes (``dcp``), the ranks' collectives (``ranks``),
weights-only pickles (``pickles``), state-dict notes (``state``), DeepSpeed's own checkpoints
(``deepspeed_engine``) and its universal format (``universal``); ``api`` is what
``sparkdist.runtime`` exposes.

Runs in: a rank's process (and the driver, which reads the newest committed step). Started by:
``runtime.save_checkpoint`` / ``load_checkpoint``.
May import: ``_core`` only (torch and DeepSpeed lazily, when a checkpoint is used).
"""
