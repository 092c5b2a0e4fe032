"""labrl.verifiers.xrd"""
