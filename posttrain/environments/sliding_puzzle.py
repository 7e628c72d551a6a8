"""`sliding_puzzle`: a multi-turn game. The board is `size x size` with tiles 1..size^2-1 and a
blank `_`; it is solved when the tiles read in order with the blank last:

    1 2        1 2 3
    3 _        4 5 6
               7 8 _

Each turn the model answers with one move of the BLANK, written `<action>up</action>`
(or down, left, right; case and spaces inside the tags are ignored, the last tag counts,
and a final `<action>up` whose closing tag the backend dropped with the stop string counts).
"up" swaps the blank with the tile above it. The environment answers with the new board,
and generation stops at "</action>" (the next turn's stop string), so a small model only
has to learn a short, fixed format. Reward 1 on the move that solves the board, else 0; the
verdict (`CORRECT_KEY`) of every turn is whether the board is solved.

A game ends when it is solved, after `max_moves` moves, or on an invalid move (no action
tag, an unknown word, a move off the board) when `terminate_on_invalid` (otherwise the
invalid move costs a move and the board is shown again).

Puzzles are deterministic from a seed: `shuffle_moves` random blank moves from the solved
board, never undoing the previous move, continued while the board is still solved.
The game state lives in the sample's metadata: {"seed", "board" (list of rows, 0 = blank),
"moves"}; a sample without "board" starts from its seed's puzzle. `make_sliding_puzzle_rows`
makes the dataset rows (first message = rules + starting board).

Every row also carries a `demonstration` for `grpo.warmup_sft_steps` to imitate: a game played
by a teacher who always moves along a shortest solution (breadth-first search from the solved
board), except that it has a blind spot when `demo_error_rate` > 0: where the shortest move is
`left`, it moves another way with that probability. A model that imitates it solves the puzzles
whose solution never moves left and loops on the others, until RL finds the move the teacher
missed (examples/configs/grpo_sliding_puzzle.yaml).
"""

from __future__ import annotations

import functools
import logging
import random
import re
from typing import Any

from posttrain.environments.interfaces import CORRECT_KEY, PerSampleEnvironment, StepResult, last_assistant_text
from posttrain.schemas import EnvWorkerConfig, SlidingPuzzleEnvConfig

TASK_NAME = "sliding_puzzle"
ACTIONS = {"up": (-1, 0), "down": (1, 0), "left": (0, -1), "right": (0, 1)}
_OPPOSITE = {"up": "down", "down": "up", "left": "right", "right": "left"}
# The closing tag may be missing at the very end: backends such as vLLM drop the stop string.
_ACTION_TAG = re.compile(r"<action>\s*([A-Za-z]+)\s*(?:</action>|$)", re.IGNORECASE)
STOP_STRINGS = ["</action>"]

Board = list[list[int]]
log = logging.getLogger(__name__)
# Boards the teacher's distance table may hold before it gives up (~2 s and ~50 MB to build).
_MAX_TABLE_BOARDS = 200_000


def solved_board(size: int) -> Board:
    return [[(r * size + c + 1) % (size * size) for c in range(size)] for r in range(size)]


def _blank(board: Board) -> tuple[int, int]:
    for r, row in enumerate(board):
        for c, v in enumerate(row):
            if v == 0:
                return r, c
    raise ValueError(f"the board has no blank (0): {board}")


def apply_move(board: Board, action: str) -> Board | None:
    """The board after moving the blank in direction `action`; None if that leaves the board."""
    r, c = _blank(board)
    dr, dc = ACTIONS[action]
    nr, nc = r + dr, c + dc
    if not (0 <= nr < len(board) and 0 <= nc < len(board)):
        return None
    new = [row[:] for row in board]
    new[r][c], new[nr][nc] = new[nr][nc], 0
    return new


def shuffled_board(size: int, shuffle_moves: int, seed: int) -> Board:
    """The puzzle of `seed`: random blank moves from the solved board (no immediate undo)."""
    rng = random.Random(seed)
    goal = solved_board(size)
    board, previous, made = goal, None, 0
    while made < shuffle_moves or board == goal:
        options = [a for a in ACTIONS if a != _OPPOSITE.get(previous) and apply_move(board, a) is not None]
        previous = rng.choice(options)
        board = apply_move(board, previous)
        made += 1
    return board


class _Distances:
    """Moves from a board to the solved one: a breadth-first search from the solved board, one
    level deeper each time a board beyond the levels searched so far is asked for."""

    def __init__(self, size: int):
        goal = solved_board(size)
        self.size, self.table, self.frontier = size, {_key(goal): 0}, [goal]

    def __call__(self, board: Board) -> int:
        while _key(board) not in self.table:
            if len(self.table) > _MAX_TABLE_BOARDS:
                raise ValueError(f"the teacher's search from the solved {self.size}x{self.size} board passed "
                                 f"{len(self.table):,} boards; lower env.sliding_puzzle.cfg.shuffle_moves or max_moves")
            depth, frontier = self.table[_key(self.frontier[0])] + 1, []
            for b in self.frontier:
                for action in ACTIONS:
                    nb = apply_move(b, action)
                    if nb is not None and _key(nb) not in self.table:
                        self.table[_key(nb)] = depth
                        frontier.append(nb)
            self.frontier = frontier
        return self.table[_key(board)]


def _key(board: Board) -> tuple[int, ...]:
    return tuple(v for row in board for v in row)


@functools.cache
def _distances(size: int) -> _Distances:
    return _Distances(size)


def shortest_move(board: Board) -> str | None:
    """The first move (in `ACTIONS` order) of a shortest solution of `board`; None if solved."""
    distance = _distances(len(board))
    here = distance(board)
    if here == 0:
        return None
    return next(a for a in ACTIONS if (nb := apply_move(board, a)) is not None and distance(nb) == here - 1)


