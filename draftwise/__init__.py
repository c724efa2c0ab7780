"""draftwise: faster LLM decoding with draft, companion and verifier models."""

from .api import Generation, StreamEvent, batched_methods, generate, stream
from .errors import DraftwiseError, ModelNotAvailableError
from .methods import METHODS
from .models import LoadedModel, load_model
from .sampling import SamplingConfig

__all__ = [
    "METHODS", "DraftwiseError", "Generation", "LoadedModel", "ModelNotAvailableError", "SamplingConfig",
    "StreamEvent", "batched_methods", "generate", "load_model", "stream",
]
__version__ = "0.1.0"
