"""Chat column: system prompt, the message log (streamed replies, Markdown when finished, token
picking), the prompt."""

from __future__ import annotations

import os

from pagechat.tui.history import params_from_dict
from pagechat.tui.session import Message
from pagechat.tui.widgets.blocks import owner_colour
from pagechat.tui.widgets.panel import Readout
from pagechat.tui.widgets.sampling import token_label
from rich.style import Style
from rich.text import Text
from textual import events
from textual.app import ComposeResult
from textual.await_complete import AwaitComplete
from textual.binding import Binding
from textual.containers import Vertical, VerticalScroll
from textual.message import Message as TMessage
from textual.reactive import reactive
from textual.widget import AwaitMount, Widget
from textual.widgets import Markdown, Static, TextArea

CONTROL_PICTURES = {c: 0x2400 + c for c in range(32) if c not in (9, 10)} | {127: 0x2421}


def printable(text: str) -> str:
    """Control characters (random models emit them) as their Unicode pictures, which terminals
    and SVGs draw."""
    return text.translate(CONTROL_PICTURES)


TOKEN_SHADES = ("pc-token-even", "pc-token-odd")  # theme variables: alternate backgrounds
SPECIAL = ("<|", "<s>", "</s>")
MIN_ROOM = 4  # rows a streaming reply's body takes at least, however tall the message above it


class PromptInput(TextArea):
    """Multi-line prompt: Enter sends, Shift+Enter / Alt+Enter / Ctrl+J insert a newline."""

    # priority: a TextArea takes Enter as a newline before any ordinary binding sees it
    BINDINGS = [
        Binding("enter", "submit", "Send", show=False, priority=True, tooltip="send the prompt"),
        Binding(
            "shift+enter,alt+enter,ctrl+j",
            "newline",
            "New line",
            show=False,
            priority=True,
            tooltip="new line in the prompt",
        ),
    ]

    class Submitted(TMessage):
        """The user pressed Enter on a prompt."""

        def __init__(self, text: str) -> None:
            super().__init__()
            self.text = text

    # Both run after the keys already queued for this widget: a priority binding runs as its key
    # reaches the app, before the widget has inserted the characters that came just ahead of it
    # in the same read (a paste where the terminal does not bracket it, tmux send-keys, a script),
    # so Enter would send the text as it was before them and a newline land in front of them.
    def action_submit(self) -> None:
        self.call_later(lambda: self.post_message(self.Submitted(self.text)))

    def action_newline(self) -> None:
        self.call_later(self.insert, "\n")


class UserMessage(Static):
    """A user's message, shown as typed."""

    def __init__(self, message: Message) -> None:
        super().__init__(Text(printable(message.content)), classes="user-message")
        self.message = message


class TokenView(Static):
    """A reply's tokens as clickable spans on alternating shades; the selected token is reversed."""

    def show(self, message: Message, selected: int) -> None:
        t, shades = Text(), [self.app.theme_variables[v] for v in TOKEN_SHADES]
        for i, tok in enumerate(message.tokens):
            text = tok.text
            special = text.startswith(SPECIAL) and text.endswith((">",))
            shown = (
                token_label(text, 40)
                if special or not text or text.isspace() and "\n" not in text and text != " "
                else printable(text)
            )
            # meta, not an "@click" action: actions get link styling (underlines) on every token
            style = Style(bgcolor=shades[i % 2], dim=special, italic=special, meta={"token": i})
            if i == selected:
                style += Style(reverse=True, bold=True)
            t.append(shown, style)
        if not message.tokens:
            t.append("no sampling records for this reply (loaded from history)", "dim italic")
        self.update(t)

    def on_click(self, event: events.Click) -> None:
        index = event.style.meta.get("token")
        reply = self.parent
        if index is not None and isinstance(reply, ReplyView):
            event.stop()
            reply.focus()
            reply.select(index)


