"""Which floating-point type each process computes in: `auto` resolved by the hardware.

In: a configured dtype ("auto", "float32", "bfloat16", "float16") and the device a process
runs on. Out: a concrete dtype name and one line saying why it was chosen.

`auto` is bf16 only where the device computes it natively: CUDA devices with bf16 support,
and CPUs with AMX or AVX512-BF16 whose torch kernels run at AVX512 or above. Everywhere else
it is fp32: on an AVX2-only CPU bf16 is emulated, and measured 22x slower for the trainer's
forward/backward and 5x slower for vLLM generation (docs/precision-and-attention.md).
Each process resolves its own `auto` on its own node, so a cluster of mixed CPUs is right
per worker. `ATEN_CPU_CAPABILITY=avx2` (torch's switch) also turns native bf16 off.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

NATIVE_CPU_CAPABILITIES = ("AVX512", "AMX")  # torch kernel levels that can use bf16 units


@dataclass(frozen=True)
class Precision:
    """A resolved dtype and the reason, e.g. ("bfloat16", "auto: cpu has amx_bf16")."""

    dtype: str
    reason: str

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    def describe(self) -> str:
        return f"{self.dtype} ({self.reason})"


def cpu_bf16_units() -> list[str]:
    """The CPU's native bf16 instruction sets that torch reports (empty on AVX2-only CPUs)."""
    units = []
    if torch.cpu._is_amx_tile_supported():
        units.append("amx_bf16")
    if torch.cpu._is_avx512_bf16_supported():
        units.append("avx512_bf16")
    return units


def cpu_kind() -> str:
    """A short description of this CPU for figures and logs, e.g. "AVX512 (amx_bf16, ...)"."""
    units = cpu_bf16_units()
    capability = torch.backends.cpu.get_cpu_capability()
    return f"{capability} ({', '.join(units)})" if units else f"{capability} (no native bf16)"


def native_bf16(device: str) -> tuple[bool, str]:
    """Whether `device` ("cpu", "cuda", "cuda:1") computes bf16 natively, and why."""
    if device.startswith("cuda"):
        if torch.cuda.is_available() and torch.cuda.is_bf16_supported(including_emulation=False):
            return True, f"{torch.cuda.get_device_name()} supports bf16"
        return False, "the CUDA device has no native bf16"
    capability = torch.backends.cpu.get_cpu_capability()
    units = cpu_bf16_units()
    if not units:
        return False, f"cpu is {capability} with no AMX or AVX512-BF16: bf16 would be emulated"
    if not capability.startswith(NATIVE_CPU_CAPABILITIES):
        return False, f"torch runs {capability} kernels on this cpu: bf16 would be emulated"
    return True, f"cpu has {' and '.join(units)}"


def resolve_dtype(requested: str, device: str) -> Precision:
    """`requested` as a concrete dtype name; `auto` picks bf16 or fp32 by `native_bf16`."""
    if requested != "auto":
        return Precision(requested, "set in the config")
    native, why = native_bf16(device)
    return Precision("bfloat16" if native else "float32", f"auto: {why}")
