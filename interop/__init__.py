"""labrl.interop: labrl spoken over other ecosystems' protocols, one module per protocol.

Envs served over environment protocols (``openenv_server``: OpenEnv; ``ors_server``: the
Open Reward Standard) build on the protocol-neutral pieces here: ``manifest`` (what an env is, for hubs and metadata
routes), ``wire`` (a labrl step as a remote client sees it) and ``servers`` (protocol
name -> app factory, what ``labrl envs serve`` offers); the ORS server is labrl's own
(``ors_session``: one session, one episode; ``asgi``: the ASGI pieces it speaks with).
``madsci_node``: the mock lab (or any lab with labrl's REST API) served as a MADSci node.
The protocol packages are optional extras, imported only through ``labrl.extras.import_extra``. Nothing in the
core imports this package except the CLI (``labrl/commands/``).
"""