class ReplyView(Vertical, can_focus=True):
    """An assistant reply: text while streaming, Markdown when finished, its tokens when focused."""

    BINDINGS = [
        Binding(
            "left,h",
            "move(-1)",
            "Prev token",
            show=False,
            tooltip="pick the previous token of the focused reply (mouse: click a token)",
        ),
        Binding("right,l", "move(1)", "Next token", show=False, tooltip="pick the next token"),
        Binding("home", "move_to(0)", "First token", show=False, tooltip="pick the first token"),
        Binding("end", "move_to(-1)", "Last token", show=False, tooltip="pick the last token"),
        Binding("up,k", "sibling(-1)", "Prev reply", show=False, tooltip="previous reply"),
        Binding("down,j", "sibling(1)", "Next reply", show=False, tooltip="next reply"),
        Binding(
            "b",
            "branch",
            "Branch",
            show=False,
            tooltip="branch the last reply at the picked token: its best other candidate, then "
            "the model goes on (another answer beside it, with the settings now)",
        ),
        Binding(
            "a",
            "again",
            "Again",
            show=False,
            tooltip="ask the last turn again with the settings now (another answer beside it)",
        ),
    ]

    selected: reactive[int] = reactive(-1, init=False)

    class TokenSelected(TMessage):
        """The user picked token `index` of `message` (index -1: none)."""

        def __init__(self, view: ReplyView, message: Message, index: int) -> None:
            super().__init__()
            self.view, self.message, self.index = view, message, index

    class BranchAsked(TMessage):
        """The user asked for a branch of `message` at its token `index` (-1: the turn again)."""

        def __init__(self, message: Message, index: int) -> None:
            super().__init__()
            self.message, self.index = message, index

    def __init__(self, message: Message) -> None:
        super().__init__(classes="reply")
        self.message = message
        self._markdown_for: str | None = None
        self._reserved = 0  # rows the streaming body takes (0: not set yet)
        self._room_for = 0  # the chat's height when they were set

    def compose(self) -> ComposeResult:
        yield Static(classes="reply-body", markup=False)
        yield Markdown(classes="reply-markdown")
        yield TokenView(classes="reply-tokens")
        yield Readout(classes="reply-meta")

    def on_mount(self) -> None:
        self.update_view()

    def update_view(self) -> AwaitComplete | None:
        """Show the message as it is now; returns the Markdown's mount when the finished text is
        rendered anew."""
        m = self.message
        body = self.query_one(".reply-body", Static)
        md = self.query_one(".reply-markdown", Markdown)
        mounted = None
        self.set_class(not m.streaming, "-done")
        if not m.streaming and self._reserved:
            self._reserved = 0
            body.styles.height = "auto"
        if m.streaming:
            text = (
                Text(printable(m.content))
                + Text().append("▌", f"blink {self.app.theme_variables['pc-accent']}")
                if m.content
                else Text().append("…", "dim")
            )
            body.update(self.fit(body, Text("\n").join((text, self.meta_text()))), layout=False)
        elif self._markdown_for != m.content:
            self._markdown_for = m.content
            mounted = md.update(printable(m.content) or "*(no text)*")
        if self.has_class("-inspect"):
            self.query_one(TokenView).show(m, self.selected)
        if not m.streaming or self.has_class("-inspect"):
            self.query_one(".reply-meta", Readout).show(self.meta_text())
        return mounted

    def fit(self, body: Static, text: Text) -> Text:
        """The streaming text cut to its tail, in a body that takes the room below the prompt from
        the start.

        A height change or a scroll makes Textual lay out the whole screen (longer the longer the
        chat) and a frame re-renders the whole body; both take CPU the engine's threads could use.
        So the body gets its final height once, when the reply is mounted: the chat's visible height
        less the message above it, which stays in view; then it shows the reply's tail (the whole
        reply, as Markdown, when done).
        """
        width = body.content_size.width or max(10, self.content_size.width)
        if not self._reserved or self._room_for != self.log.size.height:
            self._room_for = self.log.size.height
            self._reserved = self.room()
            body.styles.height = self._reserved
        lines = text.wrap(self.app.console, width)
        if len(lines) > self._reserved:
            hidden = len(lines) - self._reserved + 1
            note = Text(
                f"⋯ {hidden} more lines above; the whole reply shows when it is done", "dim italic"
            )
            text = Text("\n").join([note, *lines[hidden:]])
        return text

    def room(self) -> int:
        """Rows below the message this reply answers when the chat is scrolled to its end (at least
        MIN_ROOM).

        Measured from the message's styles and text, not its laid-out size: the two are mounted
        together, before any layout, and the body's height is set in the same layout pass.
        """
        log = self.log
        rows = (
            log.scrollable_content_region.height
            - self.styles.margin.height
            - self.styles.gutter.height
            - self.header_rows()
        )
        siblings = log.children
        i = siblings.index(self.item)
        if i > 0:
            above = siblings[i - 1]
            st = above.styles
            width = log.scrollable_content_region.width - st.margin.width - st.gutter.width
            rows -= (
                above.get_content_height(log.size, log.size, width)
                + st.gutter.height
                + st.margin.height
            )
        return max(MIN_ROOM, rows)

    @property
    def log(self) -> ChatLog:
        """The chat log this reply is in."""
        return self.parent

    @property
    def item(self) -> Widget:
        """The log's child that holds this reply."""
        return self

    def header_rows(self) -> int:
        """Rows drawn above this reply's body within its item."""
        return 0

    def meta_text(self) -> Text:
        m, t = self.message, self.message.timing
        colours = self.app.theme_variables
        parts = Text(style="dim")
        n = len(m.tokens) or (t.output_tokens if t else 0)
        parts.append(f"{n} tokens")
        if m.streaming:
            parts.append(" · generating", colours["pc-good"])
        elif m.finish_reason == "abort":
            parts.append(" · stopped", colours["pc-warn"])
        elif m.finish_reason:
            parts.append(f" · {m.finish_reason}")
        if t is not None and t.decode_tok_s:
            parts.append(f" · {t.decode_tok_s:.1f} tok/s")
        made = params_from_dict((m.produced_by or {}).get("params") or {})
        if made.constraint is not None:  # held to a schema or grammar: the chat says which
            parts.append(f" · {made.constraint.label}")
        if m.error:
            parts.append(f"\n{m.error}", f"bold {colours['pc-bad']}")
        if self.has_class("-inspect") and m.tokens:
            parts.append("  ←/→ pick a token · click one · Esc back", "italic")
        return parts

    # -- token selection ---------------------------------------------------------------------------
    def select(self, index: int) -> None:
        """Select token `index` (negative counts from the end) and announce it."""
        n = len(self.message.tokens)
        if not n:
            return
        self.selected = max(0, min(n - 1, index if index >= 0 else n + index))

    def watch_selected(self, index: int) -> None:
        self.query_one(TokenView).show(self.message, index)
        self.post_message(self.TokenSelected(self, self.message, index))

    def action_move(self, delta: int) -> None:
        self.select(max(0, self.selected + delta) if self.selected >= 0 else -1)

    def action_move_to(self, index: int) -> None:
        self.select(index)

    def action_branch(self) -> None:
        if self.selected >= 0:
            self.post_message(self.BranchAsked(self.message, self.selected))

    def action_again(self) -> None:
        self.post_message(self.BranchAsked(self.message, -1))

    def action_sibling(self, delta: int) -> None:
        replies = self.log.replies()
        i = replies.index(self) + delta
        if 0 <= i < len(replies):
            replies[i].focus()
            replies[i].scroll_visible()

    def on_focus(self) -> None:
        self.add_class("-inspect")
        if self.selected < 0 and self.message.tokens:
            self.select(-1)
        self.update_view()

    def on_blur(self) -> None:
        self.remove_class("-inspect")
        self.update_view()


