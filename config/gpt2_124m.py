# GPT-2 small (124M parameters) on GPT-2 BPE tokens, ~0.5M tokens per step on any number of GPUs:
#   torchrun --nproc_per_node=8 train.py --config config/gpt2_124m.py --bf16 --zero 2
# With the shakespeare data set it overfits quickly; bring a larger corpus with
#   python data/prepare.py --input corpus.txt --tokenizer gpt2 --name mycorpus
# and train on it with --dataset mycorpus.
out_dir = "out-gpt2-124m"
dataset = "shakespeare"
n_layer = 12
n_head = 12
n_embd = 768
block_size = 1024
batch_size = 16
batch_tokens = 524288  # 2^19, ~0.5M tokens a step as GPT-2's: 4 micro-steps on 8 GPUs, 32 on 1
dropout = 0.0
bias = True
learning_rate = 6e-4
max_iters = 600000
lr_decay_iters = 600000
min_lr = 6e-5
warmup_iters = 2000
beta2 = 0.95
weight_decay = 0.1
eval_interval = 1000
eval_iters = 200
log_interval = 10
chunked_loss = True  # 16 x 1024 tokens x 50,304 columns: no fp32 logits of the whole batch
