"""Agent harnesses written against the `openai` SDK, as a user would write them
(`environment.kind: openai`, `environment.rollout: harnesses_for_tests:<name>`)."""

import asyncio
import time


async def two_turns(client, row):
    """Asks, then asks to check the answer; named rewards: correct and short."""
    first = await client.chat.completions.create(model=row["model"], messages=row["prompt"])
    said = first.choices[0].message.content
    again = [
        *row["prompt"],
        {"role": "assistant", "content": said},
        {"role": "user", "content": "Check it and say it again."},
    ]
    second = await client.chat.completions.create(model=row["model"], messages=again)
    answer = second.choices[0].message.content
    return {"correct": float(str(row["answer"]) in answer), "short": 0.1 * (len(answer) < 40)}


async def rewrites_history(client, row):
    """The second request rewrites the first user turn: a prefix break."""
    first = await client.chat.completions.create(model=row["model"], messages=row["prompt"])
    edited = [
        {"role": "user", "content": row["prompt"][-1]["content"] + " Think first."},
        {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "user", "content": "Say it again."},
    ]
    second = await client.chat.completions.create(model=row["model"], messages=edited)
    return float(str(row["answer"]) in second.choices[0].message.content)


async def misbehaves(client, row):
    """Asks once, then misbehaves as the row's metadata says."""
    await client.chat.completions.create(model=row["model"], messages=row["prompt"])
    mode = row["metadata"].get("mode")
    if mode == "raise":
        raise ValueError("the harness broke")
    if mode == "hang":
        await asyncio.sleep(3600)
    if mode == "block":  # holds its thread: no await, no cancel
        time.sleep(float(row["metadata"].get("seconds", 3)))
    if mode == "garbage":
        return "yes"
    if mode == "nan":
        return float("nan")
    if mode == "bad_dict":
        return {"correct": [1]}
    return 1.0


async def never_asks(client, row):
    raise RuntimeError("no model needed")


def not_async(client, row):
    return 1.0
