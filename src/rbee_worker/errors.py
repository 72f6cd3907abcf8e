"""Errors that reach users as one clear line (the CLI prints `error: <message>`)."""


class ModelLoadError(Exception):
    """The model cannot be loaded. The message says what is wrong and what to do; the CLI exits with code 2."""


class DeviceError(ModelLoadError):
    """The requested device or dtype cannot be used here."""


class BindError(Exception):
    """The HTTP port cannot be bound; the CLI exits 3."""


class RegistrationError(Exception):
    """The pool manager did not accept the ready callback. One line: what happened and what to do; the CLI exits 3."""


class GenerationError(Exception):
    """`rbee-worker generate`'s request was refused (`invalid_request`: exit 2) or failed while generating (exit 1)."""

    def __init__(self, message: str, invalid_request: bool) -> None:
        super().__init__(message)
        self.invalid_request = invalid_request
