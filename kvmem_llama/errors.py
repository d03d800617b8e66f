"""Errors that carry a message meant for the user; the CLI prints them without a traceback."""


class KvmemError(Exception):
    """A failure the user can act on. `hint` says what to do about it."""

    exit_code = 1

    def __init__(self, message: str, hint: str | None = None):
        super().__init__(message)
        self.hint = hint


class VerificationError(KvmemError):
    """A downloaded or cached artifact is not the one we pinned."""


class PatchError(KvmemError):
    """A patch of our series does not apply to the pinned tree."""


class BuildError(KvmemError):
    """The engine build failed or cannot start."""
