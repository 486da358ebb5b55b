"""Scripts that run in an engine's own environment, not draftsmith's: vLLM's venv runs `vllm_corpus.py` (a training
corpus) and `vllm_judge.py` (the deploy check) by path. They import no draftsmith, and sit in a folder of their own:
Python puts a script's folder first on its path, and beside `engines/vllm.py` their `import vllm` would find
ours instead of vLLM."""
