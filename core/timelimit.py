"""A time limit for Python code that runs a user's file: a chat template is a program, and one
that loops for hours must not hang the engine (and the app, the server) that renders it."""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Callable
from typing import TypeVar

from pagechat.core.errors import PagechatError

T = TypeVar("T")


class _Expired(BaseException):
    """Raised into the thread that overran its limit (a BaseException: no `except Exception` in
    the code it interrupts swallows it)."""


def within(seconds: float, what: str, call: Callable[[], T]) -> T:
    """call() on this thread, interrupted after `seconds` with a PagechatError naming `what`.

    A timer thread raises _Expired into this one (CPython's PyThreadState_SetAsyncExc), which
    Python code sees at its next bytecode: unlike a signal it works on any thread (the app's
    engine loop, the server's). One long C call (a huge string repeat) is not interrupted.
    """
    me, lock, done = threading.get_ident(), threading.Lock(), []

    def expire() -> None:
        with lock:
            if not done:
                ctypes.pythonapi.PyThreadState_SetAsyncExc(
                    ctypes.c_ulong(me), ctypes.py_object(_Expired)
                )

    timer = threading.Timer(seconds, expire)
    timer.daemon = True
    timer.start()
    try:
        try:
            return call()
        finally:
            with lock:
                done.append(True)
            timer.cancel()
    except _Expired:
        raise PagechatError(f"{what} did not finish within {seconds:g} s") from None
