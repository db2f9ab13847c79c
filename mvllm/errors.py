"""The exceptions mvllm raises for bad input; each carries one sentence a user can act on."""


class MvllmError(Exception):
    """Base class: the message is meant to be shown to a user as it is."""


class ModelNotFoundError(MvllmError):
    pass


class UnsupportedModelError(MvllmError):
    pass


class InvalidRequestError(MvllmError, ValueError):
    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class PromptTooLongError(InvalidRequestError):
    pass


class ContextLengthError(InvalidRequestError):
    """prompt + max_tokens do not fit the model's context (vLLM answers the same with a 400)."""
