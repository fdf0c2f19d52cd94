# The CPU demo: nanoGPT's CPU recipe for shakespeare_char (also train.py's defaults).
#   python train.py --config config/shakespeare_char_cpu.py
#   torchrun --nproc_per_node=2 train.py --config config/shakespeare_char_cpu.py --zero 2
# Expect val loss about 1.90 after 2000 steps (1.901-1.913 over 3 seeds, `python -m bench.quality`;
# nanoGPT's README: 1.88), a few minutes on 2 CPU cores.
out_dir = "out"  # where `python train.py` (its defaults) writes too: sample.py reads it
dataset = "shakespeare_char"
n_layer = 4
n_head = 4
n_embd = 128
block_size = 64
batch_size = 12
dropout = 0.0
learning_rate = 1e-3
max_iters = 2000
lr_decay_iters = 2000
min_lr = 1e-4
warmup_iters = 100
beta2 = 0.99
eval_interval = 250
eval_iters = 20
log_interval = 10
