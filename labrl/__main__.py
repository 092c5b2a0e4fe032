"""``python -m labrl``, as ``labrl``: the form a launcher that runs modules takes
(``torchrun --nproc-per-node N -m labrl train CONFIG``, docs/gpu.md)."""

from labrl.cli import main

raise SystemExit(main())
