"""Rank-adaptive training inside other people's training loops.

``comera.integrations.hf.CoMERACallback`` (HuggingFace ``Trainer``, the ``hf`` extra) and
``comera.integrations.lightning.CoMERACallback`` (``lightning.Trainer``, the ``lightning``
extra) drive a :class:`~comera.training.controller.RankController` from the trainer's hooks;
``comera.integrations.fsdp`` shards a model with FSDP2 while its rank gates stay whole.
Importing this package imports none of these libraries.
"""

from comera.integrations.bonds import follow_saved_bonds_
from comera.integrations.stage_callback import StageSchedule

__all__ = ["StageSchedule", "follow_saved_bonds_"]
