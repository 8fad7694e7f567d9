"""A checkpoint on disk and the read-only views of it that methods see.

`reader`: safetensors shards read tensor by tensor, without loading the model (`CheckpointReader`), and the
fingerprint that guards a user's files; `view`: the streamed method view over a checkpoint
(`StreamedAdapter`, one decoder layer resident at a time) and where plan tensors spill to disk on it.
"""

from .reader import CheckpointReader, checkpoint_fingerprint, legacy_fingerprint

__all__ = ["CheckpointReader", "checkpoint_fingerprint", "legacy_fingerprint"]