class AnswerView(ReplyView):
    """One of several answers to a prompt, inside its AnswersView."""

    @property
    def log(self) -> ChatLog:
        return self.parent.parent

    @property
    def item(self) -> Widget:
        return self.parent

    def header_rows(self) -> int:
        """The answers' title and a line per answer (the title alone once one is kept)."""
        m = self.parent.message
        lines = 1 if m.picked is not None else 1 + len(m.samples)
        return lines + self.parent.styles.gutter.height


class AnswersView(Vertical):
    """n answers to one prompt (samples, or a beam search's hypotheses): a line per answer with
    its state and newest text, and the answer shown below; once one is kept, that one alone."""

    def __init__(self, message: Message) -> None:
        super().__init__(classes="answers")
        self.message = message

    def compose(self) -> ComposeResult:
        yield Readout(classes="answers-head")
        for i, answer in enumerate(self.message.samples):
            view = AnswerView(answer)
            view.display = i == self.message.shown
            yield view

    def on_mount(self) -> None:
        self.query_one(".answers-head", Readout).show(self.head())

    def shown_view(self) -> AnswerView:
        return list(self.query(AnswerView))[self.message.shown]

    def update_view(self) -> AwaitComplete | None:
        """Show the answers as they are now; returns the shown one's Markdown mount, if any."""
        self.query_one(".answers-head", Readout).show(self.head())
        return self.shown_view().update_view()

    def add_answer(self, answer: Message) -> AwaitMount:
        """Mount a new answer (a branch) and show it."""
        mounted = self.mount(AnswerView(answer))
        self.call_after_refresh(self.show, len(self.message.samples) - 1)
        return mounted

    def show(self, k: int) -> None:
        """Put answer k on screen."""
        self.message.shown = k
        for i, view in enumerate(self.query(AnswerView)):
            view.display = i == k
        self.update_view()

    def head(self) -> Text:
        """The title line, then a line per answer (only the title once one is kept)."""
        m, colours = self.message, self.app.theme_variables
        n = len(m.samples)
        t = Text(style="dim")
        if m.picked is not None:
            t.append(f"✓ kept answer {m.picked + 1} of {n}", f"bold {colours['pc-good']}")
            return t.append(" · the others' KV blocks were freed")
        what = "beams" if m.beams else "answers"
        t.append(f"{n} {what}", "bold").append(" · Alt+←/→ show one · Ctrl+T keeps it")
        if m.beams and m.streaming:
            t.append(" · searching (hypotheses at the end)")
        width = max(20, (self.query_one(".answers-head").content_size.width or 60) - 21)
        beams = self.running_beams() if m.beams and m.streaming else []
        texts = [" ".join(printable(a.content).split()) for a in m.samples]
        same = os.path.commonprefix(texts).rfind(" ") + 1  # the words every answer begins with
        for i, a in enumerate(m.samples):
            beam = beams[i] if i < len(beams) else None
            text = texts[i] if a.streaming or not same else "…" + texts[i][same:]
            t.append("\n").append_text(self.answer_line(i, a, text, width, colours, beam))
        return t

    def running_beams(self) -> list:
        """The beam search's running beams as the scheduler last listed them, best first."""
        rid, log = self.message.request_id, getattr(self.app, "sched", None)
        if rid is None or log is None:
            return []
        beams = [s for s in log.live if s.request_id == rid and s.role == "beam"]
        return sorted(beams, key=lambda s: s.index)

    def answer_line(self, i: int, a: Message, text: str, width: int, colours, beam=None) -> Text:
        """▶ on the shown one, its number in its sequence's block colour, state, tokens, text (an
        ended one's from where the answers part); a running beam search's lines are its beams
        (their sequences change as it goes)."""
        m = self.message
        t = Text().append("▶" if i == m.shown else " ", f"bold {colours['pc-accent']}")
        seq = beam.seq_id if beam is not None else a.request_id
        colour = colours[owner_colour(seq)] if seq is not None else None
        t.append(f"{i + 1:>2} ", f"bold {colour}" if colour else "bold")
        state = "●" if a.streaming else (a.finish_reason or "done")
        t.append(f"{state:<11.11}", colours["pc-good"] if a.streaming else "dim")
        count = beam.output_tokens if beam is not None else len(a.tokens)
        count = count or (a.timing.output_tokens if a.timing is not None else 0)
        t.append(f"{count or '':>4} ", "dim")
        if len(text) > width:  # a streaming answer's newest text; an ended one's beginning
            text = "…" + text[-(width - 1) :] if a.streaming else text[: width - 1] + "…"
        return t.append(text or "…", "" if i == m.shown else "dim")


