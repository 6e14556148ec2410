"""The one error type a user sees: a single line naming what is wrong and where."""


class PagechatError(Exception):
    """Bad input or an impossible request; the CLI prints it as one line and exits with code 2."""


def check_text(text: str, what: str) -> str:
    """Return text when it can be written as UTF-8; undecodable input bytes reach Python as lone
    surrogates, which tokenizers and JSON files refuse later with a traceback."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise PagechatError(f"{what} is not valid UTF-8 text") from None
    return text


def one_line(error: BaseException) -> str:
    """An exception as the one line a user is shown: a PagechatError's own message, any other
    exception's type and message, its line breaks folded."""
    why = str(error) if isinstance(error, PagechatError) else f"{type(error).__name__}: {error}"
    return " ".join(why.split())
