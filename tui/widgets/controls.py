"""Controls panel: sampling settings editable while a reply streams; the engine's validation
decides what is refused."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from pagechat.core.errors import PagechatError
from pagechat.core.grammar import constraint_file
from pagechat.core.params import Constraint, SamplingParams
from pagechat.tui.widgets.panel import Panel, Readout
from rich.text import Text
from textual import on
from textual.app import ComposeResult
from textual.containers import Horizontal
from textual.message import Message
from textual.widgets import Input, Label, Static, Switch


@dataclass(frozen=True, slots=True)
class Field:
    """One editable SamplingParams field."""

    name: str  # SamplingParams attribute
    label: str
    kind: type | Callable  # float or int, or a parser of the text
    optional: bool = False  # blank means None (seed: random)
    hint: str = ""
    most: int | None = None  # the app's own limit (answers shown side by side), beyond the engine's


def read_constraint(text: str) -> Constraint:
    """The next reply's constraint: json (any JSON object), a JSON-schema file (.json), or a
    grammar file (Lark or GBNF)."""
    if text == "json":
        return Constraint("json")
    path = Path(text).expanduser()
    return constraint_file(path, "json_schema" if path.suffix == ".json" else "grammar")


FIELDS = (
    Field("temperature", "temperature", float, hint="0 = greedy"),
    Field("top_p", "top-p", float, hint="(0, 1]"),
    Field("top_k", "top-k", int, hint="0 = off"),
    Field("min_p", "min-p", float, hint="[0, 1]"),
    Field("max_tokens", "max new tokens", int),
    Field("seed", "seed", int, optional=True, hint="blank = random"),
    Field("n", "samples", int, hint="1-8 answers (F9)", most=8),
    Field("beam_width", "beams", int, hint="1 = off (F10)", most=8),
    Field(
        "constraint", "constraint", read_constraint, optional=True, hint="json · FILE.json · .gbnf"
    ),
)


def parse_field(field: Field, text: str, params: SamplingParams) -> SamplingParams:
    """params with field set from text, checked by SamplingParams.validate() (PagechatError)."""
    text = text.strip()
    if not text and field.optional:
        value = None
    else:
        try:
            value = field.kind(text)
        except ValueError:
            kind = "a whole number" if field.kind is int else "a number"
            raise PagechatError(f"{field.label} must be {kind}, got {text!r}") from None
    if field.most is not None and value > field.most:
        raise PagechatError(f"{field.label} must be at most {field.most}, got {value}")
    return replace(params, **{field.name: value}).validate()


def show_value(value) -> str:
    if isinstance(value, Constraint):
        return value.source or value.kind
    return "" if value is None else f"{value:g}" if isinstance(value, float) else str(value)


class ControlsPanel(Panel):
    """One input per setting; Enter or leaving a field applies it; a refusal keeps the old value."""

    TITLE = "Controls"

    class Changed(Message):
        """The user changed the sampling settings (already validated)."""

        def __init__(self, params: SamplingParams) -> None:
            super().__init__()
            self.params = params

    class LoadChanged(Message):
        """The user switched background load on (count requests, rate a second) or off."""

        def __init__(self, on: bool, count: int, rate: float) -> None:
            super().__init__()
            self.on, self.count, self.rate = on, count, rate

    class SpeculationChanged(Message):
        """The user switched speculation or changed the draft length."""

        def __init__(self, enabled: bool, num_draft: int) -> None:
            super().__init__()
            self.enabled, self.num_draft = enabled, num_draft

    def __init__(
        self, params: SamplingParams, spec: tuple[bool, bool, int] = (False, False, 4), **kwargs
    ) -> None:
        super().__init__(**kwargs)
        self.params = params
        self.load_on = False
        self.spec_available, self.spec_on, self.num_draft = (
            spec  # (a proposer exists, on, draft length)
        )

    def compose(self) -> ComposeResult:
        for f in FIELDS:
            with Horizontal(classes="control-row"):
                yield Label(f.label, classes="control-label")
                yield Input(
                    show_value(getattr(self.params, f.name)),
                    id=f"ctl-{f.name}",
                    classes="control-input",
                    type="number" if f.kind is float else "text",
                    placeholder=f.hint,
                    select_on_focus=True,
                )
                yield Label(f.hint, classes="control-hint")
        with Horizontal(classes="control-row"):
            yield Label("speculation", classes="control-label")
            yield Switch(
                self.spec_on,
                id="ctl-spec",
                disabled=not self.spec_available,
                tooltip=None if self.spec_available else "start with --draft DIR or --ngram",
            )
            yield Label("draft length", classes="control-hint", id="ctl-draft-label")
            yield Input(
                str(self.num_draft),
                id="ctl-draft",
                classes="control-input -short",
                type="integer",
                disabled=not self.spec_available,
                select_on_focus=True,
            )
        with Horizontal(classes="control-row"):
            yield Label("load (Ctrl+L)", classes="control-label")
            yield Input("16", id="ctl-load-count", classes="load-input", type="integer")
            yield Input("2", id="ctl-load-rate", classes="load-input", type="number")
            yield Switch(False, id="ctl-load")
            yield Label("requests · a second", classes="control-hint")
        yield Readout(id="control-error")
        yield Static(
            Text().append(
                "F5/F6 temperature −/+ · F7/F8 top-p −/+ · F9 samples · F10 beams · Enter applies",
                "dim",
            ),
            id="control-help",
        )

    def set_params(self, params: SamplingParams) -> None:
        """Show params (e.g. after a key nudge) without re-validating."""
        self.params = params
        for f in FIELDS:
            self.query_one(f"#ctl-{f.name}", Input).value = show_value(getattr(params, f.name))
            self.query_one(f"#ctl-{f.name}", Input).remove_class("-refused")
        self.set_text("#control-error", "")

    @property
    def error(self) -> str:
        """The refusal shown, or ''."""
        return str(self.query_one("#control-error", Readout).shown or "")

    def show_error(self, message: str) -> None:
        """A refusal, in the theme's colour for errors."""
        colour = self.app.theme_variables["pc-bad"]
        self.set_text("#control-error", Text().append(message, f"bold {colour}"))

    def _apply(self, inp: Input) -> None:
        field = next(f for f in FIELDS if inp.id == f"ctl-{f.name}")
        if inp.value.strip() == show_value(getattr(self.params, field.name)):
            inp.remove_class("-refused")
            return
        try:
            params = parse_field(field, inp.value, self.params)
        except PagechatError as e:
            inp.add_class("-refused")
            self.show_error(f"refused: {e}")
            return
        inp.remove_class("-refused")
        self.set_text("#control-error", "")
        self.params = params
        self.post_message(self.Changed(params))

    def _apply_spec(self) -> None:
        text = self.query_one("#ctl-draft", Input).value.strip()
        enabled = self.query_one("#ctl-spec", Switch).value
        try:
            k = int(text)
        except ValueError:
            k = 0
        if k < 1:  # the engine's own rule (Engine.set_speculation), refused here before it is sent
            self.query_one("#ctl-draft", Input).add_class("-refused")
            self.show_error(f"refused: draft length must be >= 1, got {text!r}")
            return
        self.query_one("#ctl-draft", Input).remove_class("-refused")
        self.set_text("#control-error", "")
        if (enabled, k) != (self.spec_on, self.num_draft):
            self.spec_on, self.num_draft = enabled, k
            self.post_message(self.SpeculationChanged(enabled, k))

    def load_values(self) -> tuple[int, float] | None:
        """(requests, a second) from the load fields; None, with the refusal shown, if bad."""
        count, rate = (self.query_one(f"#ctl-load-{k}", Input).value for k in ("count", "rate"))
        try:
            n, r = int(count), float(rate)
        except ValueError:
            n, r = 0, 0.0
        if not (1 <= n <= 256 and 0 < r <= 100):
            self.show_error(
                f"refused: load is 1-256 requests at (0, 100] a second, got {count!r} at {rate!r}"
            )
            return None
        return n, r

    def show_load(self, on: bool) -> None:
        """The load switch as the app has it (a change from here is not announced)."""
        self.load_on = on
        self.query_one("#ctl-load", Switch).value = on

    @on(Switch.Changed, "#ctl-load")
    def _load_switched(self, event: Switch.Changed) -> None:
        event.stop()
        if event.value == self.load_on:  # shown from the app, not switched by the user
            return
        self.load_on = event.value
        values = self.load_values() if event.value else (0, 0.0)
        if values is None:
            self.show_load(False)
            return
        self.set_text("#control-error", "")
        self.post_message(self.LoadChanged(event.value, *values))

    @on(Switch.Changed, "#ctl-spec")
    def _spec_switched(self, event: Switch.Changed) -> None:
        event.stop()
        self._apply_spec()

    @on(Input.Submitted, ".control-input")
    def _submitted(self, event: Input.Submitted) -> None:
        event.stop()
        self._apply_spec() if event.input.id == "ctl-draft" else self._apply(event.input)

    @on(Input.Blurred, ".control-input")
    def _blurred(self, event: Input.Blurred) -> None:
        self._apply_spec() if event.input.id == "ctl-draft" else self._apply(event.input)
