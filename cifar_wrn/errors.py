"""The one exception type the entry points print as a plain message (no traceback)."""


class UserError(Exception):
    """Something the user can fix: bad input, missing data, a process group that did not form.

    Entry points catch it, print `error: <message>` and exit with status 2. Everything else is a
    bug or a crash and is reported with its traceback.
    """
