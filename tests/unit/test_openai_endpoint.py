"""The OpenAI endpoint (environments/endpoint.py) with the real `openai` client over a real
socket, the real SmolLM2 tokenizer and chat template, vLLM's own request model and tool
parser. The pool behind it is scripted: it answers with the token ids of a scripted reply,
so what the trajectory keeps can be checked id by id."""

import asyncio
import json

import openai
import pytest

from async_grpo.environments.endpoint import OpenAIEndpoint
from async_grpo.inference.types import Completion, SamplingSettings

TOKEN = "t" * 32
MODEL = "policy"
RUN = SamplingSettings(max_new_tokens=64, temperature=1.0, top_p=1.0)


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


class Pool:
    """Answers each request with the next scripted reply (its ids, then EOS), version 3,
    log-prob -0.5 a token; keeps what it was asked."""

    def __init__(self, tokenizer, replies, eos=True):
        self.tokenizer, self.replies, self.asked, self.eos = tokenizer, list(replies), [], eos

    async def generate(self, ids, n, sampling):
        self.asked.append((list(ids), sampling))
        text = self.replies.pop(0)
        reply = self.tokenizer(text, add_special_tokens=False).input_ids
        if not self.eos:  # cut at its token limit
            return [Completion(reply, [-0.5] * len(reply), text, "length", 3)]
        reply = reply[: sampling.max_new_tokens - 1] + [self.tokenizer.eos_token_id]
        return [Completion(reply, [-0.5] * len(reply), text, "stop", 3)]


def _serve(tokenizer, replies, run, eos=True, **options):
    """`run(endpoint, pool)` against a started endpoint, in one event loop."""
    pool = Pool(tokenizer, replies, eos)

    async def main():
        ep = OpenAIEndpoint(pool.generate, tokenizer, MODEL, RUN, 2048, token=TOKEN, **options)
        await ep.start()
        try:
            return await run(ep, pool)
        finally:
            await ep.stop()

    return asyncio.run(asyncio.wait_for(main(), 60))


def _client(url, token=TOKEN):
    return openai.AsyncOpenAI(base_url=url, api_key=token, max_retries=0, timeout=20)


def test_two_turns_are_token_exact(tokenizer):
    """The second request carries the first reply as text; the pool is asked for the kept
    ids (the first prompt's, the sampled reply's, then the new turn's), and the rollout's
    one sample has the sampled tokens trained and the rest masked."""

    async def run(ep, pool):
        rid, url = ep.open()
        client = _client(url)
        first = [{"role": "user", "content": "What is 2 + 2?"}]
        a = await client.chat.completions.create(model=MODEL, messages=first, logprobs=True)
        assert a.choices[0].message.content == "It is 4."
        n = len(tokenizer("It is 4.", add_special_tokens=False).input_ids) + 1  # and EOS
        assert [t.logprob for t in a.choices[0].logprobs.content] == [-0.5] * n
        second = [
            *first,
            {"role": "assistant", "content": a.choices[0].message.content},
            {"role": "user", "content": "And 3 + 3?"},
        ]
        b = await client.chat.completions.create(model=MODEL, messages=second, max_tokens=8)
        assert b.choices[0].message.content == "6"
        assert pool.asked[1][1].max_new_tokens == 8  # narrowed
        traj = ep.close(rid)
        return traj, pool

    traj, pool = _serve(tokenizer, ["It is 4.", "6"], run)
    (seg,) = traj.segments
    prompt, reply = pool.asked[0][0], tokenizer("It is 4.", add_special_tokens=False).input_ids
    assert seg.prompt_ids == prompt
    assert pool.asked[1][0][: len(prompt) + len(reply) + 1] == [
        *prompt,
        *reply,
        tokenizer.eos_token_id,
    ]
    assert seg.context() == pool.asked[1][0] + seg.ids[len(pool.asked[1][0]) - len(prompt) :]
    assert sum(seg.mask) == len(reply) + 1 + 2  # both replies with their EOS
    trained = [t for t, m in zip(seg.ids, seg.mask, strict=True) if m]
    assert trained == [*reply, tokenizer.eos_token_id, *tokenizer("6").input_ids, 2]
    assert all(lp == -0.5 for lp, m in zip(seg.logprobs, seg.mask, strict=True) if m)
    assert set(seg.token_versions) == {3} and traj.prefix_breaks == 0
    rendered = tokenizer.decode(pool.asked[1][0])
    assert rendered.endswith("<|im_start|>user\nAnd 3 + 3?<|im_end|>\n<|im_start|>assistant\n")


