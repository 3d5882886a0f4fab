"""trainguard checkpoint library: per-step asynchronous snapshots, tiered and replicated across parallel
groups, with manifests and verification.

Guarantees (details in each module):

* a training step blocks only for copying its state into a pre-allocated buffer in shared memory; a saver
  process on the machine (:mod:`trainguard.checkpoint.saver`) persists it and keeps the newest in memory. When the
  saver falls behind, the step waits for a free buffer, bounded, so every rank keeps the same steps; a
  saver that frees none in that time costs the snapshot, and later ones skip without waiting until it
  frees one (:mod:`trainguard.checkpoint.engine`);
* every copy appears whole or not at all, as safetensors files plus a JSON manifest with per-file sizes
  and sha256 and every tensor's name, dtype and shape; nothing is pickled (:mod:`trainguard.checkpoint.layout`,
  :mod:`trainguard.checkpoint.shards`, :mod:`trainguard.checkpoint.manifest`);
* each rank's snapshot also lives on a backup rank that shares none of its TP/PP/DP groups, on another
  machine, sent saver to saver over TCP (with ``saver="thread"``: over gloo groups of the checkpoint's own,
  :mod:`trainguard.checkpoint.wire`), and every K steps or on request in S3 (:mod:`trainguard.checkpoint.s3`);
* restore takes the newest step every rank can get - the saver's memory, own disk, then the replica
  holder, then S3 - and
  never a copy that fails verification; a bad copy is reported with machine, rank, step, tier and path
  and the next copy or an older step is used (:mod:`trainguard.checkpoint.plan`, :mod:`trainguard.checkpoint.engine`);
* :mod:`trainguard.checkpoint.verify` holds the plain functions the control plane calls on a checkpoint directory or
  S3 prefix (checksums, tensors, finite values, metrics with great-expectations) and marks verified steps.

Importing this package imports nothing heavy; ``trainguard.checkpoint.verify`` imports torch, safetensors and
great-expectations only inside the functions that need them.
"""
