"""labrl.verifiers"""
