"""The one error type a user sees: a single line naming what is wrong and where."""


class PagechatError(Exception):
    """Bad input or an impossible request; the CLI prints it as one line and exits with code 2."""
