"""The one base class for errors a user can act on; the CLI prints their message and exits 1."""


class UserError(RuntimeError):
    """An error whose message says what happened and what to do."""
