"""
Techniques from after the lecture, one file each: ZeRO++, FP8 training, the activation dial
(selective checkpointing, every K-th block, offload), the chunked loss head.

Read the top level first. Each file here opens with its idea in plain form, then the
optimised version; the lecture's files import one only when its flag is set.
"""
