"""labrl.harness"""
