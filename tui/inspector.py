"""Inspector: the status line and the inspector panels, drawn from the app's records."""

from __future__ import annotations

from pagechat.tui.screens import StatusBar, status_line
from pagechat.tui.session import Message
from pagechat.tui.widgets.blocks import BlocksPanel
from pagechat.tui.widgets.controls import ControlsPanel
from pagechat.tui.widgets.memory import MemoryPanel
from pagechat.tui.widgets.sampling import SamplingPanel, token_label
from pagechat.tui.widgets.scheduler import SchedulerPanel
from pagechat.tui.widgets.speculation import SpeculationPanel
from pagechat.tui.widgets.timing import TimingPanel
from textual.app import App


class Inspector:
    """Draws only the panels on view, so that a frame costs what the user can see."""

    def __init__(self, app: App) -> None:
        """app: the PagechatApp whose session, scheduler log and readings the panels show."""
        self.app = app
        self.pinned: tuple[Message, int] | None = None  # reply token shown in the sampling panel

    def refresh(self, everything: bool = False) -> None:
        """Render the visible panels from the session's latest report."""
        app, main, s = self.app, self.app.main, self.app.session
        status = status_line(app.loop.info, s, app.theme_variables)
        status.append_text(app.load.status())
        loading = app.load.busy
        if main.query_one(ControlsPanel).load_on != loading:  # it ran out, or was stopped
            main.query_one(ControlsPanel).show_load(loading)
        main.query_one(StatusBar).show(status, layout=False)  # always one line
        snap = s.blocks
        if snap is not None and main.shows("blocks"):
            names = {seq.seq_id: app.sched.what(seq) for seq in app.sched.live}
            main.query_one(BlocksPanel).show(snap, names)
        if main.shows("sampling"):
            self.show_sampling()
        if main.shows("timing"):
            main.query_one(TimingPanel).show(s, app.loop.info)
        if main.shows("speculation"):
            on, why, k = self.spec_state()
            main.query_one(SpeculationPanel).show(on, why, s.speculation(), s.drafts, k)
        if main.shows("sched"):
            main.query_one(SchedulerPanel).show(app.sched)
        if main.shows("memory"):
            if everything:
                self.refresh_memory()
            else:
                main.query_one(MemoryPanel).show(s.blocks)

    def spec_controls(self) -> tuple[bool, bool, int]:
        """(a proposer exists, speculation on, draft length) as the engine has them."""
        return self.app.loop.info.proposer is not None, *self.app.speculation

    def spec_state(self) -> tuple[bool, str, int]:
        """(on, why, draft length) for the speculation panel, read from the engine's settings."""
        available, on, k = self.spec_controls()
        if not available:
            return False, "no proposer: start with --draft DIR or --ngram", k
        why = f"{self.app.loop.info.proposer} proposer · draft length {k}"
        return on, why + ("" if on else " · switched off in Controls"), k

    def refresh_memory(self) -> None:
        """Every second (an interval that can fire while the app closes: query, never query_one)."""
        if self.app.main.shows("memory"):
            for panel in self.app.main.query(MemoryPanel):
                panel.show(self.app.session.blocks, self.app.readings)

    def show_sampling(self) -> None:
        """The pinned token's candidates, else the newest token's."""
        session = self.app.session
        panel = self.app.main.query_one(SamplingPanel)
        if self.pinned is not None:
            msg, i = self.pinned
            if 0 <= i < len(msg.tokens):
                tok = msg.tokens[i]
                panel.show(
                    tok.record,
                    f"selected token {i + 1}/{len(msg.tokens)} '{token_label(tok.text)}'",
                    session.params,
                )
                return
        rec, label = session.latest_sample, "newest token"
        other = session.latest_any
        if session.streaming is None and other is not None and other is not rec:
            # between replies: whatever else the engine samples (load, a server's other clients)
            rec, label = other, f"newest token of {self.app.sched.name(other.seq_id)}"
        panel.show(rec, label if rec else "", session.params)
