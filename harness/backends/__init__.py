"""Backends: where a run's parts live.

``parts`` builds them (tokenizer, env factory, learner, sampler, warm start);
``base`` says what a backend hands ``train`` (``Backend``, ``RunParts``);
``inprocess`` keeps everything in this process; ``ray`` places them as actors.
"""
