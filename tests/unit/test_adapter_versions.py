"""The bookkeeping of the adapter versions a generation worker serves."""

from async_grpo.inference.adapter_versions import AdapterVersions


def test_a_version_retires_when_newer_and_unused(tmp_path):
    lora = AdapterVersions(tmp_path / "adapters")
    for v in (1, 2):
        lora.folder(v).mkdir(parents=True)
    assert lora.acquire() == (None, None)  # before any adapter: the base
    lora.add(1, lora.folder(1), owned=True)
    v, request = lora.acquire()
    assert v == 1 and request.lora_name == "v1" and request.lora_int_id == 2
    lora.add(2, lora.folder(2), owned=True)
    assert lora.retired() == []  # version 1 still has a request
    lora.release(1)
    (old,) = lora.retired()
    assert old.request.lora_name == "v1" and sorted(lora.served) == [2]
    lora.remove(old)
    assert not lora.folder(1).exists() and lora.folder(2).exists()


def test_the_same_version_again_keeps_its_users(tmp_path):
    """A catch-up push resends the version served: its running requests keep counting."""
    lora = AdapterVersions(tmp_path)
    first = lora.add(3, lora.folder(3), owned=True)
    lora.acquire()
    again = lora.add(3, lora.folder(3), owned=True)
    assert again is first and lora.served[3].users == 1
    lora.release(3)
    assert lora.served[3].users == 0 and lora.retired() == []  # the newest stays


def test_a_checkpoint_folder_is_never_removed(tmp_path):
    lora = AdapterVersions(tmp_path / "adapters")
    ckpt = tmp_path / "step_4" / "adapter"
    ckpt.mkdir(parents=True)
    lora.add(4, ckpt, owned=False)
    lora.add(5, lora.folder(5), owned=True)
    (old,) = lora.retired()
    lora.remove(old)
    assert ckpt.is_dir()
