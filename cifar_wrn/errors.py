"""The exceptions the entry points turn into a plain message (no traceback) and an exit status."""


class UserError(Exception):
    """Something the user can fix: bad input, missing data, a process group that did not form.

    Entry points catch it, print `error: <message>` and exit with status 2. Everything else is a
    bug or a crash and is reported with its traceback.
    """


class RunStopped(Exception):
    """Every rank stops together at the same step; rank 0 prints why; all exit with `status`."""

    def __init__(self, message: str, status: int):
        super().__init__(message)
        self.status = status
