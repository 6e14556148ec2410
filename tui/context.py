"""Long chats go on: which of a conversation's oldest turns to leave out so the next one fits.

A chat grows by a turn at a time; the model's context does not. Before each reply the engine's
loop encodes the conversation and, when it and room for the reply do not fit the context, leaves
out the oldest turns (a user message and its reply; the system prompt always stays) until they do,
or refuses the turn when the chat is set to refuse ("the chat is full: start a new one"). The app
then sends only the kept part, so its tokens stay a prefix the engine's cache can serve.
"""

from __future__ import annotations

from collections.abc import Callable

from pagechat.core.errors import PagechatError

WHEN_FULL = ("drop", "refuse")  # what a full chat does: drop its oldest turns, or refuse the turn
NEW_CHAT = "Ctrl+N starts a new chat"


def reply_room(max_tokens: int, context: int) -> int:
    """Tokens kept free for the reply: its max_tokens, but at most a quarter of the context (a
    512-token context would otherwise hold no history beside a 512-token reply limit)."""
    return max(1, min(max_tokens, context // 4))


def fit_turns(
    messages: list[dict],
    encode: Callable[[list[dict]], list[int]],
    context: int,
    room: int,
    when_full: str = "drop",
) -> tuple[list[int], int]:
    """(the token ids of the conversation that fits, how many messages were left out of it).

    Whole turns go, oldest first, from after the system prompt; the last user message is never
    left out (a prompt too long on its own is the engine's to refuse)."""
    head = 1 if messages and messages[0]["role"] == "system" else 0
    dropped = 0
    ids = encode(messages)
    if len(ids) + room > context and when_full != "drop":
        raise PagechatError(
            f"the chat is full: its next turn needs {len(ids)} tokens and {room} for the "
            f"reply, and the context holds {context}; {NEW_CHAT}"
        )
    # Once turns must go, a quarter of the context more goes with them: the next turns then fit
    # as they are, and the kept part stays a prefix the cache serves, rather than sliding by one
    # turn (and missing the cache) every time.
    limit = context - room - (context // 4 if len(ids) + room > context else 0)
    while len(ids) > limit and len(messages) - head - dropped > 1:
        dropped += 2 if messages[head + dropped]["role"] == "user" else 1
        dropped = min(dropped, len(messages) - head - 1)
        ids = encode(messages[:head] + messages[head + dropped :])
    return ids, dropped
