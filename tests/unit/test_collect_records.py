"""``tandem collect``'s records: one per model role that replied; none for a role whose episode ended first."""

from __future__ import annotations

from services.contracts.players import Local
from services.play.collect import records
from services.play.episode import EpisodeResult


def test_a_role_that_never_replied_gets_no_record() -> None:
    roles = {"X": Local(path="ckpt/A/v00003", agent="A"), "O": Local(path="models/demo", agent="B")}
    chats = {"X": [{"role": "user", "content": "board"}, {"role": "assistant", "content": "9"}],
             "O": []}  # X's illegal first move ended the game before O's first turn
    result = EpisodeResult("e1", "g1", roles, {"X": -1.0, "O": 0.0}, [], {}, {"winner": "O"}, "collect", chats)
    out = records(result, "tictactoe", None)
    assert [(r["role"], r["agent"], r["weight_version"], r["reward"]) for r in out] == [("X", "A", 3, -1.0)]
    assert out[0]["messages"] == chats["X"]
