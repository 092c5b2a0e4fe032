"""labrl.lab_adapters"""
