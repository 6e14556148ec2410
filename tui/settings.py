"""Settings: the sampling and speculation settings, from the Controls and keys to the engine."""

from __future__ import annotations

from dataclasses import replace

from pagechat.core.params import SamplingParams
from pagechat.tui.widgets.controls import ControlsPanel
from textual.app import App


class Settings:
    """Applies new settings to the session, the engine and the Controls at once, so none lags."""

    def __init__(self, app: App) -> None:
        """app: the PagechatApp whose session and engine take the settings."""
        self.app = app

    def set_params(self, params: SamplingParams, from_controls: bool = False) -> None:
        """New settings for the next request and, from its next token, for the reply in flight."""
        app = self.app
        app.session.params = params
        app.loop.update_params(params)
        if not from_controls:
            app.main.query_one(ControlsPanel).set_params(params)
        app.inspector.show_sampling()
        app.notify(
            f"temperature {params.temperature:g} · top-p {params.top_p:g} · top-k {params.top_k} · "
            f"min-p {params.min_p:g}",
            title="settings",
            timeout=2,
        )

    def nudge(self, name: str, delta: float) -> None:
        """Step temperature or top-p, clamped to the range the engine accepts."""
        p = self.app.session.params
        if name == "temperature":
            value = round(min(5.0, max(0.0, p.temperature + delta)), 2)
        else:
            value = round(min(1.0, max(0.05, p.top_p + delta)), 2)
        self.set_params(replace(p, **{name: value}))

    def set_speculation(self, enabled: bool, k: int) -> None:
        """Speculation on or off and its draft length, from the engine's next step."""
        self.app.loop.set_speculation(enabled, k)
        self.app.frames.pump_now(timeout=1.0)
        self.app.notify(
            f"speculation {'on' if enabled else 'off'} · draft length {k} (from the next step)",
            title="settings",
            timeout=2,
        )
