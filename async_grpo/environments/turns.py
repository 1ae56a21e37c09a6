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
    """`between(observation, model_closed_turn)` -> the ids to append after a model turn.

    `stop_ids`: every token id the engine stops on (the tokenizer's EOS and the model's
    `generation_config` EOS ids). The one whose text opens what the template writes after
    a model turn (`<|im_end|>`, Gemma's `<end_of_turn>`, Llama 3's `<|eot_id|>`) is the
    turn's close: a model turn that ends with it is closed already."""

    def __init__(self, tokenizer: Any, max_tokens: int, stop_ids: Any = ()) -> None:
        self.tokenizer, self.max_tokens = tokenizer, max_tokens
        chat = [
            {"role": "user", "content": "question"},
            {"role": "assistant", "content": _ACTION},
            {"role": "user", "content": _OBSERVATION},
        ]
        text = tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
        after_action = text.split(_ACTION, 1)[1]
        before, self._after = after_action.split(_OBSERVATION, 1)
        stops = {i for i in (tokenizer.eos_token_id, *stop_ids) if i is not None}
        self.close_id, self._close = None, ""  # the template's close of a model turn
        for i in sorted(stops):
            close = tokenizer.decode([i])
            if close and before.startswith(close) and len(close) > len(self._close):
                self.close_id, self._close = i, close
        self._before = before[len(self._close) :]

    def closed(self, token_ids: list[int]) -> bool:
        """Whether a model turn of `token_ids` ends with the template's own close."""
        return bool(token_ids) and token_ids[-1] == self.close_id

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
