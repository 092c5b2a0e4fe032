"""``labrl`` in a subprocess with ``test/pool-hang-v0`` registered (the exit test signals this process).

The guard matters: the process pool's forkserver re-imports this script in each worker.
"""

from __future__ import annotations

import sys

if __name__ == "__main__":
    from labrl.envs import register

    register("test/pool-hang-v0", entry_point="labrl_test_envs:PoolHangEnv")

    from labrl.cli import main

    raise SystemExit(main(sys.argv[1:]))
