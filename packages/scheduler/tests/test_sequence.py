"""A sequence's finish reason as users see it."""

from __future__ import annotations

from nano_scheduler import FinishReason


def test_a_finish_reason_prints_as_its_value():
    assert [str(r) for r in FinishReason] == ["stop", "length", "abort"]
    assert f"{FinishReason.LENGTH}" == "length" and FinishReason.STOP == "stop"
    assert f"{FinishReason.ABORT:>6}" == " abort"
