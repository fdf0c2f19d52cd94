# nanoGPT's GPU baseline for shakespeare_char: 6 layers, 6 heads, 384 wide, context 256.
#   python train.py --config config/shakespeare_char.py --bf16
#   torchrun --nproc_per_node=8 train.py --config config/shakespeare_char.py --bf16 --zero 2
# nanoGPT reaches val loss about 1.47 after 5000 steps (a few minutes on one A100).
out_dir = "out-shakespeare-char"
dataset = "shakespeare_char"
n_layer = 6
n_head = 6
n_embd = 384
block_size = 256
batch_size = 64
dropout = 0.2
learning_rate = 1e-3
max_iters = 5000
lr_decay_iters = 5000
min_lr = 1e-4
warmup_iters = 100
beta2 = 0.99
eval_interval = 250
eval_iters = 200
log_interval = 10
