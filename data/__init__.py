"""Samples to train on: the target's own samples and conversations it regenerated, their rendering, the teacher's
kept logits and the prompt sets; made once per corpus, read by the trainer and the benches alike."""
