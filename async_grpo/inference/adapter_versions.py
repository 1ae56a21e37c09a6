"""The LoRA adapters a generation worker serves: one per push (or checkpoint) loaded.

Each load is served under a name and id of its own (`v7-3`: version 7, the worker's third
adapter) from a folder of its own, so a request keeps the adapter it started with while
the next one loads beside it, and vLLM's prefix cache, whose block hashes include the
adapter's name and path, never reuses KV computed under other weights. A version pushed
again (a catch-up push, or a trainer resumed from an earlier checkpoint whose weights
differ) is a new adapter too: nothing is reloaded in place under a name in use. An adapter
is unloaded (and its folder removed) once a newer one is served and no request uses it:
vLLM reloads an evicted adapter from its folder for a request still running, so the folder
lives exactly as long as its users.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class Served:
    version: int
    request: Any  # vllm.lora.request.LoRARequest
    folder: Path
    owned: bool  # a folder this worker wrote (removed with the adapter), not a checkpoint's
    users: int = 0


@dataclass
class AdapterVersions:
    """Adapters in service by serial number; new requests use the newest."""

    root: Path  # where this worker writes the pushed adapters' folders (under /dev/shm)
    served: dict[int, Served] = field(default_factory=dict)
    newest: int | None = None
    serial: int = 0  # adapters loaded so far

    def next_folder(self, version: int) -> Path:
        """The folder the next pushed adapter (of `version`) is written to."""
        return self.root / f"v{version}-{self.serial + 1}"

    def add(self, version: int, folder: Path, owned: bool) -> Any:
        """Serve `folder` as `version` for new requests; returns its LoRARequest."""
        from vllm.lora.request import LoRARequest

        self.serial += 1
        request = LoRARequest(f"v{version}-{self.serial}", self.serial, str(folder))
        self.served[self.serial] = Served(version, request, folder, owned)
        self.newest = self.serial
        return request

    def acquire(self) -> tuple[int | None, int | None, Any]:
        """(serial, version, LoRARequest) for a new request; Nones before any adapter."""
        if self.newest is None:
            return None, None, None
        s = self.served[self.newest]
        s.users += 1
        return self.newest, s.version, s.request

    def release(self, serial: int | None) -> None:
        if serial is not None:
            self.served[serial].users -= 1

    def versions(self) -> list[int]:
        return sorted({s.version for s in self.served.values()})

    def retired(self) -> list[Served]:
        """Adapters no request uses and none will: taken out of service (the caller
        unloads them from the engine, then calls `remove`)."""
        done = [k for k, s in self.served.items() if k != self.newest and s.users == 0]
        return [self.served.pop(k) for k in done]

    @staticmethod
    def remove(s: Served) -> None:
        if s.owned:
            shutil.rmtree(s.folder, ignore_errors=True)

    def clear(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)
