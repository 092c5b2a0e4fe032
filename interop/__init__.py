"""labrl.interop: labrl spoken over other ecosystems' protocols, one module per protocol.

``madsci_node``: the mock lab (or any lab with labrl's REST API) served as a MADSci
node. The protocol packages are optional extras, imported only through
``labrl.extras.import_extra``; nothing in the core imports this package except the
CLI (``labrl/commands/``).
"""
