"""The bookkeeping of the adapters a generation worker serves."""

from async_grpo.inference.adapter_versions import AdapterVersions


def test_an_adapter_retires_when_newer_and_unused(tmp_path):
    lora = AdapterVersions(tmp_path / "adapters")
    assert lora.acquire() == (None, None, None)  # before any adapter: the base
    first = lora.next_folder(1)
    first.mkdir(parents=True)
    lora.add(1, first, owned=True)
    serial, version, request = lora.acquire()
    assert (serial, version) == (1, 1) and request.lora_name == "v1-1"
    second = lora.next_folder(2)
    second.mkdir(parents=True)
    lora.add(2, second, owned=True)
    assert lora.retired() == []  # the first still has a request
    lora.release(serial)
    (old,) = lora.retired()
    assert old.version == 1 and lora.versions() == [2]
    lora.remove(old)
    assert not first.exists() and second.exists()


def test_the_same_version_again_is_a_new_adapter(tmp_path):
    """A version pushed again (a catch-up push, or a resumed trainer whose weights differ)
    gets a name, id and folder of its own: nothing in use is reloaded in place, and no
    cached KV of the first is reused under the second."""
    lora = AdapterVersions(tmp_path)
    a = lora.add(3, lora.next_folder(3), owned=True)
    serial, _, _ = lora.acquire()
    b = lora.add(3, lora.next_folder(3), owned=True)
    assert (a.lora_name, b.lora_name) == ("v3-1", "v3-2")
    assert a.lora_int_id != b.lora_int_id and a.lora_path != b.lora_path
    assert lora.acquire()[2] is b
    assert lora.retired() == []  # the first's request is still running
    lora.release(serial)
    assert [s.request for s in lora.retired()] == [a]


def test_a_checkpoint_folder_is_never_removed(tmp_path):
    lora = AdapterVersions(tmp_path / "adapters")
    ckpt = tmp_path / "step_4" / "adapter"
    ckpt.mkdir(parents=True)
    lora.add(4, ckpt, owned=False)
    lora.add(5, lora.next_folder(5), owned=True)
    (old,) = lora.retired()
    lora.remove(old)
    assert ckpt.is_dir()
