"""`async-grpo eval MODEL --data FILE`: held-out pass@k of a model or a checkpoint.

Starts a private Ray head (or joins `--address`), one vLLM generation worker on MODEL and
one verifier worker, none of them registered in a pool (a training run on the same
cluster never leases them), evaluates every prompt, prints a table and writes
`OUT/eval_samples.jsonl` (one line per completion, with its reward and reason) and
`OUT/eval_summary.json`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import time
import uuid
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from async_grpo.evaluation.target import eval_adapter


def add_eval_parser(sub: Any) -> None:
    p = sub.add_parser("eval", help="held-out pass@k of a model folder or a checkpoint")
    p.add_argument(
        "model",
        help="prepared name, HF folder, checkpoints/step_N (its hf/ or adapter/), or an adapter",
    )
    p.add_argument("--data", required=True, help="prompt JSONL (the training format)")
    p.add_argument("--config", default=None, help="YAML config: generation, verifier, eval")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("-n", "--samples", type=int, default=None, help="eval.samples_per_question")
    p.add_argument("--temperature", type=float, default=None, help="eval.temperature (0: greedy)")
    p.add_argument("--pass-k", type=int, nargs="+", default=None, help="eval.pass_k")
    p.add_argument("--max-questions", type=int, default=None)
    p.add_argument("--max-new-tokens", type=int, default=None)
    p.add_argument("--rewards", nargs="+", default=None, help="default: verifier.rewards")
    p.add_argument("-o", "--out", default="outputs/eval", help="folder for the two files")
    p.add_argument("--address", default=None, help="Ray cluster address (default: a private one)")
    p.set_defaults(func=run_eval)


def eval_config(args: argparse.Namespace) -> Any:
    """The run config with the command's flags written into its `eval` section."""
    from async_grpo.preflight.settings import load_config, validate

    cfg = load_config(args.config, args.overrides)
    flags = {
        "data": args.data,
        "samples_per_question": args.samples,
        "temperature": args.temperature,
        "pass_k": args.pass_k,
        "max_questions": args.max_questions,
        "max_new_tokens": args.max_new_tokens,
        "rewards": args.rewards,
    }
    cfg.eval = replace(cfg.eval, **{k: v for k, v in flags.items() if v is not None})
    if args.samples is not None and args.pass_k is None:
        cfg.eval.pass_k = sorted({1, args.samples})
    cfg.environment.name, cfg.environment.kind = None, "steps"  # eval scores single turns
    validate(cfg)
    return cfg


def run_eval(args: argparse.Namespace) -> int:
    import ray

    from async_grpo.data.tokenize import prepare_prompts
    from async_grpo.evaluation.runner import Evaluator
    from async_grpo.logs import quiet_libraries
    from async_grpo.preflight import checked_before_ray
    from async_grpo.ray_utils import connect
    from async_grpo.run import Watchdog, ignore_stop_signals, stop_on_signals, stopped_by
    from async_grpo.shm_files import RUN_ID_ENV, remove_run

    cfg = eval_config(args)
    model_dir = Path(checked_before_ray(cfg, "eval", model=args.model))
    e = cfg.eval
    prompts = prepare_prompts(
        e.data, model_dir, cfg.generation.max_model_len, cfg.prompt_format, cfg.eval_dataset
    )
    prompts = prompts[: e.max_questions] if e.max_questions else prompts
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    quiet_libraries()
    head, watchdog, started = None, None, time.time()
    run_id = os.environ.setdefault(RUN_ID_ENV, uuid.uuid4().hex[:8])  # its /dev/shm folder
    if not args.address:  # killed in any way, nothing of its private cluster is left
        watchdog = Watchdog(run_id, started)
        head = watchdog.private_head(1 << 29, log_monitor=False)
    actors: list[Any] = []
    try:
        connect(args.address or head.address, log_to_driver=False)
        stop_on_signals()  # after ray.init's handlers
        print(f"evaluating {model_dir} on {len(prompts)} prompts of {e.data}", flush=True)
        gen, ver = _start_workers(cfg, str(model_dir), actors, eval_adapter(args.model))
        clients = {"generation": gen, "verifier": ver}
        evaluator = Evaluator(e, cfg.generation.max_new_tokens, prompts, clients, cfg.verifier)
        result = asyncio.run(evaluator.evaluate(0))
    except KeyboardInterrupt as e:  # SIGTERM or SIGHUP (`stopped_by`); Ctrl-C as before
        if (signum := stopped_by(e)) == signal.SIGINT:
            raise
        print(
            f"stopped by {signal.Signals(signum).name}: stopping the evaluation and Ray", flush=True
        )
        return 128 + signum
    finally:
        ignore_stop_signals()
        for a in actors:
            ray.kill(a)
        if ray.is_initialized():
            ray.shutdown()
        if head is not None:
            head.stop()
        remove_run(run_id, since=started)  # an adapter's folders in /dev/shm
        if watchdog is not None:
            watchdog.close()
    with (out / "eval_samples.jsonl").open("w", encoding="utf-8") as f:
        for s in result.samples:
            f.write(json.dumps(s.to_json(), default=str) + "\n")
    summary = {
        "model": str(model_dir),
        "data": e.data,
        "eval": asdict(e),
        "metrics": result.metrics,
        "error": result.error,
    }
    (out / "eval_summary.json").write_text(json.dumps(summary, indent=2, default=str) + "\n")
    print(format_table(result.metrics))
    print(f"wrote {out / 'eval_samples.jsonl'} and {out / 'eval_summary.json'}")
    if result.error:
        print(f"async-grpo: warning: {result.error}", flush=True)
    return 1 if result.metrics.get("eval/questions", 0) == 0 else 0


def _start_workers(
    cfg: Any, model_dir: str, actors: list[Any], adapter: Path | None = None
) -> tuple[Any, Any]:
    """One generation and one verifier actor, private to this command (not registered);
    the generation worker serves `adapter` on its base when one is given."""
    import ray

    from async_grpo.evaluation.runner import DirectClient
    from async_grpo.inference.engine_args import vllm_env
    from async_grpo.inference.generation import GenerationWorker
    from async_grpo.rewards.pool import VerifierWorker

    g = cfg.generation
    gen = ray.remote(GenerationWorker).options(
        num_cpus=g.threads,
        max_concurrency=1000,
        runtime_env={"env_vars": vllm_env(g, cfg.trainer.device)},
    )
    serving = None
    if adapter is not None:
        from async_grpo.adapters import read_adapter_config
        from async_grpo.inference.types import AdapterServing

        serving = AdapterServing(int(read_adapter_config(adapter)["r"]), 2)
    wid = f"eval-gen-{uuid.uuid4().hex[:6]}"
    worker = gen.remote(model_dir, g, wid, cfg.trainer.device, serving)
    actors.append(worker)
    verifier = (
        ray.remote(VerifierWorker).options(num_cpus=0, max_concurrency=64).remote(cfg.verifier)
    )
    actors.append(verifier)
    ray.get([worker.start.remote(False), verifier.stats.remote()], timeout=900)
    if adapter is not None:
        ray.get(worker.load_weights_dir.remote(str(adapter), 0), timeout=300)
    return DirectClient([worker]), DirectClient([verifier])


def format_table(metrics: dict[str, float]) -> str:
    """The eval metrics as two aligned columns."""
    keys = sorted(k for k in metrics if k.startswith("eval/"))
    width = max(len(k) for k in keys) if keys else 0
    return "\n".join(f"{k:<{width}}  {metrics[k]:.4g}" for k in keys)
