"""An LLM judge: its prompt, its verdict, and `JudgeWorker`, the vLLM engine that serves it.

In: (question, reference answer, completion) triples, all untrusted text. Out: one
`(score in [0, 1] or None, reason)` per triple; None with reason `unparsed: ...` when the
verdict cannot be read, `error: ...` when the judgement could not run. The batcher turns
None into `verifier.judge.fallback` and counts it (batcher/model_scores.py).

- The prompt is `judge.template` with `{question}`, `{answer}` and `{completion}` filled in
  one pass: text put in a field is never read again for fields, and any tag the template
  uses as a fence (`<response>`, `</response>`) is escaped inside it, so a completion
  cannot close its field and write its own verdict outside it.
- `verdict: yes_prob` reads P(yes) / (P(yes) + P(no)) from the log-probs of the judge's
  first reply token (the top 20; every token whose text is a yes or no word counts): one
  forward, no sampling. `verdict: pattern` runs the judge greedily and reads the number
  that `judge.pattern` matches in its reply, mapped from `score_range` to [0, 1].
- The worker is a generation worker of pool `judge`: the same engine, registration,
  heartbeats and death handling, and never a weight push (the trainer pushes to the
  `generation` pool only).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import math
import re
import uuid
from pathlib import Path
from typing import Any

from async_grpo.config import GenerationConfig, JudgeConfig
from async_grpo.faults import fault_point
from async_grpo.inference.generation import GenerationWorker

FIELDS = ("question", "answer", "completion")
TOP_LOGPROBS = 20  # vLLM's default cap on returned log-probs per token
UNPARSED_LOGGED = 5  # unparsed verdicts a worker writes to its log

YES_NO_TEMPLATE = """You check answers to questions.

<question>
{question}
</question>

<reference>
{answer}
</reference>

<response>
{completion}
</response>

Does the response reach the same final answer as the reference? Answer yes or no."""

SCORE_TEMPLATE = """You grade answers to questions from 0 (wrong) to 10 (fully right).

<question>
{question}
</question>

<reference>
{answer}
</reference>

<response>
{completion}
</response>

Reply with one line: Score: N"""

_FIELD = re.compile(r"\{(" + "|".join(FIELDS) + r")\}")
_TAG = re.compile(r"<\s*/?\s*([A-Za-z][\w-]*)\s*>")


def judge_template(cfg: JudgeConfig) -> str:
    """The prompt template: `cfg.template` (the text itself, or a file holding it), else the
    built-in one for the verdict kind."""
    given = cfg.template
    if given is None:
        return YES_NO_TEMPLATE if cfg.verdict == "yes_prob" else SCORE_TEMPLATE
    if "\n" not in given and "{" not in given and Path(given).expanduser().is_file():
        return Path(given).expanduser().read_text()
    return given


def as_text(value: Any) -> str:
    """A field's text: strings as they are, chat messages as their last user turn, anything
    else (a countdown answer's dict) as JSON."""
    if isinstance(value, str):
        return value
    if isinstance(value, list) and value and all(isinstance(m, dict) for m in value):
        users = [m.get("content", "") for m in value if m.get("role") == "user"]
        return str(users[-1] if users else value[-1].get("content", ""))
    try:
        return json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError):
        return str(value)


def render(template: str, question: Any, answer: Any, completion: str) -> str:
    """The template with its three fields filled in once; every fence tag of the template
    (case and spacing ignored) is escaped in the filled text."""
    fences = {name.lower() for name in _TAG.findall(template)}

    def fenced(match: re.Match[str]) -> str:
        if match.group(1).lower() not in fences:
            return match.group(0)
        return match.group(0).replace("<", "&lt;").replace(">", "&gt;")

    values = {
        name: _TAG.sub(fenced, as_text(v))
        for name, v in zip(FIELDS, (question, answer, completion), strict=True)
    }
    return _FIELD.sub(lambda m: values[m.group(1)], template)


def yes_probability(top: dict[str, float], yes: list[str], no: list[str]) -> float | None:
    """P(yes) / (P(yes) + P(no)) over the first reply token's top log-probs (token text ->
    log-prob); None when neither a yes nor a no word is among them."""
    yes_words = {w.strip().lower() for w in yes}
    no_words = {w.strip().lower() for w in no}
    p_yes = sum(math.exp(lp) for t, lp in top.items() if t.strip().lower() in yes_words)
    p_no = sum(math.exp(lp) for t, lp in top.items() if t.strip().lower() in no_words)
    if p_yes + p_no <= 0.0:
        return None
    return p_yes / (p_yes + p_no)


def pattern_score(reply: str, pattern: str, score_range: list[float]) -> float | None:
    """The first number `pattern` (its group 1) finds in `reply`, mapped from `score_range`
    to [0, 1]; None when there is none or it lies outside the range."""
    match = re.search(pattern, reply)
    if match is None:
        return None
    try:
        value = float(match.group(1))
    except (IndexError, TypeError, ValueError):
        return None
    lo, hi = score_range
    if not (math.isfinite(value) and lo <= value <= hi):
        return None
    return (value - lo) / (hi - lo)


def judge_spec(cfg: JudgeConfig) -> str:
    """How a judge reads its verdicts, as one comparable line (the template by its hash)."""
    template = hashlib.sha256(judge_template(cfg).encode()).hexdigest()[:12]
    if cfg.verdict == "yes_prob":
        how = f"yes_prob (yes {cfg.yes}, no {cfg.no})"
    else:
        how = f"pattern {cfg.pattern!r} over {cfg.score_range}"
    return f"{how}, template {template}"