def test_a_text_prompt_continues_from_the_kept_ids(tokenizer):
    """`/v1/completions`: a prompt that extends the served text continues the kept ids
    (the reply's sampled tokens stay); one that does not is a new sample."""

    async def run(ep, pool):
        rid, url = ep.open()
        client = _client(url)
        first = "Q: 2 + 2 =\nA:"
        a = await client.completions.create(model=MODEL, prompt=first, logprobs=1, max_tokens=8)
        assert a.choices[0].text == " 4" and a.choices[0].finish_reason == "length"
        n = len(tokenizer(" 4", add_special_tokens=False).input_ids)
        assert a.choices[0].logprobs.token_logprobs == [-0.5] * n
        second = first + a.choices[0].text + "\nQ: 3 + 3 =\nA:"
        await client.completions.create(model=MODEL, prompt=second)
        await client.completions.create(model=MODEL, prompt="Q: 5 + 5 =\nA:")
        with pytest.raises(openai.BadRequestError, match="echo: not served"):
            await client.completions.create(model=MODEL, prompt=second, echo=True)
        return ep.close(rid), pool

    traj, pool = _serve(tokenizer, [" 4", " 6", " 10"], run, eos=False)
    first, second = pool.asked[0][0], pool.asked[1][0]
    assert first == tokenizer("Q: 2 + 2 =\nA:").input_ids
    reply = tokenizer(" 4", add_special_tokens=False).input_ids
    assert second[: len(first) + len(reply)] == first + reply
    assert pool.asked[0][1].max_new_tokens == 8 and pool.asked[1][1].max_new_tokens == 16
    assert traj.prefix_breaks == 1 and [s.turns for s in traj.segments] == [2, 1]


def test_an_edited_history_is_a_new_sample(tokenizer):
    async def run(ep, pool):
        rid, url = ep.open()
        client = _client(url)
        first = [{"role": "user", "content": "What is 2 + 2?"}]
        await client.chat.completions.create(model=MODEL, messages=first)
        edited = [
            {"role": "user", "content": "What is 2 + 2, please?"},  # the harness rewrote it
            {"role": "assistant", "content": "It is 4."},
            {"role": "user", "content": "And 3 + 3?"},
        ]
        await client.chat.completions.create(model=MODEL, messages=edited)
        return ep.close(rid)

    traj = _serve(tokenizer, ["It is 4.", "6"], run)
    assert traj.prefix_breaks == 1 and len(traj.segments) == 2
    assert [s.turns for s in traj.segments] == [1, 1]


def test_what_the_loss_assumes_cannot_be_changed(tokenizer):
    async def run(ep, pool):
        rid, url = ep.open()
        client = _client(url)
        msgs = [{"role": "user", "content": "hi"}]
        seen = []
        for kwargs in (
            {"temperature": 0.5},
            {"top_p": 0.9},
            {"n": 2},
            {"frequency_penalty": 1.0},
            {"response_format": {"type": "json_object"}},
            {"messages": [{"role": "robot", "content": "x"}]},
        ):
            with pytest.raises(openai.BadRequestError) as e:
                await client.chat.completions.create(**{"model": MODEL, "messages": msgs, **kwargs})
            seen.append(e.value.body["message"])
        with pytest.raises(openai.NotFoundError, match="model 'gpt-4' is not served"):
            await client.chat.completions.create(model="gpt-4", messages=msgs)
        with pytest.raises(openai.NotFoundError, match="unknown rollout"):
            await _client(url.replace(rid, "nope")).chat.completions.create(
                model=MODEL, messages=msgs
            )
        with pytest.raises(openai.AuthenticationError):
            await _client(url, "wrong").chat.completions.create(model=MODEL, messages=msgs)
        assert [m.id for m in (await client.models.list()).data] == [MODEL]
        assert not pool.asked  # nothing refused reached the pool
        return seen

    seen = _serve(tokenizer, [], run)
    assert seen[0] == "temperature: the run samples at 1.0; the loss assumes it"
    assert seen[1] == "top_p: the run samples at 1.0; the loss assumes it"
    assert seen[2].startswith("n: one reply a request")
    assert seen[3].startswith("frequency_penalty: not served")
    assert seen[4].startswith("response_format: not served")
    assert seen[5].startswith("messages.0")


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two numbers",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "number"}, "b": {"type": "number"}},
                "required": ["a", "b"],
            },
        },
    }
]


def test_tool_calls_come_back_as_vllm_parses_them(tokenizer):
    """The reply's `<tool_call>` (hermes, as Qwen's templates write it) comes back as
    `tool_calls` with finish_reason `tool_calls`; malformed JSON inside the tags is the
    model's text, returned as content, never an error."""
    call = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'

    async def run(ep, pool):
        rid, url = ep.open()
        client = _client(url)
        msgs = [{"role": "user", "content": "1 + 2?"}]
        a = await client.chat.completions.create(model=MODEL, messages=msgs, tools=TOOLS)
        b = await client.chat.completions.create(model=MODEL, messages=msgs, tools=TOOLS)
        c = await client.chat.completions.create(model=MODEL, messages=msgs)  # no tools
        return a, b, c, pool

    a, b, c, pool = _serve(
        tokenizer, [call, "<tool_call>{not json</tool_call>", call], run, tool_parser="hermes"
    )
    (tc,) = a.choices[0].message.tool_calls
    assert a.choices[0].finish_reason == "tool_calls"
    assert tc.function.name == "add" and json.loads(tc.function.arguments) == {"a": 1, "b": 2}
    assert b.choices[0].message.tool_calls is None
    assert b.choices[0].message.content == "<tool_call>{not json</tool_call>"
    assert c.choices[0].message.tool_calls is None and c.choices[0].finish_reason == "stop"


