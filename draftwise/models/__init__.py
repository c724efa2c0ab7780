from draftwise.models.loading import LoadedModel, load_model
from draftwise.models.runner import ModelRunner

__all__ = ["LoadedModel", "ModelRunner", "load_model"]
