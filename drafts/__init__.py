"""A draft as an object: built from its target's config, saved and loaded, and measured against its target
(acceptance per prompt set, its plots); the feature head's teacher pass and unroll live here too."""
