"""Answers: several answers to the last turn (samples, beams, branches), shown, kept, branched."""

from __future__ import annotations

from dataclasses import replace

from pagechat.tui.session import Message, ReplyToken
from pagechat.tui.widgets.sampling import token_label
from textual.app import App

MAX_ANSWERS = 8  # samples, beams or branches of one turn
MAX_BRANCHES = 4  # branches of a turn running at once


class Answers:
    """What the user does with the answers of the last reply, so the chat goes on from one."""

    def __init__(self, app: App) -> None:
        """app: the PagechatApp whose chat holds the answers."""
        self.app = app

    def last(self) -> Message | None:
        """The last reply, if it has several answers (samples or beams)."""
        messages = self.app.session.messages
        last = next((m for m in reversed(messages) if m.role == "assistant"), None)
        return last if last is not None and last.samples else None

    def cycle(self, name: str) -> None:
        """The next number of samples (or beams) for the next prompt: 1, 2, 4, 8."""
        p = self.app.session.params
        value = {1: 2, 2: 4, 4: 8}.get(getattr(p, name), 1)
        other = "beam_width" if name == "n" else "n"  # one or the other: the engine's rule
        self.app.settings.set_params(replace(p, **{name: value, other: 1}))

    def show(self, delta: int) -> None:
        """Show another answer of the last reply."""
        m = self.last()
        if m is None or m.picked is not None:
            self.app.notify("no answers to choose from: F9 asks for several", severity="warning")
            return
        self.app.main.chat_log.views[id(m)].show((m.shown + delta) % len(m.samples))

    def keep_shown(self) -> None:
        """Keep the answer shown; the others are aborted and their blocks freed."""
        m = self.last()
        if m is None or m.picked is not None:
            self.app.notify("no answers to choose from: F9 asks for several", severity="warning")
            return
        if m.beams and m.streaming:
            self.app.notify(
                "the beam search runs: its hypotheses come when it ends", severity="warning"
            )
            return
        self.keep(m)
        self.app.notify(f"kept answer {m.picked + 1} of {len(m.samples)}", timeout=3)

    def branch(self, source: Message, index: int) -> None:
        """Another answer to the last turn with the settings now: `source`'s tokens before
        `index`, then the best candidate not chosen there, then what the model makes of it; or,
        with index -1, the turn asked again. Up to MAX_BRANCHES run at once, beside each other."""
        app = self.app
        reply = app.session.messages[-1] if app.session.messages else None
        if reply is None or (source is not reply and source not in reply.samples):
            app.notify("a branch starts in the last reply", severity="warning")
            return
        why = self.why_no_branch(reply)
        if why:
            app.notify(why, severity="warning")
            return
        given, what = [], "the turn asked again"
        if index >= 0:
            picked = source.tokens[index]
            rec = picked.record
            alt = next((c for c in rec.candidates if not c.chosen), None) if rec else None
            if alt is None:
                app.notify("no other candidate recorded for this token", severity="warning")
                return
            given = [*source.tokens[:index], ReplyToken(alt.token_id, alt.text, None)]
            what = (
                f"branch at token {index + 1}: '{token_label(alt.text)}' instead of "
                f"'{token_label(picked.text)}'"
            )
        plain = not reply.samples
        at = index if index >= 0 else None
        params = replace(app.session.params, n=1, beam_width=1)  # one answer per branch
        answer, conversation, prefix = app.session.branch(source, given, at, params)
        if plain:  # the reply becomes its first answer, beside the branch
            app.main.chat_log.remount(reply)
        else:
            app.main.chat_log.views[id(reply)].add_answer(answer)
        app.inspector.pinned = None
        app.main.prompt.focus()
        app.loop.send(answer.ticket, conversation, params, prefix=prefix, beside=True)
        app.notify(what, timeout=4)

    def why_no_branch(self, reply: Message) -> str | None:
        """Why the last reply can take no branch now, if it cannot."""
        running = [a for a in reply.samples if a.streaming]
        if reply.streaming and not all(a.ticket is not None for a in running):
            return "a reply is still streaming: Esc stops it"  # not its branches alone
        if len(running) >= MAX_BRANCHES:
            return f"at most {MAX_BRANCHES} branches run at once"
        if len(reply.samples) >= MAX_ANSWERS:
            return f"at most {MAX_ANSWERS} answers to a turn"
        return None

    def keep(self, m: Message) -> None:
        """Keep `m`'s answer shown: the chat goes on from it, the others' requests are aborted."""
        others = m.pick(m.shown)
        if others:
            self.app.loop.abort(others)
        self.app.main.chat_log.update(m)
        self.app.files.save()
