"""Training the LongSpark drafter: tap cache, parallel anchors, Carryover, offline eval.

Entry points: ``train_drafter(TrainConfig(...)) -> Path`` and ``evaluate_tau(...)``;
``add_train_args`` / ``from_args`` expose ``TrainConfig`` on a command line.
"""

from drafter_actor.training.config import TrainConfig, TrainError, add_train_args, from_args
from drafter_actor.training.evaluate import evaluate_tau
from drafter_actor.training.trainer import train_drafter

__all__ = [
    "TrainConfig",
    "TrainError",
    "add_train_args",
    "evaluate_tau",
    "from_args",
    "train_drafter",
]
