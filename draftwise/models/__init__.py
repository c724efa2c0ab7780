from .loading import LoadedModel, load_model
from .runner import ModelRunner

__all__ = ["LoadedModel", "ModelRunner", "load_model"]
