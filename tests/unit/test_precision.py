"""`auto` dtypes: bf16 only where the device computes it natively."""

from __future__ import annotations

import os
import subprocess
import sys

import torch

from async_grpo.precision import cpu_bf16_units, cpu_kind, native_bf16, resolve_dtype


def test_explicit_dtypes_win():
    for name in ("float32", "bfloat16", "float16"):
        p = resolve_dtype(name, "cpu")
        assert (p.dtype, p.reason, p.torch_dtype) == (
            name,
            "set in the config",
            getattr(torch, name),
        )


def test_auto_on_this_cpu_follows_its_bf16_units():
    p = resolve_dtype("auto", "cpu")
    native = bool(cpu_bf16_units()) and torch.backends.cpu.get_cpu_capability().startswith(
        ("AVX512", "AMX")
    )
    assert p.dtype == ("bfloat16" if native else "float32")
    assert p.reason.startswith("auto: ") and p.describe().startswith(p.dtype)
    assert cpu_kind().startswith(torch.backends.cpu.get_cpu_capability())


def test_torch_running_avx2_kernels_means_fp32():
    """What an AVX2-only machine resolves to (torch's own switch forces AVX2 kernels)."""
    code = "from async_grpo.precision import resolve_dtype; print(resolve_dtype('auto', 'cpu'))"
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "avx2"}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert "dtype='float32'" in out.stdout and "emulated" in out.stdout


def test_cuda_without_a_gpu_is_not_native():
    if torch.cuda.is_available():
        assert native_bf16("cuda")[0] == torch.cuda.is_bf16_supported(including_emulation=False)
    else:
        assert native_bf16("cuda") == (False, "the CUDA device has no native bf16")
        assert resolve_dtype("auto", "cuda:0").dtype == "float32"
