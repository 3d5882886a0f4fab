"""trainguard checkpoint library: per-step asynchronous snapshots, tiered and
replicated across parallel groups, with manifests and verification.
"""
