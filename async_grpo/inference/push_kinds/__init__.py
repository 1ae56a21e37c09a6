"""What a weight push carries, one class per kind, used on both sides of the push.

In: the kind's name, which the trainer's payload (trainer/payloads.py) declares and sends
in each worker's transport info (`info["payload"]`). Out: a `PushKind` whose methods do
that kind's part in the generation worker (`begin`, `end`: pausing, where the tensors go,
what is served after) and inside vLLM's worker process (`start`, `receive`, `finish`:
the model's layerwise reload, or an adapter folder). Kinds: `weights` (every weight, as
full or merged LoRA pushes send them) and `adapter` (LoRA factors, served as an adapter of
their own version). A new kind (say quantized weights) is one new module and one entry in
`select.KINDS`."""

from async_grpo.inference.push_kinds.base import PushKind
from async_grpo.inference.push_kinds.select import kind_of_folder, push_kind

__all__ = ["PushKind", "kind_of_folder", "push_kind"]
