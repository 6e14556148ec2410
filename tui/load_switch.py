"""LoadSwitch: background load started and stopped from the app (Ctrl+L or the Controls)."""

from __future__ import annotations

from pagechat.tui.widgets.controls import ControlsPanel
from rich.text import Text
from textual.app import App


class LoadSwitch:
    """Asks the engine's loop for background requests, and counts them for the status line."""

    def __init__(self, app: App) -> None:
        """app: the PagechatApp whose engine runs the load."""
        self.app = app
        self.left = 0  # background requests still to start (LoadSet)

    def running(self) -> int:
        """Background requests the scheduler holds now."""
        sched = self.app.sched
        return sum(sched.what(s).startswith("load") for s in sched.live)

    @property
    def busy(self) -> bool:
        """Background requests still to start or running: Ctrl+L stops them."""
        return bool(self.left or self.running())

    def status(self) -> Text:
        """' │ load 5 running · 3 to come' while background requests run, else nothing."""
        running, left = self.running(), self.left
        if not running and not left:
            return Text()
        warn = self.app.theme_variables["pc-warn"]
        t = Text(" │ ", "dim").append(f"load {running} running", warn)
        return t.append(f" · {left} to come" if left else "", "dim")

    def toggle(self) -> None:
        """Start background requests as the Controls say, or stop them."""
        controls = self.app.main.query_one(ControlsPanel)
        if self.busy:
            self.set(False, 0, 0.0)
            return
        values = controls.load_values()
        if values is not None:
            self.set(True, *values)

    def set(self, on: bool, count: int, rate: float) -> None:
        """Start `count` background requests at `rate` a second, or stop them."""
        self.left = count  # until the engine says how many are left
        if on:
            self.app.loop.start_load(count, rate)
            message = f"background load: {count} requests at {rate:g} a second (Ctrl+L stops)"
        else:
            self.app.loop.stop_load()
            message = "background load stopped; its requests are aborted"
        self.app.main.query_one(ControlsPanel).show_load(on)
        self.app.notify(message, title="load", timeout=3)
