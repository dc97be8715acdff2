"""Rank-adaptive training inside other people's training loops.

``comera.integrations.hf.CoMERACallback`` (HuggingFace ``Trainer``, the ``hf`` extra) and
``comera.integrations.lightning.CoMERACallback`` (``lightning.Trainer``, the ``lightning``
extra) drive a :class:`~comera.training.controller.RankController` from the trainer's hooks.
Importing this package imports neither library.
"""

from comera.integrations.bonds import follow_saved_bonds_
from comera.integrations.schedule import StageSchedule

__all__ = ["StageSchedule", "follow_saved_bonds_"]
