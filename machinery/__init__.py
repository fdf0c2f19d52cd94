"""
The product's machinery: what makes nanoZeRO safe to run, not what the lecture teaches.

Skip this folder on a first read. Each file guards one thing (its first line says which):
file claims checked before use, the run folder and its lock, safe tensor files, adapter
files, Hugging Face in and out, --init-from, the memory estimator's arithmetic, the
activation meter, the console and metrics rows. The lecture's files call these in one line.
"""
