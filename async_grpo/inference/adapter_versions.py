"""The LoRA adapters a generation worker serves: one per pushed policy version.

Each version is served under its own name (`v7`) and id from its own folder, so a request
keeps the adapter it started with while the next version loads beside it, and vLLM's
prefix cache, whose block hashes include the adapter's name and path, never reuses KV
computed under another version. A version is unloaded (and its folder removed) once a
newer one is served and no request uses it any more: vLLM reloads an evicted adapter from
its folder for a request still running, so the folder lives exactly as long as its users.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class Served:
    request: Any  # vllm.lora.request.LoRARequest
    folder: Path
    owned: bool  # a folder this worker wrote (removed with the version), not a checkpoint's
    users: int = 0


@dataclass
class AdapterVersions:
    """Versions in service, the newest of which new requests use."""

    root: Path  # where this worker writes the pushed versions' folders (under /dev/shm)
    served: dict[int, Served] = field(default_factory=dict)
    newest: int | None = None

    def folder(self, version: int) -> Path:
        return self.root / f"v{version}"

    def add(self, version: int, folder: Path, owned: bool) -> Any:
        """Serve `folder` as `version` for new requests; returns its LoRARequest. A version
        already in service (a catch-up push resends the version the others serve) keeps its
        request and its users: the same weights under the same name."""
        from vllm.lora.request import LoRARequest

        if version in self.served and self.served[version].folder == folder:
            self.newest = version
            return self.served[version].request
        request = LoRARequest(f"v{version}", version + 1, str(folder))  # ids start at 1
        self.served[version] = Served(request, folder, owned)
        self.newest = version
        return request

    def acquire(self) -> tuple[int | None, Any]:
        """(version, LoRARequest) for a new request; (None, None) before any adapter."""
        if self.newest is None:
            return None, None
        s = self.served[self.newest]
        s.users += 1
        return self.newest, s.request

    def release(self, version: int | None) -> None:
        if version is not None:
            self.served[version].users -= 1

    def retired(self) -> list[Served]:
        """Versions no request uses and none will: taken out of service (the caller
        unloads them from the engine, then calls `remove`)."""
        done = [v for v, s in self.served.items() if v != self.newest and s.users == 0]
        return [self.served.pop(v) for v in done]

    @staticmethod
    def remove(s: Served) -> None:
        if s.owned:
            shutil.rmtree(s.folder, ignore_errors=True)

    def clear(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)
