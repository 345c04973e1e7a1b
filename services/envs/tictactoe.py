"""Tic-tac-toe between two roles, "X" and "O" (docs/architecture.md §8: two trained players in a game).

Rules
-----
The board has 9 cells numbered 1-9 row-major::

    1 2 3
    4 5 6
    7 8 9

X moves first, then the roles alternate. A role's observation is the board as
9 characters (``x``, ``o`` or ``.`` for empty, row-major), a ``|`` and the
role's own mark, e.g. ``"x...o....|x"`` (11 characters: short, because the
demo model reads one byte per token).

A reply must be a single digit 1-9 naming an empty cell, after stripping
whitespace. Three marks in a row, column or diagonal win; a full board with no
line is a draw.

Rewards (final, per role)
-------------------------
* win +1, loss -1, draw 0 for both;
* format penalty: a reply that is not a single digit 1-9, or names an occupied
  cell, is illegal. The episode ends at once; the role that replied gets
  ``illegal_reward`` (default -1, as a loss) and the other role 0 (it neither
  won nor lost).

Parameters
----------
* ``illegal_reward`` (float, -10 to -1, default -1): below -1 an illegal reply
  is worse than a loss, so a losing policy still gains by staying legal.
* ``tactic_penalty`` (float, 0-1, default 0): reward shaping, training only. A legal move that misses an
  immediate win, or the one cell that blocks the other side's immediate win (``tactical_miss``), pays
  ``-tactic_penalty`` on its own turn (``StepResult.turn_rewards``; the role's reward sums them), so
  per-turn credit (``algorithm.credit: turn``) blames that move and not the game's earlier ones.
  Evaluations play without it (``params.unshaped``): their score is the game's.
* ``opening_moves`` (int, 0-4, default 0): the episode starts with that many
  random legal moves drawn from the seed, so groups with different seeds start
  from different positions while the G copies of one group share theirs. At
  most 4, so that no opening is already decided.

Measures (``summary``, per role; evaluations average the evaluated player's):
``missed_wins``, moves that could have won at once and did not; ``missed_blocks``,
moves with no win of their own that left the other side a win on its next move
which one cell could have stopped (a fork, two such cells, is not counted: no
move stops it).

Scripted players: ``random`` (a uniformly random legal move), ``tactical`` (wins
at once when it can, else blocks the other side's immediate win, else a random
legal move: a middle opponent that punishes a missed block at once and takes
back a missed win) and ``minimax`` (perfect play; among equally good moves it
picks with the caller's rng).
"""

from __future__ import annotations

import html
import random
from functools import cache
from typing import Any, ClassVar

from pydantic import Field

from services.envs.base import Environment, StepResult
from services.envs.params import SHAPING, EnvParams

LINES: tuple[tuple[int, int, int], ...] = (
    (0, 1, 2), (3, 4, 5), (6, 7, 8),
    (0, 3, 6), (1, 4, 7), (2, 5, 8),
    (0, 4, 8), (2, 4, 6),
)
MARKS: dict[str, str] = {"X": "x", "O": "o"}
MAX_OPENING_MOVES = 4


def winner_of(board: str) -> str | None:
    """"X" or "O" if that role has three in a row on ``board`` (9 chars of x/o/.), else None."""
    for a, b, c in LINES:
        if board[a] != "." and board[a] == board[b] == board[c]:
            return "X" if board[a] == "x" else "O"
    return None


def legal_cells(board: str) -> list[int]:
    """Empty cells, 1-based."""
    return [i + 1 for i, ch in enumerate(board) if ch == "."]


def parse_move(reply: str) -> int | None:
    """The cell (1-9) a reply names, or None if it is not a single digit 1-9."""
    text = reply.strip()
    if len(text) == 1 and text in "123456789":
        return int(text)
    return None