def teacher_game(board: Board, cfg: SlidingPuzzleEnvConfig, error_rate: float, rng: random.Random) -> list[dict]:
    """The messages of a game the teacher plays from `board` (its moves and the environment's
    answers, up to its last move): shortest moves, except that a `left` becomes the first valid
    of up, down, right with probability `error_rate`."""
    messages: list[dict[str, str]] = []
    moves = 0
    while True:
        action = shortest_move(board)
        if action == "left" and rng.random() < error_rate:
            action = next(a for a in ("up", "down", "right") if apply_move(board, a) is not None)
        messages.append({"role": "assistant", "content": f"<action>{action}</action>"})
        result = play(board, moves, action, cfg, {})
        if result.terminated:
            return messages
        messages.append({"role": "user", "content": result.observation})
        board, moves = result.metadata["board"], result.metadata["moves"]


def play(board: Board, moves: int, action: str | None, cfg: SlidingPuzzleEnvConfig,
         metadata: dict[str, Any]) -> StepResult:
    """One turn: `action` (None: unreadable) on `board` after `moves` moves; the new state is
    `metadata` updated with board, moves, solved and the verdict (solved)."""
    new_board = apply_move(board, action) if action is not None else None
    moves += 1
    if new_board is None:
        ended = cfg.terminate_on_invalid or moves >= cfg.max_moves
        text = f"Invalid move. Board:\n{render_board(board)}"
        state = {**metadata, "board": board, "moves": moves, "solved": False, CORRECT_KEY: False}
        return StepResult(text, 0.0, ended, state, action, None if ended else STOP_STRINGS)
    solved = new_board == solved_board(len(new_board))
    state = {**metadata, "board": new_board, "moves": moves, "solved": solved, CORRECT_KEY: solved}
    if solved:
        return StepResult("Solved!", 1.0, True, state, action)
    if moves >= cfg.max_moves:
        return StepResult(f"Out of moves. Board:\n{render_board(new_board)}", 0.0, True, state, action)
    return StepResult(f"Board:\n{render_board(new_board)}", 0.0, False, state, action, STOP_STRINGS)


def render_board(board: Board) -> str:
    return "\n".join(" ".join(str(v) if v else "_" for v in row) for row in board)


def parse_action(text: str) -> str | None:
    """The last `<action>word</action>` of `text`, lower-cased, if it names a move; else None."""
    found = _ACTION_TAG.findall(text)
    if not found:
        return None
    word = found[-1].lower()
    return word if word in ACTIONS else None


def puzzle_prompt(board: Board) -> str:
    size = len(board)
    return (
        f"Sliding puzzle. Reach\n{render_board(solved_board(size))}\n"
        "by moving the blank _ with <action>up</action>, down, left or right.\n"
        f"Board:\n{render_board(board)}"
    )


def make_sliding_puzzle_rows(num_rows: int, cfg: SlidingPuzzleEnvConfig, seed: int,
                             demo_error_rate: float = 0.0) -> list[dict[str, Any]]:
    """`num_rows` RL rows, each a seeded puzzle: {"messages", "task_name", "answer": None,
    "metadata", "stop_strings", "demonstration"} (the first turn stops at "</action>" like the
    later ones; the demonstration is the teacher's game, see the module docstring)."""
    rng = random.Random(seed)
    teacher = random.Random(seed + 1)  # its own stream: the puzzles do not depend on the error rate
    rows = []
    for _ in range(num_rows):
        puzzle_seed = rng.randrange(2**31)
        board = shuffled_board(cfg.size, cfg.shuffle_moves, puzzle_seed)
        rows.append(
            {
                "messages": [{"role": "user", "content": puzzle_prompt(board)}],
                "task_name": TASK_NAME,
                "answer": None,
                "metadata": {"seed": puzzle_seed, "board": board, "moves": 0},
                "stop_strings": list(STOP_STRINGS),
            }
        )
    try:
        for row in rows:
            row["demonstration"] = teacher_game(row["metadata"]["board"], cfg, demo_error_rate, teacher)
    except ValueError as e:  # puzzles too far from solved for the teacher: fine unless a warm-up needs them
        log.warning("sliding_puzzle rows have no demonstrations for grpo.warmup_sft_steps: %s", e)
        for row in rows:
            row.pop("demonstration", None)
    return rows


class SlidingPuzzleEnvironment(PerSampleEnvironment):
    config_class = SlidingPuzzleEnvConfig

    def __init__(self, cfg: EnvWorkerConfig):
        self.cfg = SlidingPuzzleEnvConfig.model_validate(cfg.cfg)

    def _state(self, metadata: dict[str, Any]) -> tuple[Board, int]:
        if metadata.get("board") is not None:
            board = [list(map(int, row)) for row in metadata["board"]]
            if sorted(v for row in board for v in row) != list(range(len(board) ** 2)) or any(
                len(row) != len(board) for row in board
            ):
                raise ValueError(f"sliding_puzzle: metadata['board'] is not a valid square board: {metadata['board']}")
        elif metadata.get("seed") is not None:
            board = shuffled_board(self.cfg.size, self.cfg.shuffle_moves, int(metadata["seed"]))
        else:
            raise KeyError("sliding_puzzle: the sample's metadata has neither 'board' nor 'seed'")
        return board, int(metadata.get("moves") or 0)

    def step_one(self, messages: list[dict[str, str]], metadata: dict[str, Any]) -> StepResult:
        board, moves = self._state(metadata)
        return play(board, moves, parse_action(last_assistant_text(messages)), self.cfg, metadata)
