"""labrl.interop: labrl envs served over other harnesses' environment protocols.

Each protocol is one module at the edge (``openenv_server``: OpenEnv); they build
on the protocol-neutral pieces here: ``manifest`` (what an env is, for hubs and
metadata routes), ``wire`` (a labrl step as a remote client sees it) and
``servers`` (protocol name -> app factory, what ``labrl envs serve`` offers).
The protocol packages are optional extras, imported only through
``labrl.extras.import_extra``. Nothing in the core imports this package except
the CLI (``labrl/commands/``).
"""
