"""The weight pusher's wait on its workers' answers, on a real local Ray cluster: a broadcast
member that died ends the wait at once (GroupBroken), even while another member is still
blocked; the others' answers and deaths are sorted as a push needs them."""

import os
import time

import pytest

from async_grpo.trainer.push import GroupBroken, WeightPusher

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def members(cluster):
    import ray

    @ray.remote(num_cpus=0)
    class Member:
        def die(self) -> None:
            os._exit(1)

        def hang(self) -> None:
            time.sleep(3600)

        def answer(self) -> int:
            return 7

    made = []

    class Members:  # every member made is killed at the end (the cluster outlives the module)
        @staticmethod
        def remote():
            made.append(Member.remote())
            return made[-1]

    yield Members
    for actor in made:
        ray.kill(actor)


def _pusher(transports: dict[str, str]) -> WeightPusher:
    """A rank-0 pusher with only what `_wait` reads: the workers' transports, no pools."""
    pusher = WeightPusher.__new__(WeightPusher)
    pusher.timeout_s = 120
    pusher.lost, pusher.members, pusher.pool_of, pusher.registries = [], {}, {}, {}
    pusher.transports = dict(transports)
    return pusher


def test_a_dead_broadcast_member_ends_the_wait_without_waiting_for_the_rest(members):
    """Rank 0's broadcast can complete while a member that relays the bytes dies; the
    member it relays to blocks in its receive until the group closes. Waiting for every
    answer first would wait out the whole timeout."""
    dead, blocked = members.remote(), members.remote()
    pusher = _pusher({"dead": "broadcast", "blocked": "broadcast"})
    t0 = time.monotonic()
    with pytest.raises(GroupBroken, match="dead"):
        refs = {"dead": dead.die.remote(), "blocked": blocked.hang.remote()}
        pusher._wait(refs, "load weight chunk 0", stop_on_broken=True)
    assert time.monotonic() - t0 < 60  # not the 120 s timeout
    assert pusher.lost == ["dead"] and "dead" not in pusher.transports


def test_without_stop_on_broken_every_answer_is_collected_first(members):
    """The default: all answers, then GroupBroken for the dead broadcast member; a dead
    shared-memory worker is only dropped."""
    a, b, c = members.remote(), members.remote(), members.remote()
    pusher = _pusher({"a": "broadcast", "b": "shm", "c": "broadcast"})
    refs = {"a": a.answer.remote(), "b": b.die.remote(), "c": c.answer.remote()}
    assert pusher._wait(refs, "answer") == {"a": 7, "c": 7}
    assert pusher.lost == ["b"]
    refs = {"a": a.die.remote(), "c": c.answer.remote()}
    with pytest.raises(GroupBroken, match="'a'"):
        pusher._wait(refs, "answer")
    assert pusher.lost == ["b", "a"]
