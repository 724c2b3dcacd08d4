"""The README's training loop runs as pasted, and the scripts of examples/ at their
smoke sizes.

Each runs as a user runs it: by its path, in a subprocess of this Python, from a fresh
working directory (the README's loop copied there; the scripts import their neighbour
resnet.py by path). One intra-op thread: on a small shared machine PyTorch's default of
one thread per core runs several times slower when other jobs hold the cores. About
40 s in all on two shared CPU cores.
"""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
TIMEOUT_S = 180


def run(args: list, cwd: Path) -> str:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "error::UserWarning"}
    done = subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=TIMEOUT_S)
    assert done.returncode == 0, f"{args} failed:\n{done.stdout}\n{done.stderr}"
    return done.stdout


def readme_quick_start() -> str:
    """The first ```python block after the README's "## Quick start" heading."""
    text = (ROOT / "README.md").read_text()
    section = text.split("\n## Quick start\n", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```python\n(.*?)```", section, flags=re.DOTALL)
    assert blocks, "README.md's Quick start has no ```python block"
    return blocks[0]


def test_the_readme_training_loop_runs_as_pasted(tmp_path):
    script = tmp_path / "quick_start.py"
    script.write_text(readme_quick_start())
    out = run([str(script)], cwd=tmp_path)
    held = re.search(r"loss \d+\.\d{3}; held for backward after the forward: \{'device': (\d+), 'host': 0\}", out)
    assert held and int(held.group(1)) > 0, out
    assert re.search(r"^layer +name +type +segment +keeps", out, flags=re.MULTILINE), out  # describe()


def test_train_resnet(tmp_path):
    out = run([str(EXAMPLES / "train_resnet.py")], cwd=tmp_path)
    assert "ResNet-29, batch 8, cpu: compress=int8, offload=False" in out
    losses = [float(x) for x in re.findall(r"mean loss (\d+\.\d+)", out)]
    assert len(losses) == 4, out
    assert re.search(r"\d+ segments over 15 layers; predicted activation peak [\d.]+ MiB", out), out
    assert re.search(r"kept for backward after the last forward: [\d.]+ MiB on the device", out), out


def test_train_llama(tmp_path):
    pytest.importorskip("transformers")
    out = run([str(EXAMPLES / "train_llama.py")], cwd=tmp_path)
    assert re.search(r"block plan for 4 blocks, [1-4] checkpointed: predicted peak", out), out
    assert len(re.findall(r"step +\d+  loss \d+\.\d+", out)) == 8, out


def test_plan_at_scale(tmp_path):
    out = run([str(EXAMPLES / "plan_at_scale.py")], cwd=tmp_path)
    assert "ResNet-164, batch 128, 32x32, as on CUDA (meta tensors)" in out
    for mode in ("nn.Sequential", "torch checkpoint", "actsave default", 'compress="int8"', "offload=True"):
        assert re.search(rf"^{re.escape(mode)} +[\d.]+ MiB", out, flags=re.MULTILINE), (mode, out)
    applied = re.search(r"applied and estimated: ([\d.]+) MiB on the device \(predicted ([\d.]+)\)", out)
    assert applied and applied.group(1) == applied.group(2), out


def readme_block_after(heading: str) -> str:
    text = (ROOT / "README.md").read_text()
    section = text.split(f"\n## {heading}\n", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```python\n(.*?)```", section, flags=re.DOTALL)[0]


def test_the_readme_hugging_face_snippet_runs_as_pasted(tmp_path):
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    script = tmp_path / "hugging_face.py"
    script.write_text(readme_block_after("Hugging Face"))
    env_run = [str(script)]
    done = subprocess.run([sys.executable, *env_run], cwd=tmp_path, capture_output=True, text=True,
                          timeout=TIMEOUT_S, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, f"{done.stdout}\n{done.stderr}"
    assert (tmp_path / "out").is_dir()
