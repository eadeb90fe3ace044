"""Errors meant for the user: printed as one clear message, never as a traceback."""


class UserError(Exception):
    """A mistake the user can fix (bad inventory, a failed check, a failed job).

    The message names the file/host/field, what was wrong and how to fix it. `exit_code` is what
    the command exits with.
    """

    def __init__(self, message: str, exit_code: int = 1) -> None:
        super().__init__(message)
        self.exit_code = exit_code
