"""Turns: the user's prompts sent and answered, stopped, retried; a new chat."""

from __future__ import annotations

from pagechat.tui.heap import settle_heap
from pagechat.tui.session import Message
from textual.app import App
from textual.widget import AwaitMount


class Turns:
    """Starts and stops the engine's replies to the chat, so one reply runs at a time."""

    def __init__(self, app: App, when_full: str) -> None:
        """when_full: a chat too long for the context drops its oldest turns, or refuses."""
        self.app = app
        self.when_full = when_full

    def send(self, text: str) -> None:
        """Send the prompt as the next user turn."""
        app = self.app
        text = text.strip()
        if not text:
            return
        if not self.can_start():
            return
        last = app.answers.last()
        if last is not None and last.picked is None:  # the chat goes on from the answer shown
            app.answers.keep(last)
        reply = app.session.add_user(text)
        log = app.main.chat_log
        app.main.prompt.clear()
        self.start(reply, [log.add(app.session.messages[-2]), log.add(reply)])

    def can_start(self) -> bool:
        """Whether a reply can start now; if not, says why (what the user typed stays)."""
        restarting = self.app.supervisor.restarting
        if restarting:
            self.app.notify("the engine is restarting: send again in a moment", severity="warning")
        elif self.app.session.streaming is not None:
            self.app.notify("a reply is still streaming: Esc stops it", severity="warning")
        return not restarting and self.app.session.streaming is None

    def start(self, reply: Message, mounts: list[AwaitMount]) -> None:
        """Ask the engine for `reply`, the conversation's new last message, once it is drawn."""
        app = self.app
        app.main.prompt.cursor_blink = False  # each blink repaints: none while the engine decodes
        app.inspector.pinned = None
        conversation, params = app.session.conversation(), app.session.params
        app.loop.send(reply.ticket, conversation, params, hold=True, when_full=self.when_full)
        app.files.save()
        app.inspector.refresh()
        app.run_worker(self._release_when_drawn(mounts), group="send")

    def retry(self) -> bool:
        """Ask a failed last reply again, in its place; False when the last reply did not fail."""
        app = self.app
        if app.session.last_failed() is None:
            return False
        if self.can_start():
            reply, failed = app.session.retry()
            self.start(reply, [app.main.chat_log.remount(reply, instead_of=failed)])
            app.notify("asking again", timeout=2)
        return True

    async def _release_when_drawn(self, mounts: list[AwaitMount]) -> None:
        """Let the engine start the reply once the new turn is mounted, laid out and in view.

        That is Python on the UI thread; run while the engine decodes, it would take a core from
        the engine's first decode steps (and, with a ThreadedEngine, the GIL). Run first, it delays
        the first token by less.
        """
        try:
            for mounted in mounts:
                await mounted
            await self.app.main.wait_for_refresh()  # the layout with the new widgets
            await self.app.main.wait_for_refresh()  # the scroll to them
        finally:
            self.app.loop.release()

    def stop(self) -> None:
        """Stop the reply in flight; else unpin the selected token, back to the prompt."""
        app = self.app
        if app.session.streaming is not None:
            app.loop.stop()
            return
        if app.inspector.pinned is not None:
            app.inspector.pinned = None
            app.inspector.show_sampling()
        app.main.prompt.focus()

    def new_chat(self) -> None:
        """Abort the reply, save this chat, start an empty one (same system, settings)."""
        app = self.app
        app.loop.stop()
        app.frames.pump_now()
        app.files.save()
        old = app.session
        if old.save_error and not old.saved and old.rescued is None:  # nowhere but in memory
            app.notify("export this chat first (Ctrl+O): it could not be saved", severity="error")
            return
        app.session = old.next_chat(app.loop.info.model_dir)
        app.inspector.pinned = None
        app.main.chat_log.clear()
        app.main.prompt.focus()
        app.inspector.refresh(everything=True)
        app.call_after_refresh(settle_heap, True)
        app.notify(f"new chat {app.session.record.id}", timeout=3)

    def inspect(self) -> None:
        """Retry the last reply if it failed; else focus it to pick its tokens."""
        if self.retry():
            return
        reply = self.app.main.chat_log.last_reply()
        if reply is None:
            self.app.notify("no reply yet", severity="warning")
            return
        reply.focus()
        reply.scroll_visible()
