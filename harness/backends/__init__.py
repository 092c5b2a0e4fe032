"""Backends: where a run's parts live (this process, or Ray actors); ``labrl.harness.backends.parts`` builds them."""
