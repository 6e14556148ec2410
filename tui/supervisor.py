"""EngineSupervisor: an engine that died or stopped answering is replaced; the chat stays."""

from __future__ import annotations

from pagechat.core.errors import one_line
from pagechat.tui.client import EngineClient
from pagechat.tui.widgets.scheduler import SchedulerLog
from textual.app import App

WATCH_S = 0.25  # how often the app checks that the engine still runs and answers


class EngineSupervisor:
    """Loads a new engine on a worker thread, so the app stays up with its chat whatever happens."""

    def __init__(self, app: App) -> None:
        """app: the PagechatApp whose engine this watches."""
        self.app = app
        self.restarting = False  # the engine stopped; a new one is loading

    def check(self) -> None:
        """Every WATCH_S: when the engine died or stopped answering, fail the reply in flight
        (the chat and its finished replies stay), say so and start a new engine."""
        app = self.app
        why = None if self.restarting else app.loop.failure()
        if why is None:
            return
        app.frames.pump(force=True)  # what the engine said before it stopped
        self.restarting = True
        app.loop.abandon()
        reply = app.session.fail_streaming(f"the engine stopped: {why}")
        if reply is not None:
            app.main.chat_log.update(reply)
            app.files.save()
        app.main.prompt.cursor_blink = True
        app.notify(
            f"{why}. Starting a new engine; the chat is kept, Ctrl+R asks a failed reply again",
            title="engine",
            severity="error",
            timeout=10,
            markup=False,
        )
        app.run_worker(self._restart, thread=True, group="restart", exit_on_error=False)

    def _restart(self) -> None:
        """On a worker thread: load a new engine like the last one, then hand it to the app."""
        app = self.app
        try:
            client = app.loop.restarted()
        except Exception as e:  # noqa: BLE001 - said in the app, which stays up with the chat
            app.call_from_thread(
                app.notify,
                f"no new engine: {one_line(e)}. Ctrl+O writes the chat out; quit and run again",
                title="engine",
                severity="error",
                timeout=30,
                markup=False,
            )
            return
        app.call_from_thread(self._adopt, client)

    def _adopt(self, client: EngineClient) -> None:
        """Run on the new engine: its pool, its scheduler (the old sequences are gone), the
        speculation the user had set."""
        app = self.app
        app.loop, info = client, client.info
        app.session.blocks = info.blocks
        app.sched, app.load.left = SchedulerLog(), 0
        client.start()
        if (info.speculate, info.num_draft) != app.speculation:
            client.set_speculation(*app.speculation)
        self.restarting = False
        app.inspector.refresh(everything=True)
        app.notify("a new engine is up", title="engine", timeout=4)
