"""Text generation: sequences, the step scheduler, the engine's step loop, streams, stop
strings, the step time model and the metrics.

Knows no concrete model and no HTTP: the engine drives a ``models.Generator`` on the
replica's ``batching.ModelThread``.
"""

from .config import EngineConfig
from .engine import GenerationEngine
from .metrics import GenerationMetrics, ModelGenerationMetrics
from .roster import SequenceCancelled
from .scheduler import StepBudget, StepPlan, schedule
from .sequence import SeqState, Sequence, SequenceSpec
from .stops import StopText
from .stream import RequestStream, TokenEvent, TokenLogprob
from .timing import StepTimeModel

__all__ = [
    "EngineConfig",
    "GenerationEngine",
    "GenerationMetrics",
    "ModelGenerationMetrics",
    "RequestStream",
    "SeqState",
    "Sequence",
    "SequenceCancelled",
    "SequenceSpec",
    "StepBudget",
    "StepPlan",
    "StepTimeModel",
    "StopText",
    "TokenEvent",
    "TokenLogprob",
    "schedule",
]