@cache
def minimax_value(board: str, to_move: str) -> int:
    """Game value for X (+1 X wins, 0 draw, -1 O wins) with perfect play from ``board``."""
    won = winner_of(board)
    if won is not None:
        return 1 if won == "X" else -1
    if "." not in board:
        return 0
    mark = MARKS[to_move]
    nxt = "O" if to_move == "X" else "X"
    values = [minimax_value(board[:i] + mark + board[i + 1:], nxt) for i in range(9) if board[i] == "."]
    return max(values) if to_move == "X" else min(values)


def best_moves(board: str, to_move: str) -> list[int]:
    """All cells (1-based) that keep the best game value for ``to_move``."""
    mark = MARKS[to_move]
    nxt = "O" if to_move == "X" else "X"
    scored = [(minimax_value(board[:i] + mark + board[i + 1:], nxt), i + 1)
              for i in range(9) if board[i] == "."]
    sign = 1 if to_move == "X" else -1
    best = max(sign * v for v, _ in scored)
    return [cell for v, cell in scored if sign * v == best]


def winning_cells(board: str, role: str) -> list[int]:
    """Empty cells (1-based) that would give ``role`` three in a row."""
    mark = MARKS[role]
    return [i + 1 for i in range(9) if board[i] == "." and winner_of(board[:i] + mark + board[i + 1:]) == role]


def tactical_moves(board: str, to_move: str) -> list[int]:
    """Cells (1-based) that win at once for ``to_move``; else those that block the other side's immediate
    win; else every empty cell."""
    for role in (to_move, "O" if to_move == "X" else "X"):
        cells = winning_cells(board, role)
        if cells:
            return cells
    return legal_cells(board)


def tactical_miss(board: str, role: str, cell: int) -> str | None:
    """``"win"`` if ``role`` could have won at once on ``board`` and ``cell`` does not; ``"block"`` if it could
    not, the other side threatens one cell only and ``cell`` is not it; else None."""
    wins = winning_cells(board, role)
    if wins:
        return None if cell in wins else "win"
    threats = winning_cells(board, "O" if role == "X" else "X")
    return "block" if len(threats) == 1 and cell not in threats else None


class TicTacToeParams(EnvParams):
    opening_moves: int = Field(0, ge=0, le=MAX_OPENING_MOVES, description="random legal moves the episode starts with")
    illegal_reward: float = Field(-1.0, ge=-10.0, le=-1.0, description="the reward of an illegal reply (a loss is -1; "
                                  "below -1 an illegal move is worse than losing; evaluations score it as a loss)")
    tactic_penalty: float = Field(0.0, ge=0.0, le=1.0, json_schema_extra=SHAPING,
                                  description="shaping: a move that misses an immediate win or the one block of "
                                  "the other side's immediate win pays -tactic_penalty on its turn")


