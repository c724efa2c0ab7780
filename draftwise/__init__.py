"""draftwise: faster LLM decoding with draft, companion and verifier models."""

from draftwise.api import Generation, StreamEvent, batched_methods, generate, stream
from draftwise.errors import DraftwiseError, ModelNotAvailableError
from draftwise.methods import METHODS
from draftwise.models import LoadedModel, load_model
from draftwise.engine.sampling import SamplingConfig

__all__ = [
    "METHODS", "DraftwiseError", "Generation", "LoadedModel", "ModelNotAvailableError", "SamplingConfig",
    "StreamEvent", "batched_methods", "generate", "load_model", "stream",
]
__version__ = "0.1.0"
