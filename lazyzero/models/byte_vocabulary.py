"""The built-in byte tokenizer's vocabulary (lazyzero/app/data/tokenizer.py), which the shipped model
presets are sized for: UTF-8 bytes as ids 0..255, then pad, bos and eos."""

NUM_BYTES = 256
BYTE_PAD_ID = NUM_BYTES
BYTE_BOS_ID = NUM_BYTES + 1
BYTE_EOS_ID = NUM_BYTES + 2
BYTE_VOCAB_SIZE = NUM_BYTES + 3
