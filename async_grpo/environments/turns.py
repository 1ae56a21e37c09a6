"""The tokens between two model turns, from the model's own chat template.

After the model's turn (ids as sampled, never re-tokenised) an observation goes in as the
next user turn, then the assistant's turn is opened again. The text around the
observation is what the chat template renders there, found once by rendering a
two-turn conversation with markers. The observation itself is tokenised with special
tokens split (an observation cannot forge a turn) and cut at `max_tokens`.
"""

from __future__ import annotations

from typing import Any

_ACTION, _OBSERVATION = "\x00ACTION\x00", "\x00OBSERVATION\x00"


class TurnFormat:
    """`between(observation, model_closed_turn)` -> the ids to append after a model turn."""

    def __init__(self, tokenizer: Any, max_tokens: int) -> None:
        self.tokenizer, self.max_tokens = tokenizer, max_tokens
        chat = [
            {"role": "user", "content": "question"},
            {"role": "assistant", "content": _ACTION},
            {"role": "user", "content": _OBSERVATION},
        ]
        text = tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
        after_action = text.split(_ACTION, 1)[1]
        before, self._after = after_action.split(_OBSERVATION, 1)
        self.eos_id = tokenizer.eos_token_id
        eos = tokenizer.eos_token or ""
        # what closes the model's turn; the model writes it itself when it stops on EOS
        self._close = eos if eos and before.startswith(eos) else ""
        self._before = before[len(self._close) :]

    def _ids(self, text: str, split_special: bool) -> list[int]:
        return self.tokenizer(
            text, add_special_tokens=False, split_special_tokens=split_special
        ).input_ids

    def between(self, observation: str, model_closed_turn: bool) -> tuple[list[int], bool]:
        """(ids, cut): the close of the model's turn unless it wrote it, the user turn
        holding `observation` (at most `max_tokens` of it; `cut` says it was longer) and
        the opening of the next assistant turn."""
        obs = self._ids(observation, split_special=True)
        cut = len(obs) > self.max_tokens
        head = self._before if model_closed_turn else self._close + self._before
        return self._ids(head, False) + obs[: self.max_tokens] + self._ids(self._after, False), cut