class ChatLog(VerticalScroll):
    """The messages; follows new text only while the user is at (or within 2 rows of) the bottom."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.context_from = 0  # the message the context marker stands above (0: none)
        self.views: dict[int, UserMessage | ReplyView | AnswersView] = {}  # id(message) -> widget

    def near_bottom(self) -> bool:
        return self.max_scroll_y - self.scroll_y <= 2

    def follow(self) -> None:
        """Scroll to the end unless there: a scroll lays out and repaints the whole screen."""
        if self.scroll_y < self.max_scroll_y:
            self.scroll_end(animate=False)

    def add(self, message: Message) -> AwaitMount:
        """Mount a widget for a new message."""
        follow = self.near_bottom()
        view = self.views[id(message)] = self._view(message)
        mounted = self.mount(view)
        if follow:
            self.call_after_refresh(self.follow)
        return mounted

    def update(self, message: Message) -> None:
        """Repaint a message that changed."""
        view = self.views.get(id(message))
        # a view mounted since the last frame (a branch's answers, drawn anew) may not have
        # composed yet; its on_mount draws the message as it is then
        if isinstance(view, ReplyView | AnswersView) and view.is_mounted:
            follow = self.near_bottom()
            mounted = view.update_view()
            if follow and mounted is not None:
                # the finished reply's Markdown (taller than its streaming tail) mounts its blocks
                # later
                self.run_worker(self._follow_when(mounted))
            elif follow:
                self.call_after_refresh(self.follow)

    async def _follow_when(self, mounted: AwaitComplete) -> None:
        await mounted
        self.call_after_refresh(self.follow)

    @staticmethod
    def _view(message: Message) -> Widget:
        if message.samples:
            return AnswersView(message)
        return ReplyView(message) if message.role == "assistant" else UserMessage(message)

    def remount(self, message: Message, instead_of: Message | None = None) -> AwaitMount:
        """Draw a reply anew: in its own place (it became several answers: a branch), or in the
        place of the reply it replaces (a failed reply retried)."""
        old = self.views.pop(id(instead_of or message))
        view = self.views[id(message)] = self._view(message)
        mounted = self.mount(view, after=old)
        old.remove()
        return mounted

    def clear(self) -> None:
        self.views.clear()
        self.remove_children()
        self.context_from = 0

    def mark_context(self, messages: list[Message], first: int) -> None:
        """A rule above messages[first]: the ones before it are out of the model's context."""
        self.context_from = first
        self.query(".context-marker").remove()
        if not first:
            return
        text = (
            f"── the {first} messages above are out of the model's context: "
            "it no longer sees them ──"
        )
        self.mount(Static(text, classes="context-marker"), before=self.views[id(messages[first])])

    def replies(self) -> list[ReplyView]:
        """The replies on screen, oldest first (of several answers, the one shown)."""
        return [r for r in self.query(ReplyView) if r.display]

    def last_reply(self) -> ReplyView | None:
        replies = self.replies()
        return replies[-1] if replies else None


class ChatColumn(Vertical):
    """System prompt line, the log and the prompt box."""

    def __init__(self, system: str, **kwargs) -> None:
        super().__init__(**kwargs)
        self.system = system

    def compose(self) -> ComposeResult:
        from textual.widgets import Input

        yield Input(
            self.system,
            placeholder="system prompt (optional; applies from the next message)",
            id="system-prompt",
        )
        yield ChatLog(id="chat-log")
        yield PromptInput(
            id="prompt",
            soft_wrap=True,
            show_line_numbers=False,
            compact=True,
            placeholder="Message · Enter sends · Alt+Enter: new line",
        )
