"""What plays, batches and imitates episodes: group rollouts against a sampler, collation, the SFT warm start."""