class TicTacToe(Environment[TicTacToeParams]):
    roles: ClassVar[tuple[str, ...]] = ("X", "O")
    description: ClassVar[str] = ("Tic-tac-toe: reply with one digit 1-9 (empty cell, row-major). "
                                  "Win +1, loss -1, draw 0; an illegal reply ends the game and scores "
                                  "illegal_reward (default -1); tactic_penalty (default 0) shapes training.")
    scripted_players: ClassVar[tuple[str, ...]] = ("random", "tactical", "minimax")
    env_name: ClassVar[str] = "tictactoe"
    is_game: ClassVar[bool] = True
    render_format: ClassVar[str] = "html"
    summary_measures: ClassVar[tuple[str, ...] | None] = ("missed_wins", "missed_blocks")

    def __init__(self, params: dict[str, Any] | EnvParams, seed: int) -> None:
        super().__init__(params, seed)
        self.board = "." * 9
        self.moves: list[int] = []
        self.to_move = "X"
        self.done = False
        self.winner: str | None = None
        self.illegal = False
        self.illegal_reply: str | None = None
        self.missed = {kind: dict.fromkeys(self.roles, 0) for kind in ("win", "block")}
        self.opening_moves = self.params.opening_moves
        for _ in range(self.opening_moves):
            self._play(self.rng.choice(legal_cells(self.board)))

    def _play(self, cell: int) -> None:
        self.board = self.board[:cell - 1] + MARKS[self.to_move] + self.board[cell:]
        self.moves.append(cell)
        self.to_move = "O" if self.to_move == "X" else "X"

    def current_role(self) -> str:
        return self.to_move

    def observation(self, role: str) -> str:
        if role not in MARKS:
            raise ValueError(f"unknown role {role!r}; roles are X and O")
        return f"{self.board}|{MARKS[role]}"

    async def step(self, role: str, reply: str) -> StepResult:
        if self.done:
            raise RuntimeError("the episode is over")
        self.check_turn(role)
        other = "O" if role == "X" else "X"
        cell = parse_move(reply)
        if cell is None or self.board[cell - 1] != ".":
            self.done = True
            self.illegal = True
            self.illegal_reply = reply[:32]
            why = "unparseable" if cell is None else "occupied"
            return StepResult(done=True, rewards={role: self.params.illegal_reward, other: 0.0},
                              info={"illegal": why, "reply": reply[:32]})
        miss = tactical_miss(self.board, role, cell)
        turn: dict[str, float] = {}
        if miss is not None:
            self.missed[miss][role] += 1
            if self.params.tactic_penalty:
                turn[role] = -self.params.tactic_penalty
        self._play(cell)
        won = winner_of(self.board)
        if won is not None:
            self.done = True
            self.winner = won
            return StepResult(done=True, rewards={role: 1.0, other: -1.0}, turn_rewards=turn, info={"winner": won})
        if "." not in self.board:
            self.done = True
            self.winner = "draw"
            return StepResult(done=True, rewards={role: 0.0, other: 0.0}, turn_rewards=turn, info={"winner": "draw"})
        return StepResult(done=False, turn_rewards=turn)

    def scripted_reply(self, role: str, player: str, rng: random.Random) -> str:
        if player == "random":
            return str(rng.choice(legal_cells(self.board)))
        if player == "tactical":
            return str(rng.choice(tactical_moves(self.board, role)))
        if player == "minimax":
            return str(rng.choice(best_moves(self.board, role)))
        raise ValueError(f"unknown scripted player {player!r}; choose from {self.scripted_players}")

    def summary(self) -> dict[str, Any]:
        return {"board": self.board, "winner": self.winner, "illegal": self.illegal,
                "moves": list(self.moves), "opening_moves": self.opening_moves,
                "illegal_reply": self.illegal_reply, "missed_wins": dict(self.missed["win"]),
                "missed_blocks": dict(self.missed["block"])}

    @classmethod
    def render(cls, state: dict[str, Any]) -> str | None:
        """The board as an HTML table; each mark carries its move number, the last move is marked."""
        board = state.get("board")
        if not isinstance(board, str) or len(board) != 9 or set(board) - set("xo."):
            return None
        moves = [m for m in state.get("moves") or [] if isinstance(m, int) and 1 <= m <= 9]
        order = {cell: i + 1 for i, cell in enumerate(moves)}
        rows = []
        for r in range(3):
            cells = []
            for c in range(3):
                cell = 3 * r + c + 1
                mark = board[cell - 1]
                last = " last" if moves and cell == moves[-1] else ""
                num = f"<sub>{order[cell]}</sub>" if mark != "." and cell in order else ""
                text = mark.upper() if mark != "." else f'<span class="empty">{cell}</span>'
                cells.append(f'<td class="ttt-{mark if mark != "." else "e"}{last}">{text}{num}</td>')
            rows.append("<tr>" + "".join(cells) + "</tr>")
        winner = state.get("winner")
        if state.get("illegal"):
            caption = f"illegal reply {state.get('illegal_reply') or ''!r}"
        else:
            caption = {"X": "X wins", "O": "O wins", "draw": "draw", None: "in play"}.get(winner, str(winner))
        return (f'<table class="ttt-board"><caption>{html.escape(caption)}</caption>'
                + "".join(rows) + "</table>")
