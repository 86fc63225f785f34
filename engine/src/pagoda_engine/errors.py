"""Typed errors a user can cause. The server maps them to OpenAI-shaped HTTP errors."""


class PagodaError(Exception):
    """Base class of every error Pagoda raises on purpose."""


class InvalidRequestError(PagodaError, ValueError):
    """A request (prompt, sampling values) is invalid. HTTP 400.

    `param` names the offending field, as in OpenAI's error shape.
    """

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param


class ModelLoadError(PagodaError):
    """The model directory is missing, unreadable, or holds an architecture we do not serve."""


class UnsupportedArchitectureError(ModelLoadError):
    """config.json names an architecture missing from the model registry."""


class EngineDeadError(PagodaError):
    """The engine core process died; no request can be served."""


class InvalidEnvironmentError(PagodaError, ValueError):
    """A PAGODA_* environment variable holds a value the engine cannot use (`pagoda_engine.envs`)."""