HERMES = (  # tool calls as Qwen's templates write them: the arguments through `tojson`
    "{%- if tools %}{{- '<|im_start|>system\\nTools: ' + (tools | tojson) + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' and m.tool_calls %}{{- '<|im_start|>assistant\\n' }}"
    "{%- for tc in m.tool_calls %}"
    '{{- \'<tool_call>\\n{"name": "\' + tc.function.name + \'", "arguments": \' }}'
    "{{- tc.function.arguments | tojson }}{{- '}\\n</tool_call>' }}"
    "{%- endfor %}{{- '<|im_end|>\\n' }}"
    "{%- elif m.role == 'tool' %}"
    "{{- '<|im_start|>user\\n<tool_response>\\n' + m.content + '\\n</tool_response><|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}{{- '<|im_start|>assistant\\n' }}"
)


def test_a_tool_call_turn_keeps_the_sampled_tokens(tiny_model_dir, tmp_path):
    """The model writes its call's JSON compactly; the template would write it with
    spaces. The harness sends the call back as `tool_calls` with the tool's result: the
    next request continues from the sampled tokens (no prefix break), with only the
    template's text after the reply and the tool result tokenized as context."""
    from test_data_forms import with_template
    from transformers import AutoTokenizer

    model = with_template(tiny_model_dir, tmp_path / "hermes", HERMES)
    tokenizer = AutoTokenizer.from_pretrained(model)
    call = '<tool_call>\n{"name":"add","arguments":{"a":1,"b":2}}\n</tool_call>'

    async def run(ep, pool):
        rid, url = ep.open()
        client = _client(url)
        msgs = [{"role": "user", "content": "1 + 2?"}]
        a = await client.chat.completions.create(model=MODEL, messages=msgs, tools=TOOLS)
        (tc,) = a.choices[0].message.tool_calls
        msgs += [
            {"role": "assistant", "content": None, "tool_calls": [tc.model_dump()]},
            {"role": "tool", "tool_call_id": tc.id, "content": "3"},
        ]
        b = await client.chat.completions.create(model=MODEL, messages=msgs, tools=TOOLS)
        return ep.close(rid), pool, b

    traj, pool, b = _serve(tokenizer, [call, "It is 3."], run, tool_parser="hermes")
    assert b.choices[0].message.content == "It is 3."
    assert traj.prefix_breaks == 0 and len(traj.segments) == 1
    first, second = pool.asked[0][0], pool.asked[1][0]
    sampled = tokenizer(call, add_special_tokens=False).input_ids + [tokenizer.eos_token_id]
    after = "\n<|im_start|>user\n<tool_response>\n3\n</tool_response><|im_end|>\n"
    after += "<|im_start|>assistant\n"
    assert second == first + sampled + tokenizer(after, add_special_tokens=False).input_ids
    assert '{"name":"add","arguments":{"a":1,"b":2}}' in tokenizer.decode(second)
    seg = traj.segments[0]
    assert [t for t, m in zip(seg.ids, seg.mask, strict=True) if m][: len(sampled)] == sampled


def test_a_continued_final_message_is_context_and_the_next_turn_keeps_the_ids(tokenizer):
    """A prefill sent as vLLM takes it (a final assistant message with
    `continue_final_message`): its tokens are context, the reply continues it, and the
    next request (the prefill and reply as one assistant turn) continues the kept ids."""

    async def run(ep, pool):
        rid, url = ep.open()
        client = _client(url)
        ask = [{"role": "user", "content": "What is 12 * 34?"}]
        opened = {"continue_final_message": True, "add_generation_prompt": False}
        a = await client.chat.completions.create(
            model=MODEL,
            messages=[*ask, {"role": "assistant", "content": "<calc>"}],
            extra_body=opened,
        )
        said = "<calc>" + a.choices[0].message.content
        nxt = [*ask, {"role": "assistant", "content": said}, {"role": "user", "content": "408"}]
        await client.chat.completions.create(model=MODEL, messages=nxt)
        return ep.close(rid), pool

    traj, pool = _serve(tokenizer, ["12 * 34</calc>", "408"], run)
    first = tokenizer.decode(pool.asked[0][0])
    assert first.endswith("<|im_start|>assistant\n<calc>")  # the turn continued, not closed
    (seg,) = traj.segments
    assert traj.prefix_breaks == 0 and seg.turns == 2
    assert pool.asked[1][0][: len(pool.asked[0][0])] == pool.asked[0][0]
    trained = tokenizer.decode([t for t, m in zip(seg.ids, seg.mask, strict=True) if m])
    assert trained.startswith("12 * 34</calc>") and "<calc>" not in trained
