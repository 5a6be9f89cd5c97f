"""backends-trainer: the trainer's half of a weight update.

:class:`WeightPusher` puts a torch model's weights on every server of a :class:`backends_core.Client`, over a
transfer group (broadcast in the order and buckets each engine receives in) or through a checkpoint directory,
inside one ``weight_sync`` (paused, updated, versioned, flushed, resumed, checked). ``backends_trainer.trl``
runs TRL's ``GRPOTrainer`` on any backend.
"""

from __future__ import annotations

from backends_trainer.checkpoint import CheckpointDir
from backends_trainer.pusher import PushReport, WeightPusher
from backends_trainer.reference import Reference, reference_shapes
from backends_trainer.sync import SyncWeightPusher

__all__ = ["CheckpointDir", "PushReport", "Reference", "SyncWeightPusher", "WeightPusher", "reference_shapes"]
