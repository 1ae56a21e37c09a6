"""What a large prompt set costs a run's start: 100 rows against 1,000,000 rows of parquet.

    .venv/bin/python bench/data_scale.py [--rows 100 1000000] [--model smollm2-135m]

For each size it writes a parquet file of arithmetic questions (a `messages` column, as
`async-grpo data arithmetic --messages` writes), then, each in a fresh process, measures
what `checked_before_ray` does with it: `prepare_prompts` (read by `datasets`, every row
checked by the Arrow screen, the suspects and the rows near the context exactly) up to a
`PromptSampler` over the table and the first 64 prompts read (rendered and tokenized as
they are drawn). `cold` starts with an empty datasets cache (the first run on a file),
`warm` reuses the Arrow files the cold start wrote (every later start, `--resume`
included). Printed per start: seconds (wall), CPU seconds of the process (what a
busy machine does not inflate), and peak RSS above the process's RSS once the libraries
are imported (MB). The last line names this CPU's kind.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

CHILD = r"""
import json, resource, sys, time
import psutil
from async_grpo.config import DatasetConfig
from async_grpo.data import PromptSampler
from async_grpo.data.tokenize import prepare_prompts
import datasets
from transformers import AutoTokenizer  # torch with it: imported before the baseline
base = psutil.Process().memory_info().rss
use = resource.getrusage(resource.RUSAGE_SELF)
cpu0 = use.ru_utime + use.ru_stime
t0 = time.perf_counter()
table = prepare_prompts(sys.argv[1], sys.argv[2], 2048, "chat", DatasetConfig(prompt_key="messages"))
sampler = PromptSampler(len(table), seed=0)
first = [table[i] for i in sampler.take(64)]
seconds = time.perf_counter() - t0
use = resource.getrusage(resource.RUSAGE_SELF)
cpu = use.ru_utime + use.ru_stime - cpu0
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print(json.dumps({"prompts": len(table), "seconds": round(seconds, 2), "cpu_s": round(cpu, 2),
                  "peak_rss_above_baseline_mb": round((peak - base) / 2**20, 1),
                  "ids_of_first": len(first[0].input_token_ids)}))
"""


def write_parquet(path: Path, n: int) -> None:
    """`n` rows of `async-grpo data arithmetic --messages`, written in chunks with pyarrow."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from async_grpo.data.generate import arithmetic_rows

    chunk = 100_000
    writer = None
    for start in range(0, n, chunk):
        rows = arithmetic_rows(min(chunk, n - start), seed=start)
        table = pa.table(
            {
                "messages": [[{"role": "user", "content": r["input"]}] for r in rows],
                "answer": [r["answer"] for r in rows],
            }
        )
        writer = writer or pq.ParquetWriter(str(path), table.schema)
        writer.write_table(table)
    writer.close()


def start(path: Path, model: str, cache: Path) -> dict:
    env = {**os.environ, "HF_DATASETS_CACHE": str(cache), "HF_HUB_OFFLINE": "1"}
    env["PYTHONPATH"] = f"{REPO}{os.pathsep}{env.get('PYTHONPATH', '')}"
    r = subprocess.run(
        [sys.executable, "-c", CHILD, str(path), model], env=env, capture_output=True, text=True
    )
    if r.returncode:
        raise SystemExit(r.stderr[-3000:])
    return json.loads(r.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, nargs="+", default=[100, 1_000_000])
    p.add_argument("--model", default="smollm2-135m")
    args = p.parse_args()
    sys.path.insert(0, str(REPO))
    import torch

    from async_grpo.models import resolve_model

    model = str(resolve_model(args.model))
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for n in args.rows:
            path = Path(tmp) / f"arith-{n}.parquet"
            write_parquet(path, n)
            cache = Path(tmp) / f"cache-{n}"
            cold, warm = start(path, model, cache), start(path, model, cache)
            mb = round(path.stat().st_size / 2**20, 1)
            results.append({"rows": n, "parquet_mb": mb, "cold": cold, "warm": warm})
            print(json.dumps(results[-1]), flush=True)
    small, large = results[0], results[-1]
    for start_kind in ("cold", "warm"):
        a, b = small[start_kind], large[start_kind]
        print(
            f"{start_kind}: {large['rows']:,} rows vs {small['rows']:,}:"
            f" +{b['seconds'] - a['seconds']:.1f} s to prompts ready,"
            f" +{b['peak_rss_above_baseline_mb'] - a['peak_rss_above_baseline_mb']:.0f} MB peak RSS"
        )
    print(f"cpu: {torch.backends.cpu.get_cpu_capability()}, {os.cpu_count()} cores")


if __name__ == "__main__":
    main()
