from .loading import LoadedModel, load_model
from .runner import ModelRunner, RunnerOutput

__all__ = ["LoadedModel", "ModelRunner", "RunnerOutput", "load_model"]
