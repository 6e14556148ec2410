"""Incremental detokenisation: growing output ids -> text deltas, without re-decoding them all."""

from __future__ import annotations

from pagechat.core.sequence import Sequence


def update_text(tokenizer, seq: Sequence) -> None:
    """Append the text completed by seq's newest tokens to seq.text.

    Decodes only a short window (from prefix offset), so long replies stay O(1) per token; waits
    while the window ends in a partial UTF-8 character (byte-level BPE splits characters in tokens).
    """
    out = seq.output_ids
    prefix, read = seq.detok
    before = tokenizer.decode(out[prefix:read], skip_special_tokens=True)
    after = tokenizer.decode(out[prefix:], skip_special_tokens=True)
    if after.endswith("\ufffd") or len(after) < len(before):
        return
    seq.text += after[len(before) :]
    seq.detok[:] = [read, len(out)]
