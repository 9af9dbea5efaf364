"""ccft.train: CCFT and Full-FT training (recipes, data, the trainer, the on-disk C_base store).

``run_training(cfg)`` is the recipe entry point behind ``ccft train``; the pieces it assembles are
``ccft.train.config.TrainConfig``, ``ccft.train.data`` and ``ccft.train.trainer.CacheConditionedTrainer``.
"""

from ccft.core.deprecation import moved_name_getattr
from ccft.train.run import TrainResult, load_split, run_training, setup

__all__ = ["TrainResult", "load_split", "run_training", "setup"]


__getattr__ = moved_name_getattr(__name__)  # 0.1 names: ccft.core.deprecation.MOVED_NAMES
