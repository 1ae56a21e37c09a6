"""One rollout's tokens as the OpenAI endpoint served them, never re-tokenized from text.

A harness sends the whole conversation with every request, the model's earlier replies as
text. The trainer must see the tokens the sampler produced, not a re-tokenization of that
text (prime-rl#1352, verl#6719: templates and tokenizers do not round-trip). `Trajectory`
keeps, per rollout:

- the text the endpoint has served so far (the first prompt as the chat template rendered
  it, each reply as its sampled tokens decode, each new stretch of context as rendered);
- the token ids behind that text: the first prompt's, then each turn's new context (the
  tool results, the next user message, the template's own tokens: `mask` False) and each
  sampled reply (`mask` True, with the sampler's log-probs and the version per token).

A new request continues the kept ids in one of two ways:
- it repeats the previous request's messages, then the reply as the harness got it (text
  or `tool_calls`), then new messages: the conversation is rendered with a marker in the
  reply's place, and what the template puts after the reply is tokenized and appended.
  The reply's own tokens are the sampled ones, however the template would write them (a
  tool call's JSON re-serialised with other spacing, say);
- else, its whole rendering starts with the text served so far: only the rest is
  tokenized and appended.
When neither holds (a template that rewrites earlier turns, a harness that edits or drops
history), the episode so far is closed as one sample and a new one starts from the new
rendering: a prefix break, counted, never a silent re-tokenization.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class Segment:
    """A stretch of one rollout that trains as one sample: the prompt ids, then the ids
    after it with their mask, log-probs (0.0 where masked) and versions per token."""

    prompt_ids: list[int]
    ids: list[int] = field(default_factory=list)
    mask: list[bool] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    token_versions: list[int] = field(default_factory=list)
    turns: int = 0
    truncated: bool = False  # its last reply ended at its token limit

    def context(self) -> list[int]:
        return self.prompt_ids + self.ids


class Trajectory:
    """The segments of one rollout; `render(messages, tools, **options)` is the chat
    template's text for a conversation (`options`: `add_generation_prompt`,
    `continue_final_message`, as a vLLM server takes them)    for a conversation with the assistant's turn opened."""

    def __init__(self, tokenizer: Any, render: Any) -> None:
        self.tokenizer, self.render = tokenizer, render
        self.segments: list[Segment] = []
        self.served = ""  # the text behind the current segment's ids
        self.prefix_breaks = 0
        self.asked: list[dict[str, Any]] | None = None  # the last request's messages
        self.asked_text = ""  # their rendering, the assistant's turn opened
        self.ended = False  # the last reply ended with the end-of-sequence token

    def context_ids(
        self, messages: list[dict[str, Any]], tools: list[dict] | None, **options: bool
    ) -> list[int]:
        """The ids to generate the next reply from: the kept ids plus the new context's,
        or a new segment after a prefix break."""
        text = self.render(messages, tools, **options)
        after = self._after_reply(messages, tools, options) if self.segments else None
        self.asked, self.asked_text = messages, text
        return self._continue(text, after, special=False)

    def text_ids(self, text: str) -> list[int]:
        """The ids to generate from for a plain-text prompt (`/v1/completions`): the kept
        ids when `text` starts with the served text, else a new segment (the tokenizer's
        own BOS first, as a vLLM server tokenizes a completion prompt)."""
        self.asked, self.asked_text = None, ""
        return self._continue(text, None, special=True)

    def _continue(self, text: str, after: str | None, special: bool) -> list[int]:
        if after is None and self.segments and text.startswith(self.served):
            after = text[len(self.served) :]
        if after is not None:
            self._context(self._ids(after) if after else [])
            self.served = text
            return self.segments[-1].context()
        if self.segments:
            self.prefix_breaks += 1
        ids = self.tokenizer(text, add_special_tokens=special).input_ids
        self.segments.append(Segment(prompt_ids=list(ids)))
        self.served = text
        return self.segments[-1].prompt_ids

    def _after_reply(
        self, messages: list[dict[str, Any]], tools: list[dict] | None, options: dict[str, bool]
    ) -> str | None:
        """What the template writes after the last reply, when `messages` are the last
        request's, the reply, then more; None otherwise."""
        n = len(self.asked or [])
        if self.asked is None or len(messages) <= n + 1 or messages[:n] != self.asked:
            return None
        if messages[n].get("role") != "assistant":
            return None
        marker = f"\x00reply-{id(self)}\x00"
        marked = [*messages[:n], {"role": "assistant", "content": marker}, *messages[n + 1 :]]
        try:
            before, found, after = self.render(marked, tools, **options).partition(marker)
        except Exception:  # a template that takes no such turn: the text route decides
            return None
        if not found or before != self.asked_text or marker in after:
            return None
        eos = self.tokenizer.eos_token or ""
        if self.ended and eos and after.startswith(eos):  # sampled already, with the reply
            after = after[len(eos) :]
        return after

    def _context(self, ids: list[int]) -> None:
        seg = self.segments[-1]
        last = seg.token_versions[-1] if seg.token_versions else 0
        seg.ids += ids
        seg.mask += [False] * len(ids)
        seg.logprobs += [0.0] * len(ids)
        seg.token_versions += [last] * len(ids)

    def record(
        self, token_ids: list[int], logprobs: list[float], versions: list[int], truncated: bool
    ) -> str:
        """A reply sampled from `context_ids`' ids; returns its text as served (special
        tokens kept: the next rendering must reproduce them to keep the prefix)."""
        seg = self.segments[-1]
        seg.ids += token_ids
        seg.mask += [True] * len(token_ids)
        seg.logprobs += logprobs
        seg.token_versions += versions
        seg.turns += 1
        seg.truncated = truncated
        self.ended = bool(token_ids) and token_ids[-1] == self.tokenizer.eos_token_id
        text = self.tokenizer.decode(token_ids, skip_special_tokens=False)
        self.served += text
        return text

    def _ids(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False).input_ids)
