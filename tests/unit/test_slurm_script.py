"""The SLURM batch script docs/cluster.md ships (scripts/slurm/async-grpo.sbatch): it parses,
and it starts what the guide's by-hand procedure starts, with the same commands."""

import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "slurm" / "async-grpo.sbatch"


def test_the_slurm_script_parses_and_runs_the_guides_commands():
    r = subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    text = SCRIPT.read_text()
    for command in (
        "ray start --head --block",
        "ray start --block --address=",
        "--num-gpus=0",  # trainer nodes offer Ray no GPU
        "async-grpo worker --mode generation",
        "async-grpo worker --mode verifier",
        "torchrun --nnodes $TRAINER_NODES",
        "--node-rank \\$SLURM_NODEID",
        "-m async_grpo.cli train",
        "async-grpo stop --address",
    ):
        assert command in text, command
    assert "scripts/slurm/async-grpo.sbatch" in (REPO / "docs" / "cluster.md").read_text()
