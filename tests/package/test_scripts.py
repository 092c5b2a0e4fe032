"""The README's Python, run as a script: guarded it works; unguarded it fails saying what to add."""

from __future__ import annotations

import subprocess
import sys
import textwrap

SNIPPET = """
import asyncio

import labrl.envs
from labrl.envs import Action


async def main():
    env = labrl.envs.make("xrd/phase-id-v0", tier=1, n_peaks=6, n_candidates=4)
    task = env.make_task("train", seed=0)
    await env.reset(task)  # measures the sample in the process pool
    res = await env.step(Action(text="C"))
    print("outcome", res.outcome.value, "reward", res.reward)
    await env.close()
"""


def _run(tmp_path, body: str) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "snippet.py"
    script.write_text(textwrap.dedent(SNIPPET) + body)
    return subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=300, cwd=tmp_path
    )


def test_guarded_snippet_runs_as_a_script(tmp_path):
    proc = _run(tmp_path, '\nif __name__ == "__main__":\n    asyncio.run(main())\n')
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("outcome ok reward ")


def test_unguarded_snippet_fails_saying_what_to_add(tmp_path):
    proc = _run(tmp_path, "\nasyncio.run(main())\n")
    assert proc.returncode != 0
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("labrl.errors.EnvError: a process-pool worker died")
    assert 'must sit under `if __name__ == "__main__":`' in last