def check_judges(cfg: JudgeConfig, timeout_s: float = 60.0) -> int:
    """The registered judge workers read verdicts as `cfg` says, else a `ConfigError`
    naming both (a judge started with another config scores every sample otherwise,
    silently). Returns the workers checked."""
    from async_grpo.rewards.pool import check_specs

    return check_specs("judge", "judge_spec", judge_spec(cfg), "verifier.judge", timeout_s)


def engine_config(cfg: JudgeConfig) -> GenerationConfig:
    """The judge's engine settings, as a generation worker takes them."""
    return GenerationConfig(
        num_workers=cfg.num_workers,
        max_concurrent_seqs=cfg.max_concurrent_seqs,
        max_model_len=cfg.max_model_len,
        max_new_tokens=cfg.max_tokens,
        temperature=0.0,
        dtype=cfg.dtype,
        kv_cache_gib=cfg.kv_cache_gib,
        gpu_memory_utilization=cfg.gpu_memory_utilization,
        threads=cfg.threads,
        cpus=cfg.cpus,
    )


class JudgeWorker(GenerationWorker):
    """A vLLM engine that judges: `judge(items)` -> one (score or None, reason) each."""

    pool = "judge"

    def __init__(
        self,
        model_dir: str,
        cfg: JudgeConfig,
        worker_id: str | None = None,
        device: str = "cpu",
    ) -> None:
        super().__init__(model_dir, engine_config(cfg), worker_id, device)
        self.judge_cfg = cfg
        self.template = judge_template(cfg)
        self.spec = judge_spec(cfg)
        self.tokenizer: Any = None
        self.judged = 0
        self.unparsed = 0

    async def start(self, register: bool = True) -> str:
        from transformers import AutoTokenizer

        self.tokenizer = await asyncio.to_thread(AutoTokenizer.from_pretrained, self.model_dir)
        return await super().start(register)

    def prompt_ids(self, question: Any, answer: Any, completion: str) -> list[int]:
        """The rendered prompt's token ids: one user turn of the judge's chat template where
        it has one, else the text itself."""
        from async_grpo.data.tokenize import chat_token_ids

        text = render(self.template, question, answer, completion)
        if self.tokenizer.chat_template:
            return chat_token_ids(self.tokenizer, text)
        return self.tokenizer(text)["input_ids"]

    async def judge(self, items: list[tuple[Any, Any, str]]) -> list[tuple[float | None, str]]:
        """One verdict per (question, answer, completion), in order; never raises for one."""
        fault_point("judge.judge")
        self.in_flight += len(items)
        self.clock.enter()
        try:
            return list(await asyncio.gather(*(self._judge_one(*item) for item in items)))
        finally:
            self.in_flight -= len(items)
            self.clock.leave()

    async def _judge_one(
        self, question: Any, answer: Any, completion: str
    ) -> tuple[float | None, str]:
        from vllm import SamplingParams, TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        c = self.judge_cfg
        ids = self.prompt_ids(question, answer, completion)
        reply_tokens = 1 if c.verdict == "yes_prob" else c.max_tokens
        if len(ids) + reply_tokens > c.max_model_len:
            return None, (
                f"error: judge prompt of {len(ids)} tokens + {reply_tokens} leaves no room in"
                f" judge.max_model_len={c.max_model_len}"
            )
        params = SamplingParams(
            max_tokens=reply_tokens,
            temperature=1.0 if c.verdict == "yes_prob" else 0.0,  # yes_prob reads, never samples
            logprobs=TOP_LOGPROBS if c.verdict == "yes_prob" else None,
            seed=0,
            output_kind=RequestOutputKind.FINAL_ONLY,
        )
        final = None
        try:
            async for out in self.engine.generate(
                TokensPrompt(prompt_token_ids=ids), params, request_id=uuid.uuid4().hex
            ):
                final = out
        except ValueError as e:  # vLLM refused this request alone
            return None, f"error: judge request refused by vLLM: {str(e)[:200]}"
        except Exception:
            self._exit_if_engine_died()
            raise
        self.judged += 1
        self.requests_served += 1
        reply = final.outputs[0]
        if c.verdict == "yes_prob":
            first = (reply.logprobs or [{}])[0]
            top = {lp.decoded_token or "": lp.logprob for lp in first.values()}
            score = yes_probability(top, c.yes, c.no)
            if score is None:
                shown = ", ".join(repr(t) for t in list(top)[:5])
                return self._unparsed(f"no yes or no word among the first token's top ({shown})")
            return score, ""
        score = pattern_score(reply.text, c.pattern, c.score_range)
        if score is None:
            return self._unparsed(repr(reply.text[:80]))
        return score, ""

    def _unparsed(self, what: str) -> tuple[None, str]:
        """An unparsed verdict; the first few are written to this worker's log."""
        self.unparsed += 1
        if self.unparsed <= UNPARSED_LOGGED:
            print(f"{self.worker_id}: verdict unparsed: {what}", flush=True)
        return None, f"unparsed: {what}"

    async def ping(self) -> dict[str, Any]:
        return await super().ping() | {"judged": self.judged, "judge_spec": self.spec}
